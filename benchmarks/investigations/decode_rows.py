"""Where the quantized matmul should switch from the C++ block kernel to its large-batch path (the
AMX tile GEMM where the CPU has it, else the vector GEMM where the build has one, else fp32 GEMM of
the dequantized weights; `decode_rows`, BlockQuantLinear.TILED_DECODE_ROWS / VECTOR_DECODE_ROWS /
DECODE_ROWS): both paths timed on the embedded model's own
matmuls (one layer's q/k/v, o, gate/up and down, plus the LM head), for each number of rows.

Per row count, the matmul time of a whole step: 30 layers' four matmuls plus the LM head, each
path's calls interleaved, median of `--repeats`. The kernel wins while its time is below GEMM's.
`--workload 8,20` then runs the 64-request workload (benchmarks/quantization.py) with each of
those limits set on the model's matmuls, interleaved, `--workload-repeats` rounds.

    python benchmarks/investigations/decode_rows.py [--quantization gguf] [--rows 1,2,4,6,8,10,12,16,24,32]
        [--repeats 30]
        [--workload 8,20] [--workload-repeats 2]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[2]))
from benchmarks.quantization import cpu_features  # noqa: E402
from engine.config import ModelConfig  # noqa: E402
from engine.model_setup import load_model  # noqa: E402
from engine.models.linear import BlockQuantLinear  # noqa: E402


def step_matmuls(model) -> list[tuple[BlockQuantLinear, int]]:
    """(matmul, times it runs per step): the first layer's, as every layer's, and the LM head."""
    layer = [m for m in model.layers[0].modules() if isinstance(m, BlockQuantLinear)]
    head = [m for name, m in model.named_modules() if isinstance(m, BlockQuantLinear) and "layers" not in name]
    return [(m, model.num_layers) for m in layer] + [(m, 1) for m in head]


def step_seconds(matmuls: list[tuple[BlockQuantLinear, int]], inputs: list[torch.Tensor], path: str,
                 calls: int = 3) -> float:
    """One step's matmul time on `path` ('forward_kernel', 'forward_tiles', 'forward_vector' or 'forward_gemm')."""
    total = 0.0
    for (matmul, per_step), x in zip(matmuls, inputs):
        forward = getattr(matmul, path)
        t0 = time.perf_counter()
        for _ in range(calls):
            forward(x)
        total += per_step * (time.perf_counter() - t0) / calls
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quantization", default="gguf")
    parser.add_argument("--rows", default="1,2,4,6,8,10,12,16,24,32")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--workload", default="", help="row limits to compare on the 64-request workload")
    parser.add_argument("--workload-repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(2)
    print(cpu_features())
    model = load_model(ModelConfig(quantization=args.quantization)).model
    matmuls = step_matmuls(model)
    batch_path = ("forward_tiles" if all(m.tiled for m, _ in matmuls) else
                  "forward_vector" if all(m.vectored for m, _ in matmuls) else "forward_gemm")
    rows_list = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)
    results = []
    with torch.inference_mode():
        for rows in rows_list:
            inputs = [torch.randn(rows, m.weight.shape[1]) for m, _ in matmuls]
            paths = {"kernel_ms": "forward_kernel", "gemm_ms": batch_path}
            if batch_path != "forward_gemm":  # fp32 GEMM beside it: what the batch kernel replaces
                paths["fp32_gemm_ms"] = "forward_gemm"
            times = {name: [] for name in paths}
            for _ in range(args.repeats):
                for name, path in paths.items():
                    times[name].append(step_seconds(matmuls, inputs, path))
            row = {"rows": rows, **{name: round(1e3 * statistics.median(t), 2) for name, t in times.items()}}
            row["gemm_over_kernel"] = round(row["gemm_ms"] / row["kernel_ms"], 2)
            results.append(row)
            print(json.dumps(row), flush=True)
    faster = [r["rows"] for r in results if r["kernel_ms"] < r["gemm_ms"]]
    print(json.dumps({"quantization": args.quantization, "batch_path": batch_path,
                      "kernel_faster_up_to": max(faster, default=0), "decode_rows": matmuls[0][0].decode_rows}))
    if args.workload:
        compare_on_workload(args.quantization, [int(v) for v in args.workload.split(",")], args.workload_repeats)


def compare_on_workload(quantization: str, limits: list[int], repeats: int) -> None:
    """The 64-request workload's useful tok/s with each kernel row limit, interleaved."""
    from benchmarks.quantization import bench_engine, workload
    from engine.cpu_kernels import load_cpu_kernels

    llms = {}
    for limit in limits:
        llms[limit] = bench_engine(quantization)
        model = llms[limit].engine.runner.model
        for module in model.modules():  # this engine's own limit: each matmul's, then its decode stack's
            if isinstance(module, BlockQuantLinear):
                module.decode_rows = limit
        model.fuse_decode_stack(load_cpu_kernels())
    speeds: dict[int, list[float]] = {limit: [] for limit in limits}
    for _ in range(repeats):
        for limit, llm in llms.items():
            speeds[limit].append(workload(llm)[0])
    base = statistics.median(speeds[limits[0]])
    for limit in limits:
        tok_s = statistics.median(speeds[limit])
        print(json.dumps({"decode_rows": limit, "workload_tok_s": round(tok_s, 1),
                          "ratio": round(tok_s / base, 3), "runs": [round(v, 1) for v in speeds[limit]]}))


if __name__ == "__main__":
    main()
