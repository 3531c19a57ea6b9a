"""GGUF files of tiny checkpoints, written with the gguf package's writer as llama.cpp's converter
lays them out (metadata under the architecture's keys, a gpt2-style BPE vocabulary, one tensor per
projection, experts stacked in 3-D tensors), for tests that load a family from GGUF."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3moe"}
F32 = GGMLQuantizationType.F32


def write_gguf(hf_dir: str, path: str, qtype: GGMLQuantizationType = GGMLQuantizationType.Q8_0) -> str:
    """The checkpoint at `hf_dir` as a GGUF file at `path`: its matmuls in `qtype` blocks, norms and
    embeddings in F32, the router in F32."""
    config = AutoConfig.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    arch = ARCHITECTURES[config.architectures[0]]
    writer = GGUFWriter(path, arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if arch == "qwen3moe":
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    _add_vocabulary(writer, hf_dir, tokenizer)
    tensors = {name: t.detach().numpy() for name, t in model.state_dict().items()}

    def add(name: str, data: np.ndarray, kind: GGMLQuantizationType) -> None:
        data = np.ascontiguousarray(data, dtype=np.float32)
        writer.add_tensor(name, data if kind == F32 else quantize(data, kind), raw_dtype=kind)

    add("token_embd.weight", tensors["model.embed_tokens.weight"], F32)
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}."
        add(f"blk.{i}.attn_norm.weight", tensors[layer + "input_layernorm.weight"], F32)
        add(f"blk.{i}.ffn_norm.weight", tensors[layer + "post_attention_layernorm.weight"], F32)
        for part, name in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("output", "o_proj")):
            add(f"blk.{i}.attn_{part}.weight", tensors[layer + f"self_attn.{name}.weight"], qtype)
        add(f"blk.{i}.attn_q_norm.weight", tensors[layer + "self_attn.q_norm.weight"], F32)
        add(f"blk.{i}.attn_k_norm.weight", tensors[layer + "self_attn.k_norm.weight"], F32)
        if layer + "mlp.experts.gate_up_proj" in tensors:
            gate, up = np.split(tensors[layer + "mlp.experts.gate_up_proj"], 2, axis=1)  # (E, I, H) each
            add(f"blk.{i}.ffn_gate_inp.weight", tensors[layer + "mlp.gate.weight"], F32)
            add(f"blk.{i}.ffn_gate_exps.weight", gate, qtype)
            add(f"blk.{i}.ffn_up_exps.weight", up, qtype)
            add(f"blk.{i}.ffn_down_exps.weight", tensors[layer + "mlp.experts.down_proj"], qtype)
        else:
            for part in ("gate", "up", "down"):
                add(f"blk.{i}.ffn_{part}.weight", tensors[layer + f"mlp.{part}_proj.weight"], qtype)
    add("output_norm.weight", tensors["model.norm.weight"], F32)
    add("output.weight", tensors["lm_head.weight"], qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_vocabulary(writer: GGUFWriter, hf_dir: str, tokenizer) -> None:
    """The byte-level BPE as llama.cpp keeps one: its tokens in id order, their types, merges."""
    model = json.loads((Path(hf_dir) / "tokenizer.json").read_text())["model"]
    tokens = [token for token, _ in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])]
    special = set(tokenizer.all_special_tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token in special else 1 for token in tokens])  # control or normal
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model["merges"]])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)
