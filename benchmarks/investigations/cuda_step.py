"""Where a decode step's time goes on one NVIDIA GPU (the models of benchmarks/cuda_engine.py,
bfloat16, the default engine: the paged kernel, decode steps in CUDA graphs, async scheduling
unless `--sync`): the step's wall time; its parts on the host (scheduling, inputs, the graph's
launch and copies, sampling's launch, the wait for the step's tokens, the update and output
processing; each timed around the call); the step's graph replayed back to back (the GPU's time
a step); the graph launch's CPU time; kernels and GPU busy time a step (torch.profiler, 20
steps), and the profiler's tables.

`--rows R`: R streams decode at once (1: the single stream). `--prefill P`: a request with a
P-token prompt and one token to generate joins every step, so every step is a mixed one (its
decodes and one prefill chunk, run eagerly and waited for), the steady state of a server whose
requests keep arriving; the Python functions that take the host's time in such steps are listed
too (cProfile, 20 steps).

    python benchmarks/investigations/cuda_step.py [--models llama-1b,smollm2-135m] [--rows 1] [--prefill 0] [--sync]
        [--json OUT]
"""
import argparse
import contextlib
import cProfile
import io
import itertools
import json
import os
import pstats
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from benchmarks.cuda_engine import SHAPES, shaped_model  # noqa: E402
from benchmarks.workload import random_prompt  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402


class Timed:
    """Wraps a callable (and delegates attributes): accumulates its wall time under `key`."""

    def __init__(self, fn, key, sink):
        self._fn, self._key, self._sink = fn, key, sink

    def __call__(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return self._fn(*a, **k)
        finally:
            self._sink[self._key] = self._sink.get(self._key, 0.0) + time.perf_counter() - t0

    def __getattr__(self, name):
        return getattr(self._fn, name)


@contextlib.contextmanager
def timed_calls(parts: list[tuple[object, str, str]], sink: dict[str, float]):
    """While inside, each (owner, attribute, key) of `parts` is wrapped in Timed, its time summed
    under `key` in `sink` (0 for one never called); put back on leaving."""
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in parts]
    for (owner, attr, fn), (_, _, key) in zip(saved, parts):
        setattr(owner, attr, Timed(fn, key, sink))
        sink.setdefault(key, 0.0)
    try:
        yield
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)


class Steps:
    """The engine's steps, each after the arrival of one request to prefill (`prefill` tokens,
    one to generate) where `prefill` is set."""

    def __init__(self, eng, prefill: int):
        self.eng, self.prefill, self.arrivals = eng, prefill, itertools.count()

    def __call__(self) -> None:
        if self.prefill:
            n = next(self.arrivals)
            self.eng.add_request(f"arrival-{n}", random_prompt(self.prefill, seed=1000 + n),
                                 SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        self.eng.step()


def timeline(eng, step: Steps, steps: int) -> dict:
    """Mean ms per step spent in each part of the step (wall, no sync added)."""
    import engine.runner.model_runner as mr
    sink = {}
    timed = [(eng.scheduler, "schedule"), (eng.scheduler, "schedule_ahead"), (mr, "build_inputs"),
             (eng.runner, "launch"), (eng.runner.sampler, "launch"), (eng.runner, "collect"),
             (eng.scheduler, "update_from_output"), (eng.output_processor, "process")]
    timed += [(eng.runner.graphs, "run")] if eng.runner.graphs else []
    with timed_calls([(owner, name, f"{type(owner).__name__}.{name}") for owner, name in timed], sink):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sink["step_total"] = time.perf_counter() - t0
    return {k: v / steps * 1e3 for k, v in sink.items()}


def run(name: str, async_scheduling: bool, rows: int, prefill: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        model = shaped_model(tmp, SHAPES[name])
        t0 = time.perf_counter()
        llm = LLM(model, device="cuda", max_num_seqs=256, max_num_batched_tokens=4096,
                  kv_cache_memory_bytes=16 << 30, enable_prefix_caching=False, async_scheduling=async_scheduling)
        build_s = time.perf_counter() - t0
        eng = llm.engine
        llm.generate([random_prompt(128, seed=1)], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True),
                     use_tqdm=False)
        for row in range(rows):
            eng.add_request(f"p{row}", random_prompt(128, seed=2 + row),
                            SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
        step = Steps(eng, prefill)
        for _ in range(21):
            step()
        walls, hosts = [], []
        for _ in range(150):
            t0 = time.perf_counter()
            step()
            walls.append(time.perf_counter() - t0)
            hosts.append(eng._last_step.scheduler_overhead_s)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                step()
            torch.cuda.synchronize()
        python = cProfile.Profile()
        python.enable()
        for _ in range(20):
            step()
        python.disable()
        parts = timeline(eng, step, 100)
        graphs = eng.runner.graphs
        size = next((size for size in graphs.sizes if size >= rows), None) if graphs is not None else None
        replay = launch = None
        if size is not None and not prefill:
            g = graphs.graphs[size].graph
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(300):
                g.replay()
            torch.cuda.synchronize()
            replay = (time.perf_counter() - t0) / 300
            launches = []
            for _ in range(50):
                t0 = time.perf_counter()
                g.replay()
                launches.append(time.perf_counter() - t0)
                torch.cuda.synchronize()
            launch = statistics.median(launches)
        averages = prof.key_averages()
        kernels = [e for e in averages if e.device_type.name == "CUDA"]
        kernel_count = sum(e.count for e in kernels) / 20
        gpu_us = sum(e.self_device_time_total for e in kernels) / 20
        print(f"== {name}, {rows} rows{f' + a {prefill}-token prefill' if prefill else ''}: build {build_s:.1f}s, "
              f"step wall median {statistics.median(walls)*1e3:.3f} ms, "
              f"host outside runner {statistics.median(hosts)*1e3:.3f} ms, graph replay alone "
              f"{replay * 1e3 if replay else float('nan'):.3f} ms, kernels/step {kernel_count:.0f}, "
              f"GPU busy/step {gpu_us/1e3:.3f} ms, "
              f"graph launch (CPU) {launch * 1e3 if launch else float('nan'):.3f} ms", flush=True)
        print("   step parts (ms):", json.dumps({k: round(v, 4) for k, v in parts.items()}), flush=True)
        print(averages.table(sort_by="self_cpu_time_total", row_limit=25))
        print(averages.table(sort_by="self_device_time_total", row_limit=25))
        text = io.StringIO()
        pstats.Stats(python, stream=text).sort_stats("tottime").print_stats(25)
        print(text.getvalue(), flush=True)
        result = {"rows": rows, "prefill": prefill, "build_s": build_s,
                  "step_wall_ms": statistics.median(walls) * 1e3,
                  "host_outside_runner_ms": statistics.median(hosts) * 1e3,
                  "replay_ms": replay * 1e3 if replay else None, "kernels_per_step": kernel_count,
                  "gpu_busy_ms": gpu_us / 1e3, "graph_launch_cpu_ms": launch * 1e3 if launch else None,
                  "step_parts_ms": parts}
        del llm, eng
        torch.cuda.empty_cache()
        return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama-1b,smollm2-135m")
    ap.add_argument("--rows", type=int, default=1, help="streams decoding at once")
    ap.add_argument("--prefill", type=int, default=0, help="a request of this many prompt tokens joins every step")
    ap.add_argument("--sync", action="store_true", help="without async scheduling: each step waited for")
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args()
    results = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
               "async_scheduling": not args.sync}
    for name in args.models.split(","):
        results[name] = run(name, not args.sync, args.rows, args.prefill)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
