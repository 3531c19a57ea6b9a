"""The decode kernel's speed on each GGUF type it runs: one matmul (8192 x 2048 weights, a 1B
model's MLP shape), one token, as a decode step calls it (engine/csrc/block_quant_linear.cpp,
gguf_rows.cpp), in the engine's build or one built for an older CPU family (`--march`, as
CBSERVE_CPU_MARCH names them: the byte form exists on AVX512-VNNI builds only). The blocks are
random bytes with fp16 scales of a weight's size: the kernels' work does not depend on the values.

    .venv/bin/python benchmarks/gguf_kernels.py [--threads 1] [--march skylake-avx512] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.quantization import cpu_features  # noqa: E402
from engine.cpu_kernels import load_cpu_kernels  # noqa: E402
from engine.models.gguf_types import KERNEL_FORMATS, kernel_rows  # noqa: E402

T = GGMLQuantizationType
# where each type's fp16 scales (d, and K-quants' dmin) sit in its block
FP16_AT = {T.Q8_0: (0,), T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q4_K: (0, 2),
           T.Q5_K: (0, 2), T.Q6_K: (208,), T.IQ4_XS: (0,)}


def random_rows(qtype: GGMLQuantizationType, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """(rows, row bytes) of blocks of random bytes, each fp16 scale 1/256 (no denormals, no NaN)."""
    weights, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, cols // weights, block_bytes), dtype=np.uint8)
    for at in FP16_AT[qtype]:
        blocks[..., at:at + 2] = np.frombuffer(np.float16(1 / 256).tobytes(), dtype=np.uint8)
    return blocks.reshape(rows, -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--march", default=None, help="a cpu_kernels.TARGETS build (matmul kernels only)")
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--cols", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = load_cpu_kernels(args.march, matmuls_only=True) if args.march else load_cpu_kernels()
    print(cpu_features(), f"build {args.march or 'native'} ({kernels.vector_gemm_isa()}), {args.threads} threads")
    x = torch.randn(1, args.cols)
    for qtype, code in KERNEL_FORMATS.items():
        rows = torch.from_numpy(kernel_rows(random_rows(qtype, args.rows, args.cols, np.random.default_rng(0)), qtype))
        seconds = []
        for _ in range(args.repeats + 1):  # the first call warms the caches and the thread pool
            start = time.perf_counter()
            kernels.block_quant_linear(x, [rows], [code], None, None, 0.0, 0, None)
            seconds.append(time.perf_counter() - start)
        median = statistics.median(seconds[1:])
        print(f"{qtype.name:7s} {rows.numel() / 1e6:5.1f} MB  {median * 1e3:5.2f} ms  "
              f"{rows.numel() / median / 1e9:5.1f} GB/s  {args.rows * args.cols / median / 1e9:5.1f} G weights/s")


if __name__ == "__main__":
    main()
