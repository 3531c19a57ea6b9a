"""Model families at SmolLM2-135M's size on the CPU, interleaved in one run: no family second-class.

Checkpoints with random weights and the embedded model's tokenizer (vocabulary 49,152), all of
SmolLM2-135M-Instruct's shape (hidden 576, 30 layers, 9 heads, 3 KV heads, MLP 1536, tied
embeddings):
- llama: SmolLM2 itself (the baseline);
- qwen3: q/k norms;
- gemma3: Gemma 3's layer (post-norms, q/k norms, GeGLU, scaled embeddings), five sliding layers
  (window 512, base 10,000) to one global (base 1,000,000);
- qwen3_moe: 8 experts, 2 routed a token, each expert's MLP 768 wide, so a token's active
  parameters are the dense model's;
- llama (transformers): the llama checkpoint through transformers' own modeling code with the
  paged attention (model_impl 'transformers'), against native.
Each runs `--mode` (int8 by default: the mode `auto` picks for a Hugging Face checkpoint on a
CPU without AMX tiles; random weights' flat logits pass no quality check, so the mode is forced),
and is measured as benchmarks/quantization.py measures modes: single-stream decode tok/s (128-token
prompt, 128 new), the 64-request mixed workload's output tok/s, a 512-token prefill; the families
alternate within each of --rounds rounds and medians are printed with ratios to llama's.

The sliding window's KV memory: one 8,192-token request through the Gemma-3-shaped model, the
blocks its KV groups hold at the end against what full attention in every layer would hold.

    .venv/bin/python benchmarks/families.py [--rounds 3] [--mode int8] [--families llama,qwen3,...] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.quantization import cpu_features, prefill, single_stream, workload  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.kv_cache.layout import NULL_BLOCK  # noqa: E402
from engine.model_loader import hf_directory  # noqa: E402

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=16384,
               rms_norm_eps=1e-5, tie_word_embeddings=True, initializer_range=0.02)
SHAPES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e5})),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e5})),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        sliding_window=512, query_pre_attn_scalar=64,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 5)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=768, norm_topk_prob=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e5})),
}
FAMILIES = ("llama", "qwen3", "gemma3", "qwen3_moe", "llama (transformers)")


def checkpoint(arch: str, directory: Path) -> str:
    """A 135M-shaped checkpoint of `arch` with random weights and the embedded tokenizer."""
    config_name, model_name, fields = SHAPES[arch]
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_directory(None))
    config = getattr(transformers, config_name)(**SMOLLM2, **fields, bos_token_id=tokenizer.bos_token_id,
                                                eos_token_id=tokenizer.eos_token_id,
                                                pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config)
    path = directory / arch
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def engine(path: str, mode: str, family: str) -> LLM:
    return LLM(path, quantization=mode, quality_check_tokens=0, max_num_seqs=64, max_num_batched_tokens=512,
               num_threads=2, enable_prefix_caching=False,
               model_impl="transformers" if family.endswith("(transformers)") else "auto")


def window_memory(path: str, mode: str, context: int = 8192) -> dict:
    """One `context`-token request through the Gemma-3-shaped model: the blocks its KV groups hold
    at its last step, in blocks of one layer's memory, against full attention in every layer."""
    llm = LLM(path, quantization=mode, quality_check_tokens=0, enable_prefix_caching=False, num_threads=2,
              max_num_batched_tokens=512)
    kv, engine_ = llm.engine.kv, llm.engine
    engine_.add_request("long", list(range(100, 100 + context - 4)), SamplingParams(max_tokens=4, temperature=0,
                                                                                     ignore_eos=True))
    held = None
    while engine_.has_unfinished_requests():
        engine_.step()
        if "long" in kv.block_tables:
            held = [sum(b != NULL_BLOCK for b in table) for table in kv.block_tables["long"]]
    layout = kv.layout
    layer_blocks = layout.num_slots * sum(held)  # a block is one block of memory in each cache slot
    full = llm.engine.loaded.model.num_layers * -(-context // kv.block_size)
    return {"context": context, "held_per_group": held, "windows": list(layout.windows),
            "held_layer_blocks": layer_blocks, "full_attention_layer_blocks": full,
            "ratio": layer_blocks / full}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mode", default="int8")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--json")
    args = ap.parse_args()
    families = args.families.split(",")
    print(f"CPU: {cpu_features()}; threads {torch.get_num_threads()}; mode {args.mode}", flush=True)
    directory = Path(tempfile.mkdtemp(prefix="families_"))
    paths = {arch: checkpoint(arch, directory) for arch in {f.split(" ")[0] for f in families}}
    engines = {family: engine(paths[family.split(" ")[0]], args.mode, family) for family in families}
    for family, llm in engines.items():
        report = llm.engine.model_report
        print(f"{family}: {report.architecture} ({report.model_path}), {report.weight_bytes_per_token / 1e6:.0f} MB "
              f"of matmul weights per decode step, decode stack "
              f"{'on' if llm.engine.loaded.model.decode_stack is not None else 'off'}", flush=True)
    rounds = []
    for r in range(args.rounds):
        figures = {}
        for family, llm in engines.items():
            figures[family] = {"single_stream": single_stream(llm)[0], "workload": workload(llm)[0],
                               "prefill": prefill(llm)[0]}
            print(f"round {r + 1} {family}: " + ", ".join(f"{k} {v:.1f} tok/s" for k, v in figures[family].items()),
                  flush=True)
        rounds.append(figures)
    medians = {family: {k: statistics.median(r[family][k] for r in rounds) for k in rounds[0][family]}
               for family in families}
    print(f"\nmedians of {args.rounds} rounds (tok/s), ratio to llama's in brackets:")
    for family, m in medians.items():
        base = medians.get("llama", m)
        print(f"  {family:22s} " + ", ".join(f"{k} {v:7.1f} ({v / base[k]:.2f}x)" for k, v in m.items()))
    memory = window_memory(paths["gemma3"], args.mode) if "gemma3" in paths else None
    if memory:
        print(f"\nGemma-3-shaped KV blocks at a {memory['context']}-token context: {memory['held_layer_blocks']} "
              f"layer-blocks held vs {memory['full_attention_layer_blocks']} with full attention in every layer: "
              f"{memory['ratio']:.3f} (per group {memory['held_per_group']}, windows {memory['windows']})")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_features(), "mode": args.mode, "rounds": rounds,
                                               "medians": medians, "window_memory": memory}, indent=1))


if __name__ == "__main__":
    main()
