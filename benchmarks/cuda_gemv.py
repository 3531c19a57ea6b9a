"""A decode step's matmuls on one NVIDIA GPU, cuBLAS (F.linear) against the Triton matrix-vector
kernel (engine/models/cuda_ops.py `gemv`), at the shapes of benchmarks/cuda_engine.py's models in
bfloat16, for 1, 2 and 4 rows: microseconds a call and the weights' bytes read per second. The MLP's
down projection is compared as the engine runs it: the SwiGLU kernel then F.linear, against `gemv`
with the SwiGLU as its prologue. Each call reads a different copy of the weights (copies enough to
outgrow the L2 cache, as a step's layers do), and the calls are replayed from one CUDA graph, as a
decode step's are. `--sweep` also times every tile setting for one row, to tune gemv_config.

    python benchmarks/cuda_gemv.py [--models llama-1b,smollm2-135m] [--sweep] [--json OUT]
"""
import argparse
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.cuda_engine import SHAPES  # noqa: E402
from engine.models import cuda_ops  # noqa: E402

ROWS = (1, 2, 4)
SWEEP = [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s)
         for n, k, w, s in itertools.product((4, 8, 16, 32), (128, 256, 512), (4, 8), (1, 3))]
L2_OUTGROWN = 256 << 20  # bytes of weights the calls of one timing read, several times the L2 cache


def matmuls(shape: dict) -> dict[str, tuple[int, int]]:
    """name: (N, K) of a layer's matmuls and the LM head."""
    hidden, head_dim = shape["hidden_size"], shape["hidden_size"] // shape["num_attention_heads"]
    heads = shape["num_attention_heads"] + 2 * shape["num_key_value_heads"]
    return {"qkv": (heads * head_dim, hidden), "o": (hidden, hidden),
            "gate_up": (2 * shape["intermediate_size"], hidden), "down": (hidden, shape["intermediate_size"]),
            "lm_head": (shape["vocab_size"], hidden)}


def time_calls(fn, weights: list[torch.Tensor], x: torch.Tensor, replays: int = 20) -> float:
    """Seconds a call of fn(x, w), one call per weight copy in one graph, replayed."""
    for w in weights:  # compiled, and any workspace made, before capture
        fn(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(x, w)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / (replays * len(weights))


def bench_shape(name: str, n: int, k: int, sweep: bool) -> dict:
    nbytes = n * k * 2
    weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
               for _ in range(max(2, -(-L2_OUTGROWN // nbytes)))]
    swiglu = name == "down"
    entry = {"n": n, "k": k, "weight_bytes": nbytes}
    for rows in ROWS:
        x = torch.randn(rows, 2 * k if swiglu else k, dtype=torch.bfloat16, device="cuda")
        if swiglu:
            cublas = time_calls(lambda x, w: F.linear(cuda_ops.swiglu(x), w), weights, x)
        else:
            cublas = time_calls(lambda x, w: F.linear(x, w), weights, x)
        triton = time_calls(lambda x, w: cuda_ops.gemv(x, w, swiglu=swiglu), weights, x)
        entry[rows] = {"cublas_us": cublas * 1e6, "gemv_us": triton * 1e6,
                       "cublas_tb_s": nbytes / cublas / 1e12, "gemv_tb_s": nbytes / triton / 1e12}
        print(f"{name:<8} {n:>6} x {k:<5} rows {rows}: cuBLAS {cublas * 1e6:7.2f} us "
              f"({nbytes / cublas / 1e12:.2f} TB/s)  gemv {triton * 1e6:7.2f} us ({nbytes / triton / 1e12:.2f} TB/s)",
              flush=True)
    if sweep:
        x = torch.randn(1, 2 * k if swiglu else k, dtype=torch.bfloat16, device="cuda")
        timings = []
        for config in SWEEP:
            seconds = time_calls(lambda x, w, c=config: cuda_ops.gemv(x, w, swiglu=swiglu, config=c), weights, x)
            timings.append({**config, "us": seconds * 1e6, "tb_s": nbytes / seconds / 1e12})
        timings.sort(key=lambda t: t["us"])
        entry["sweep_rows_1"] = timings
        print(f"         best for one row: {timings[:3]}", flush=True)
    del weights
    torch.cuda.empty_cache()
    return entry


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama-1b,smollm2-135m")
    ap.add_argument("--sweep", action="store_true", help="time every setting of SWEEP for one row")
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args()
    results = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
               "models": {}}
    for model in args.models.split(","):
        shape = SHAPES[model]
        entries = {name: bench_shape(name, n, k, args.sweep) for name, (n, k) in matmuls(shape).items()}
        layers = shape["num_hidden_layers"]
        for rows in ROWS:  # a decode step's matmuls: each layer's, then the LM head once
            step = {kind: sum(e[rows][f"{kind}_us"] * (1 if name == "lm_head" else layers)
                              for name, e in entries.items()) for kind in ("cublas", "gemv")}
            entries[f"step_rows_{rows}_us"] = step
            print(f"{model}, a decode step's matmuls, {rows} row(s): cuBLAS {step['cublas']:.0f} us, "
                  f"gemv {step['gemv']:.0f} us ({step['cublas'] / step['gemv']:.2f}x)", flush=True)
        results["models"][model] = entries
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
