"""The server-side engine without a server: the serve workload streamed through `AsyncEngine` to
asyncio consumers in this process, step loop on a thread vs in its own process (engine_process).

Shows what an event loop sharing the engine's process costs a multi-threaded forward, and that the
engine process removes it (compare with the offline `LLM` figure of serve_bench.py). With
`--idle-serve`, a local Ray instance with Serve started (controller and proxy, no application)
runs alongside: what Ray's background activity alone takes from the forward.

    .venv/bin/python benchmarks/investigations/async_engine.py [--threads 2] [--repeats 1] [--idle-serve]
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks.workload import make_workload  # noqa: E402
from engine import AsyncEngine, SamplingParams  # noqa: E402

ENGINE_ARGS = dict(max_num_seqs=32, max_num_batched_tokens=512, policy="priority",
                   enable_prefix_caching=True)  # configs/serve.yaml's


async def _drain(engine: AsyncEngine, prompt: list[int], max_tokens: int, request_id: str) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    async for _ in engine.generate(prompt, params, request_id):
        pass


def output_tps(engine_process: bool, threads: int) -> float:
    wl = make_workload(64, seed=0)
    engine = AsyncEngine.from_engine_args(None, engine_process=engine_process, num_threads=threads,
                                          **ENGINE_ARGS)

    async def main() -> float:
        await asyncio.gather(*(_drain(engine, [5 + i] * 8, 4, f"warm{i}") for i in range(4)))
        t = time.perf_counter()
        await asyncio.gather(*(_drain(engine, list(p), n, f"r{i}")
                               for i, (p, n) in enumerate(zip(wl.prompts, wl.output_lens))))
        return sum(wl.output_lens) / (time.perf_counter() - t)

    try:
        return asyncio.run(main())
    finally:
        engine.shutdown()


@contextlib.contextmanager
def idle_serve() -> Iterator[None]:
    import ray
    from ray import serve

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             _temp_dir=os.environ.get("RAY_TMPDIR") or tempfile.mkdtemp(prefix="idle-serve-"))
    serve.start(http_options={"host": "127.0.0.1", "port": 0})
    try:
        yield
    finally:
        serve.shutdown()
        ray.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--idle-serve", action="store_true", help="with an idle Ray Serve alongside")
    args = p.parse_args()
    with idle_serve() if args.idle_serve else contextlib.nullcontext():
        for engine_process in (False, True):
            runs = [output_tps(engine_process, args.threads) for _ in range(args.repeats)]
            where = "in its own process" if engine_process else "on a thread"
            print(f"step loop {where}: {statistics.median(runs):.1f} output tok/s "
                  f"(median of {len(runs)}, {args.threads} torch threads)", flush=True)


if __name__ == "__main__":
    main()
