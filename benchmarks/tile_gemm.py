"""The AMX tile GEMM (engine/csrc/block_quant_gemm.cpp) against the path it replaces on CPUs that
have it (fp32 GEMM of the dequantized blocks past 28 rows, the decode kernel and stack up to 28),
on the 64-request workload (benchmarks/quantization.py), two engines in one process, alternating
rounds, the order swapped each round.

    .venv/bin/python benchmarks/tile_gemm.py [--quantization gguf] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.quantization import bench_engine, cpu_features, workload  # noqa: E402
from benchmarks.workload import random_prompt  # noqa: E402
from engine import SamplingParams  # noqa: E402
from engine.models.linear import BlockQuantLinear  # noqa: E402


def without_tiles(llm) -> None:
    """The engine's matmuls as on a CPU without AMX: fp32 GEMM past DECODE_ROWS."""
    model = llm.engine.runner.model
    model.decode_rows = BlockQuantLinear.DECODE_ROWS
    for module in model.modules():
        if isinstance(module, BlockQuantLinear):
            module.tiled, module.decode_rows = False, BlockQuantLinear.DECODE_ROWS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quantization", default="gguf")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(cpu_features())
    engines = {"tiles": bench_engine(args.quantization, 0), "fp32 gemm": bench_engine(args.quantization, 0)}
    if not all(m.tiled for m in engines["tiles"].engine.runner.model.modules() if isinstance(m, BlockQuantLinear)):
        sys.exit("this CPU (or build) has no AMX tiles: nothing to compare")
    without_tiles(engines["fp32 gemm"])
    for llm in engines.values():
        llm.generate([random_prompt(64)], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    runs: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(args.repeats):
        for name in engines if r % 2 == 0 else reversed(engines):
            value, sw = workload(engines[name])
            runs[name].append(value)
            print(f"run {r} {name:9} workload_tok_s {value:7.1f}  cpu/wall {sw.cpu_util:.2f}  others {sw.others:.2f}",
                  flush=True)
    ratios = [t / g for t, g in zip(runs["tiles"], runs["fp32 gemm"])]
    print(json.dumps({"quantization": args.quantization, "medians": {n: statistics.median(v) for n, v in runs.items()},
                      "tiles_over_fp32_gemm_by_round": [round(x, 3) for x in ratios]}))


if __name__ == "__main__":
    main()
