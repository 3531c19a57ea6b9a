"""The large-batch kernel of this CPU (the AMX tile GEMM, engine/csrc/block_quant_gemm.cpp, or else
the vector GEMM, engine/csrc/vector_gemm.cpp) against the path it replaces (fp32 GEMM of the
dequantized blocks past 28 rows, the decode kernel and stack up to 28), two engines in one
process, alternating rounds, the order swapped each round: single-stream decode, one 512-token
prefill and the 64-request workload (benchmarks/quantization.py), with the CPU's features.

    .venv/bin/python benchmarks/investigations/batch_kernels.py [--quantization gguf] [--kv-cache-dtype float16]
        [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.quantization import bench_engine, cpu_features, prefill, single_stream, workload  # noqa: E402
from benchmarks.workload import random_prompt  # noqa: E402
from engine import SamplingParams  # noqa: E402
from engine.cpu_kernels import load_cpu_kernels  # noqa: E402
from engine.models.linear import BlockQuantLinear  # noqa: E402

MEASURES = {"decode_tok_s": single_stream, "prefill_tok_s": prefill, "workload_tok_s": workload}


def matmuls(llm) -> list[BlockQuantLinear]:
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, BlockQuantLinear)]


def without_batch_kernel(llm) -> None:
    """The engine's matmuls as on a CPU with neither kernel: fp32 GEMM past DECODE_ROWS."""
    for module in matmuls(llm):
        module.tiled = module.vectored = False
        module.decode_rows = BlockQuantLinear.DECODE_ROWS
    llm.engine.runner.model.fuse_decode_stack(load_cpu_kernels())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quantization", default="gguf")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "float16"))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(cpu_features(), "; vector GEMM build:", load_cpu_kernels().vector_gemm_isa())
    engines = {"batch kernel": bench_engine(args.quantization, 0, args.kv_cache_dtype),
               "fp32 gemm": bench_engine(args.quantization, 0, args.kv_cache_dtype)}
    kernel = {"tiles" if m.tiled else "vector" if m.vectored else "fp32 gemm" for m in matmuls(engines["batch kernel"])}
    if kernel == {"fp32 gemm"}:
        sys.exit("this CPU (or build) has neither the AMX tiles nor a vector GEMM branch: nothing to compare")
    print("the batch kernel engine's large-batch path:", ", ".join(sorted(kernel)))
    without_batch_kernel(engines["fp32 gemm"])
    for llm in engines.values():
        llm.generate([random_prompt(64)], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    runs: dict[str, dict[str, list[float]]] = {name: {m: [] for m in MEASURES} for name in engines}
    for r in range(args.repeats):
        for measure, run in MEASURES.items():
            for name in engines if r % 2 == 0 else reversed(engines):
                value, sw = run(engines[name])
                runs[name][measure].append(value)
                print(f"run {r} {name:12} {measure:15} {value:8.1f}  cpu/wall {sw.cpu_util:.2f}  "
                      f"others {sw.others:.2f}", flush=True)
    medians = {n: {m: round(statistics.median(v), 1) for m, v in r.items()} for n, r in runs.items()}
    ratios = {m: [round(k / g, 3) for k, g in zip(runs["batch kernel"][m], runs["fp32 gemm"][m])] for m in MEASURES}
    print(json.dumps({"quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype, "medians": medians,
                      "ratio_by_round": ratios}))


if __name__ == "__main__":
    main()
