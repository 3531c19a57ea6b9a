"""The engine on one NVIDIA GPU: attention backend, CUDA graphs and async scheduling side by side, at two model sizes,
with transformers in the same run as the baseline (single-stream `generate`, and static batching:
the whole workload as one padded `generate` batch).

Models are randomly initialised with real models' shapes (random weights change no timing), built
locally in bfloat16 (no download): SmolLM2-135M (30 layers, hidden 576, 9 query and 3 KV heads of
64, vocab 49152) and Llama-3.2-1B (16 layers, hidden 2048, 32 query and 8 KV heads of 64, vocab
128256). For each engine configuration: the 64-request mixed workload (prompts 16-512, outputs
8-256, greedy, ignore_eos) in output tokens/s, and single-stream decode (128-token prompt, 128 new
tokens) in tokens/s; medians of --repeats runs after a warm-up. The single stream's bound is the
weights read once per token at the copy bandwidth measured here (a device-to-device copy).

    python benchmarks/cuda_engine.py [--models smollm2-135m,llama-1b] [--configs triton-graphs,...]
        [--no-transformers] [--repeats 3] [--json OUT]

`--configs ''` runs transformers alone; `--no-transformers` the engine alone (two revisions compared
by running this from a checkout of each).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time

import torch
from tokenizers import Tokenizer, models
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.workload import make_workload, random_prompt  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402

SHAPES = {
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3),
    "llama-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0),
}
CONFIGS = {  # name: engine arguments (bfloat16, the CUDA default dtype)
    "flash-eager": dict(attention_backend="flash", enforce_eager=True),  # torch's FlashAttention over gathers
    "triton-eager": dict(attention_backend="triton", enforce_eager=True),  # the paged kernel
    "triton-graphs": dict(attention_backend="triton"),  # the paged kernel, decode steps in CUDA graphs (default)
    "triton-graphs-sync": dict(attention_backend="triton", async_scheduling=False),  # each step waited for
}
ENGINE_ARGS = dict(max_num_seqs=256, max_num_batched_tokens=4096, kv_cache_memory_bytes=16 << 30,
                   enable_prefix_caching=False)  # repeats must not reuse the previous run's prefills
SINGLE_PROMPT, SINGLE_NEW = 128, 128


def shaped_model(path: str, shape: dict, device: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> str:
    """A Llama of `shape` with random weights and a tokenizer of one word per id, saved at `path`."""
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(
        {f"t{i}": i for i in range(shape["vocab_size"])}, unk_token="t0")), eos_token="t0")
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**shape, max_position_embeddings=2048, tie_word_embeddings=True,
                                             eos_token_id=0))
    model.to(dtype).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def weight_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


def copy_bandwidth() -> float:
    """Bytes/s of a 4 GiB device-to-device copy, read plus written."""
    src = torch.empty(1 << 31, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = statistics.median(_timed(lambda: dst.copy_(src)) for _ in range(10))
    return 2 * src.numel() * src.element_size() / seconds


def _timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def bench_engine(model: str, engine_args: dict, workload, repeats: int) -> dict:
    llm = LLM(model, device="cuda", **ENGINE_ARGS, **engine_args)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in workload.output_lens]
    single = SamplingParams(max_tokens=SINGLE_NEW, temperature=0, ignore_eos=True)
    llm.generate(workload.prompts[:8], params[:8], use_tqdm=False)  # warm-up: kernels compiled
    mixed = [_timed(lambda: llm.generate(workload.prompts, params, use_tqdm=False)) for _ in range(repeats)]
    decode = [_timed(lambda s=s: llm.generate([random_prompt(SINGLE_PROMPT, seed=s)], single, use_tqdm=False))
              for s in range(repeats)]
    graphs = llm.engine.runner.graphs
    result = {"mixed_output_tok_s": workload.num_output_tokens / statistics.median(mixed),
              "single_stream_tok_s": SINGLE_NEW / statistics.median(decode),
              "graph_sizes": graphs.sizes if graphs is not None else [],
              "graph_replays": graphs.replays if graphs is not None else 0}
    return result


def bench_transformers(model: str, workload, repeats: int) -> dict:
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).to("cuda").eval()

    def once(seed):
        ids = torch.tensor([random_prompt(SINGLE_PROMPT, seed=seed)], device="cuda")
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=SINGLE_NEW, min_new_tokens=SINGLE_NEW,
                    do_sample=False, pad_token_id=0)

    def static_batch():
        """Every request in one left-padded batch, run to the longest output (static batching)."""
        width = max(map(len, workload.prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in workload.prompts], device="cuda")
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in workload.prompts], device="cuda")
        longest = max(workload.output_lens)
        hf.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest, do_sample=False,
                    pad_token_id=0)

    once(99)
    single = SINGLE_NEW / statistics.median(_timed(lambda s=s: once(s)) for s in range(repeats))
    static_batch()
    static = workload.num_output_tokens / statistics.median(_timed(static_batch) for _ in range(repeats))
    return {"single_stream_tok_s": single, "static_batch_output_tok_s": static}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(SHAPES))
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names of CONFIGS")
    ap.add_argument("--no-transformers", action="store_true", help="skip transformers' baselines")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args()
    bandwidth = copy_bandwidth()
    results = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
               "copy_bandwidth_bytes_s": bandwidth, "models": {}}
    configs = [c for c in args.configs.split(",") if c]
    for name in args.models.split(","):
        workload = make_workload(64, vocab_size=SHAPES[name]["vocab_size"])
        with tempfile.TemporaryDirectory() as tmp:
            model = shaped_model(tmp, SHAPES[name])
            entry = {"weight_bytes": weight_bytes(model)}
            if not args.no_transformers:
                entry["transformers"] = bench_transformers(model, workload, args.repeats)
                _free()  # each engine and model's memory back before the next
            for config in configs:
                entry[config] = bench_engine(model, CONFIGS[config], workload, args.repeats)
                _free()
        results["models"][name] = entry
        print_model(name, entry, configs, bandwidth)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


def print_model(name: str, entry: dict, configs: list[str], bandwidth: float) -> None:
    hf = entry.get("transformers")
    bound = bandwidth / entry["weight_bytes"]
    print(f"\n{name}: weights {entry['weight_bytes'] / 1e9:.2f} GB, copy bandwidth {bandwidth / 1e12:.2f} TB/s: "
          f"single-stream bound {bound:.0f} tok/s" + (f"; transformers bf16 single stream "
          f"{hf['single_stream_tok_s']:.1f} tok/s, static batching {hf['static_batch_output_tok_s']:.0f} tok/s"
                                                       if hf else ""))
    print(f"{'engine (bfloat16)':<28}{'64-req tok/s':>14}{'vs static':>11}{'single tok/s':>14}{'of bound':>10}")
    for config in configs:
        r = entry[config]
        vs_static = f"{r['mixed_output_tok_s'] / hf['static_batch_output_tok_s']:>10.2f}x" if hf else f"{'':>11}"
        print(f"{config:<28}{r['mixed_output_tok_s']:>14.0f}{vs_static}"
              f"{r['single_stream_tok_s']:>14.1f}{r['single_stream_tok_s'] / bound:>10.2f}")


if __name__ == "__main__":
    main()
