"""GGUF files of tiny checkpoints, written with the gguf package's writer as llama.cpp's converter
lays them out (metadata under the architecture's keys, a gpt2-style BPE vocabulary, one tensor per
projection, experts stacked in 3-D tensors), for tests that load a family from GGUF; and blocks of
every type the kernels run, as ggml lays them out: fitted to given weights (`quantize_blocks`: the
gguf package quantizes the 32-weight types only, so the K-quants and IQ4_XS are fitted here, the
simple way: no search for the best scales) or drawn at random (`random_blocks`)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import IQ4_NL, quantize
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3moe"}
F32 = GGMLQuantizationType.F32
T = GGMLQuantizationType
FITTED = (T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS)  # super-blocks of 256 weights


def write_gguf(hf_dir: str, path: str, qtype: GGMLQuantizationType = GGMLQuantizationType.Q8_0,
               types: dict[str, GGMLQuantizationType] | None = None) -> str:
    """The checkpoint at `hf_dir` as a GGUF file at `path`: its matmuls in `qtype` blocks (a tensor
    named in `types`, e.g. "blk.0.attn_v.weight", in its own), norms and embeddings in F32, the
    router in F32."""
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
        kind = (types or {}).get(name, kind)
        writer.add_tensor(name, data if kind == F32 else quantize_blocks(data, kind), raw_dtype=kind)

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


def quantize_blocks(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """`data` (..., K) in `qtype` blocks (..., K / block weights * block bytes) uint8."""
    if qtype not in FITTED:
        return quantize(data, qtype)
    shape = data.shape
    rows = data.reshape(-1, shape[-1]).astype(np.float32)
    fit = {T.Q4_K: _fit_q45_k, T.Q5_K: _fit_q45_k, T.Q6_K: _fit_q6_k, T.IQ4_XS: _fit_iq4_xs}[qtype]
    blocks = fit(rows.reshape(rows.shape[0], -1, 256), qtype)
    return blocks.reshape(*shape[:-1], -1)


def random_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random valid blocks (rows, row bytes): every byte drawn at random (quants, packed scales and
    mins, high bits), then the fp16 scales set to finite values of a weight's size."""
    weights, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // weights, size), dtype=np.uint8)

    def put_half(offset: int, low: float, high: float) -> None:
        values = rng.uniform(low, high, size=blocks.shape[:2]).astype(np.float16)
        blocks[..., offset:offset + 2] = values.view(np.uint8).reshape(*blocks.shape[:2], 2)

    if qtype == T.Q6_K:
        put_half(208, 0.0005, 0.002)  # d times an int8 sub-block scale times q - 32
    else:
        put_half(0, 0.002, 0.02)
        if qtype in (T.Q4_1, T.Q5_1):
            put_half(2, -0.1, 0.1)
        if qtype in (T.Q4_K, T.Q5_K):
            put_half(2, 0.0, 0.005)
    return blocks.reshape(rows, -1)


def _fp16(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Values as fp16: their bytes (..., 2) and the fp32 they read back as."""
    half = values.astype(np.float16)
    return half.view(np.uint8).reshape(*values.shape, 2), half.astype(np.float32)


def _divide(x: np.ndarray, by: np.ndarray) -> np.ndarray:
    return np.divide(x, by, out=np.zeros(np.broadcast(x, by).shape, np.float32), where=by != 0)


def _fit_q45_k(x: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """(N, S, 256) -> Q4_K or Q5_K super-blocks: per sub-block of 32 a 6-bit scale and min of the
    super-block's d and dmin, w = d * sc * q - dmin * mn."""
    top = 15 if qtype == T.Q4_K else 31
    sub = x.reshape(*x.shape[:2], 8, 32)
    low = np.minimum(sub.min(-1), 0)
    scale, mins = (sub.max(-1) - low) / top, -low
    d_bytes, d = _fp16(scale.max(-1) / 63)
    dmin_bytes, dmin = _fp16(mins.max(-1) / 63)
    sc = np.clip(np.round(_divide(scale, d[..., None])), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(_divide(mins, dmin[..., None])), 0, 63).astype(np.uint8)
    step = d[..., None] * sc
    q = np.clip(np.round(_divide(sub + (dmin[..., None] * mn)[..., None], step[..., None])), 0, top).astype(np.uint8)
    scales = np.concatenate([(sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6),
                             (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6),
                             (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)], axis=-1)
    pairs = (q & 15).reshape(*q.shape[:2], 4, 2, 32)
    nibbles = (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).reshape(*q.shape[:2], 128)
    fields = [d_bytes, dmin_bytes, scales]
    if qtype == T.Q5_K:
        high = (q >> 4) & 1  # (N, S, 8, 32): bit j of byte l is sub-block j's weight l
        fields.append((high << np.arange(8, dtype=np.uint8)[:, None]).sum(-2, dtype=np.uint8))
    return np.concatenate(fields + [nibbles], axis=-1)


def _fit_q6_k(x: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """(N, S, 256) -> Q6_K super-blocks: per sub-block of 16 an int8 scale of d, w = d * sc * (q - 32)."""
    sub = x.reshape(*x.shape[:2], 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d_bytes, d = _fp16(scale.max(-1) / 127)
    sc = np.clip(np.round(_divide(scale, d[..., None])), -128, 127).astype(np.int8)
    step = (d[..., None] * sc)[..., None]
    q = (np.clip(np.round(_divide(sub, step)), -32, 31) + 32).astype(np.uint8).reshape(*x.shape[:2], 2, 128)
    low = (q[..., :64] & 15) | ((q[..., 64:] & 15) << 4)  # (N, S, half, 64)
    high = q >> 4
    qh = high[..., 0:32] | (high[..., 32:64] << 2) | (high[..., 64:96] << 4) | (high[..., 96:128] << 6)
    return np.concatenate([low.reshape(*x.shape[:2], 128), qh.reshape(*x.shape[:2], 64),
                           sc.view(np.uint8), d_bytes], axis=-1)


def _fit_iq4_xs(x: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """(N, S, 256) -> IQ4_XS super-blocks: per sub-block of 32 a 6-bit scale ls of d, each weight
    the nearest of the 16 non-linear levels, w = d * (ls - 32) * level."""
    levels = np.array(IQ4_NL.kvalues, np.float32)
    sub = x.reshape(*x.shape[:2], 8, 32)
    scale = np.abs(sub).max(-1) / 113
    d_bytes, d = _fp16(scale.max(-1) / 31)
    ls = (np.clip(np.round(_divide(scale, d[..., None])), -32, 31) + 32).astype(np.uint8)
    step = d[..., None] * (ls.astype(np.float32) - 32)
    index = np.abs(_divide(sub, step[..., None])[..., None] - levels).argmin(-1).astype(np.uint8)
    scales_h = (((ls >> 4) & 3).astype(np.uint16) << (2 * np.arange(8, dtype=np.uint16))).sum(-1, dtype=np.uint16)
    scales_l = (ls[..., 0::2] & 15) | ((ls[..., 1::2] & 15) << 4)
    nibbles = (index[..., :16] | (index[..., 16:] << 4)).reshape(*x.shape[:2], 128)
    return np.concatenate([d_bytes, scales_h[..., None].view(np.uint8), scales_l, nibbles], axis=-1)
