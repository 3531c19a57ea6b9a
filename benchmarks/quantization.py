"""Quantization modes on the embedded SmolLM2-135M-Instruct (CPU), interleaved in one run.

Per mode (`none` = fp32, the reference; `int8` = every matmul as GGUF Q8_0 blocks; `gguf` = the
file's own Q4_1/Q8_0 blocks; both with activations quantized per block of 32 to 15 bits;
`w8a16`/`w4a16` = int8/int4 weights with bf16 activations, torch's weight-only kernels):
single-stream decode tok/s (128-token prompt, 128 new tokens, time per output
token after the first), prefill tok/s (one 512-token prompt), the 64-request mixed workload
(prompts 16-512, outputs 8-256: useful output tok/s), matmul weight bytes per decode step, and
teacher-forced quality against fp32 on the shipped text (each engine's start-up check,
engine/quantization_check.py). Each measurement is
taken --repeats times with the modes alternating, and the medians are printed with each run's
process cpu/wall (2 threads: ~2.0 means nothing else took the cores) and the cores' worth of CPU
other processes used meanwhile. Optional bar chart.

    .venv/bin/python benchmarks/quantization.py [--repeats 3] [--json OUT] [--plot OUT.png]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workload import Stopwatch, make_workload, random_prompt  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402

MODES = ("none", "int8", "gguf", "w8a16", "w4a16")


def cpu_features() -> str:
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    wanted = ["avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8"]
    return f"torch cpu capability {torch.backends.cpu.get_cpu_capability()}; flags: " + \
        " ".join(f for f in wanted if f in flags)


def single_stream(llm: LLM) -> tuple[float, Stopwatch]:
    """(decode tok/s after the first token, the run's Stopwatch)."""
    prompt = random_prompt(128, seed=5)
    with Stopwatch() as first:
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), use_tqdm=False)
    with Stopwatch() as full:
        llm.generate([prompt], SamplingParams(max_tokens=128, temperature=0, ignore_eos=True), use_tqdm=False)
    return 127 / (full.wall_s - first.wall_s), full


def prefill(llm: LLM) -> tuple[float, Stopwatch]:
    with Stopwatch() as sw:
        llm.generate([random_prompt(512, seed=6)], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    return 512 / sw.wall_s, sw


def workload(llm: LLM) -> tuple[float, Stopwatch]:
    wl = make_workload(64, seed=0)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in wl.output_lens]
    with Stopwatch() as sw:
        llm.generate(wl.prompts, params, use_tqdm=False)
    return wl.num_output_tokens / sw.wall_s, sw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quality-tokens", type=int, default=6000)
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args()
    print(cpu_features())
    # no prefix caching: repeats send the same prompts, and each must be computed again
    engines = {mode: LLM(quantization=mode, max_num_seqs=64, max_num_batched_tokens=512, num_threads=2,
                         enable_prefix_caching=False, quality_check_tokens=args.quality_tokens)
               for mode in MODES}
    for llm in engines.values():  # warm-up: kernels, allocator
        llm.generate([random_prompt(64)], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    measures = {"decode_tok_s": single_stream, "prefill_tok_s": prefill, "workload_tok_s": workload}
    runs: dict = {mode: {m: [] for m in measures} for mode in MODES}
    for r in range(args.repeats):
        for name, fn in measures.items():
            for mode in MODES if r % 2 == 0 else reversed(MODES):
                value, sw = fn(engines[mode])
                runs[mode][name].append(value)
                others = "n/a" if sw.others is None else f"{sw.others:.2f}"
                print(f"run {r} {mode:5} {name:15} {value:8.1f}  cpu/wall {sw.cpu_util:.2f}  others {others}",
                      flush=True)

    results: dict = {"cpu": cpu_features(), "modes": {}}
    loaded = {mode: engines[mode].engine.loaded for mode in MODES}
    for mode in MODES:  # the figures each engine's start-up check measured (engine/quantization_check.py)
        quality = loaded[mode].quality
        results["modes"][mode] = {
            **{name: statistics.median(values) for name, values in runs[mode].items()},
            "weight_mb_per_decode_step": loaded[mode].weight_bytes_per_token / 1e6,
            "top1_agreement": 1.0 if quality is None else quality.top1_agreement,
            "perplexity_increase": 0.0 if quality is None else quality.perplexity_increase,
        }
    base = results["modes"]["none"]
    print(f"\nmedians of {args.repeats}; quality on {args.quality_tokens} tokens of engine/data/english.txt")
    print(f"{'mode':5} {'decode tok/s':>12} {'prefill tok/s':>13} {'64-req tok/s':>12} {'MB/step':>8} "
          f"{'top-1 agree':>11} {'ppl vs fp32':>11}")
    for mode, m in results["modes"].items():
        print(f"{mode:5} {m['decode_tok_s']:12.1f} {m['prefill_tok_s']:13.1f} {m['workload_tok_s']:12.1f} "
              f"{m['weight_mb_per_decode_step']:8.0f} {m['top1_agreement']:11.4f} {m['perplexity_increase']:+11.2%}")
    for mode, m in results["modes"].items():
        ratios = {k: m[k] / base[k] for k in ("decode_tok_s", "prefill_tok_s", "workload_tok_s")}
        print(f"{mode}/none: decode x{ratios['decode_tok_s']:.2f}, prefill x{ratios['prefill_tok_s']:.2f}, "
              f"64-req x{ratios['workload_tok_s']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        labels = ["single stream decode", "64-request workload"]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for i, mode in enumerate(MODES):
            m = results["modes"][mode]
            width = 0.8 / len(MODES)
            ax.bar([x + width * i for x in range(2)], [m["decode_tok_s"], m["workload_tok_s"]], width, label=mode)
        ax.set_xticks([x + 0.4 - 0.4 / len(MODES) for x in range(2)], labels)
        ax.set_ylabel("output tokens/s")
        ax.set_title("SmolLM2-135M on 2 CPU cores, by quantization mode")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
