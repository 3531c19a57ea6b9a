"""The Llama-3.2-1B decode step's matmuls under each of torch's BLAS libraries on one NVIDIA GPU
(`torch.backends.cuda.preferred_blas_library`: cuBLAS, torch's default, and cuBLASLt), bfloat16,
for decode steps of a few rows. Each layer's four matmuls read weights of their own (16 layers:
more than the L2 holds), replayed from one CUDA graph: the whole step (16 layers and the LM head)
and each shape's 16 calls, microseconds a replay (the mean of 50). The libraries run
in turn, cuBLAS again last, so drift between them shows.

    python benchmarks/investigations/cuda_blas.py [--rows 1,8]
"""
import argparse

import torch
import torch.nn.functional as F

LAYER = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}
LM_HEAD = (128256, 2048)
LAYERS = 16


def replay_us(fn) -> float:
    """Mean microseconds of 50 replays of `fn` captured in a CUDA graph, after 5 untimed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # the library picks its kernels and workspaces outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(50):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 50 * 1e3


def step_times(layers: list[dict], head: torch.Tensor, rows: int) -> dict[str, float]:
    """Microseconds a replay: the whole step, each shape's 16 calls, the LM head."""
    x = torch.randn(rows, 2048, device="cuda", dtype=torch.bfloat16)
    act = torch.randn(rows, 8192, device="cuda", dtype=torch.bfloat16)  # the down projection's input

    def calls(name: str) -> None:
        for w in layers:
            F.linear(act if name == "down" else x, w[name])

    def step() -> None:
        for w in layers:
            F.linear(x, w["qkv"]), F.linear(x, w["o"]), F.linear(x, w["gate_up"]), F.linear(act, w["down"])
        F.linear(x, head)

    times = {"step": replay_us(step)}
    times |= {name: replay_us(lambda name=name: calls(name)) for name in LAYER}
    times["lm_head"] = replay_us(lambda: F.linear(x, head))
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8", help="decode rows a step")
    args = ap.parse_args()
    torch.manual_seed(0)

    def weight(shape):
        return torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 0.02

    layers = [{name: weight(shape) for name, shape in LAYER.items()} for _ in range(LAYERS)]
    head = weight(LM_HEAD)
    print(torch.cuda.get_device_name(0), "torch", torch.__version__, "CUDA", torch.version.cuda)
    for library in ("cublas", "cublaslt", "cublas"):
        torch.backends.cuda.preferred_blas_library(library)
        for rows in map(int, args.rows.split(",")):
            times = step_times(layers, head, rows)
            print(f"{library:8s} rows {rows}: " + ", ".join(f"{k} {v:.1f} us" for k, v in times.items()), flush=True)


if __name__ == "__main__":
    main()
