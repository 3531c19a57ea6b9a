"""Cost of the deployment hops: unary handle latency and streaming capacity, by transport and by
flush interval, with the real `EngineReplica` around a synthetic engine (no model compute).

A `Caller` deployment (standing in for the ingress) calls an `EngineReplica` deployment:
  - unary: sequential `routing_counters` calls; p50/p99 round-trip ms.
  - streaming: 64 concurrent `generate` streams; the synthetic engine emits one token per stream
    every `--step-ms` (64 x 200 = 12,800 tokens/s offered at 5 ms), and the replica's coalescing
    flushes per token (`flush 0`) or per `stream_flush_interval_s`. Reported: tokens/s delivered
    to the caller, messages, and CPU seconds of the caller and replica processes per 1,000 tokens.
Each is run over Serve's default transport (by reference, through the object store) and its
gRPC transport (`handle.options(_by_reference=False)`).

    .venv/bin/python benchmarks/serve_hops.py [--json benchmarks/results/serve_hops.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace
from typing import Any

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from serve_app.messages import EngineRequest  # noqa: E402


class SyntheticParams:
    """Stands in for engine.SamplingParams: keeps the kwargs."""

    def __init__(self, **kwargs: Any):
        self.max_tokens = kwargs.get("max_tokens", 16)


class SyntheticEngine:
    """The AsyncEngine surface EngineReplica uses; one token per live request per step."""

    step_s = 0.005

    def __init__(self) -> None:
        self.tokenizer = None
        self.max_model_len, self.block_size = 1 << 20, 16
        self._live: dict[str, asyncio.Queue] = {}
        self._ticker: asyncio.Task | None = None

    @classmethod
    def from_engine_args(cls, model: str | None = None, **_: Any) -> SyntheticEngine:
        return cls()

    @classmethod
    def with_step(cls, step_s: float) -> type[SyntheticEngine]:
        return type("SyntheticEngine", (cls,), {"step_s": step_s, "__module__": cls.__module__})

    def stats(self) -> SimpleNamespace:
        return SimpleNamespace(num_waiting=0, num_running=len(self._live), max_num_seqs=1 << 16,
                               num_free_blocks=1 << 16, num_total_blocks=1 << 16, kv_usage=0.0, num_queued_tokens=0)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._live

    def abort(self, request_id: str) -> None:
        self._live.pop(request_id, None)

    def shutdown(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()

    async def _tick(self) -> None:
        while self._live:
            await asyncio.sleep(self.step_s)
            for queue in list(self._live.values()):
                queue.put_nowait(None)
        self._ticker = None

    async def generate(self, prompt, params, request_id, priority=0):
        queue: asyncio.Queue = asyncio.Queue()
        self._live[request_id] = queue
        if self._ticker is None:
            self._ticker = asyncio.ensure_future(self._tick())
        try:
            for i in range(params.max_tokens):
                await queue.get()
                last = i == params.max_tokens - 1
                yield SimpleNamespace(
                    request_id=request_id, prompt_token_ids=[1, 2, 3], finished=last,
                    outputs=[SimpleNamespace(index=0, text=" tok", token_ids=[i], logprobs=None,
                                             finish_reason="length" if last else None)])
        finally:
            self._live.pop(request_id, None)


class Caller:
    """The ingress's side of the hop: opens streams on the replica handle and drains them."""

    def __init__(self, replica: Any):
        self.replica = replica

    def _handle(self, grpc: bool, stream: bool) -> Any:
        options: dict[str, Any] = {"stream": stream}
        if grpc:
            options["_by_reference"] = False
        return self.replica.options(**options)

    async def unary(self, n: int, grpc: bool) -> list[float]:
        handle = self._handle(grpc, stream=False)
        await handle.routing_counters.remote()
        out = []
        for _ in range(n):
            t = time.perf_counter()
            await handle.routing_counters.remote()
            out.append((time.perf_counter() - t) * 1e3)
        return out

    async def streams(self, num_streams: int, tokens: int, grpc: bool) -> dict[str, float]:
        handle = self._handle(grpc, stream=True)

        async def one(i: int) -> tuple[int, int]:
            request = EngineRequest(f"s{i}-{time.monotonic_ns()}", [1, 2, 3], None,
                                    {"max_tokens": tokens})
            num_tokens = num_messages = 0
            async for chunk in handle.generate.remote(request):
                num_messages += 1
                num_tokens += sum(len(d.token_ids) for d in chunk.deltas)
            return num_tokens, num_messages

        t = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(num_streams)))
        wall = time.perf_counter() - t
        return {"wall_s": wall, "tokens": sum(r[0] for r in results),
                "messages": sum(r[1] for r in results)}


def _cpu(labels: tuple[str, ...]) -> dict[str, float]:
    import psutil

    out = dict.fromkeys(labels, 0.0)
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
            t = p.cpu_times()
        except Exception:
            continue
        for label in labels:
            if f":{label}" in cmd:
                out[label] += t.user + t.system
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray
    from ray import serve

    from serve_app.config import EngineReplicaConfig
    from serve_app.replica import EngineReplica

    tmp = os.environ.get("RAY_TMPDIR") or tempfile.mkdtemp(prefix="hops-")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [_ROOT, os.environ.get("PYTHONPATH")] if p)
    ray.init(address="local", num_cpus=4, include_dashboard=False, _temp_dir=tmp,
             log_to_driver=False, configure_logging=False)
    results: dict[str, Any] = {"unary": {}, "streaming": []}
    try:
        for flush_s in args.flush:
            config = EngineReplicaConfig(served_model_name="synthetic", stream_flush_interval_s=flush_s)
            replica = serve.deployment(EngineReplica, name="Replica", max_ongoing_requests=4096,
                                       logging_config={"enable_access_log": False})
            caller = serve.deployment(Caller, name="Caller", max_ongoing_requests=64,
                                      logging_config={"enable_access_log": False})
            app = caller.bind(replica.bind(config, None, SyntheticEngine.with_step(args.step_ms / 1e3),
                                           SyntheticParams))
            handle = serve.run(app, name="hops", route_prefix=None)
            for grpc in (False, True):
                transport = "grpc" if grpc else "default"
                if transport not in results["unary"]:
                    lat = handle.unary.remote(args.unary_calls, grpc).result()
                    results["unary"][transport] = {"p50_ms": statistics.median(lat),
                                                   "p99_ms": sorted(lat)[int(0.99 * len(lat))]}
                    print(f"unary {transport}: p50 {results['unary'][transport]['p50_ms']:.2f} ms "
                          f"p99 {results['unary'][transport]['p99_ms']:.2f} ms", flush=True)
                runs = []
                for _ in range(args.repeats):
                    before = _cpu(("Caller", "Replica"))
                    r = handle.streams.remote(args.streams, args.tokens, grpc).result()
                    after = _cpu(("Caller", "Replica"))
                    r["cpu_s"] = {k: after[k] - before[k] for k in after}
                    runs.append(r)
                best = sorted(runs, key=lambda r: r["wall_s"])[len(runs) // 2]  # the median run
                row = {"flush_s": flush_s, "transport": transport,
                       "tokens_per_s": best["tokens"] / best["wall_s"],
                       "messages": best["messages"], "tokens": best["tokens"],
                       "cpu_s_per_1k_tokens": {k: 1e3 * v / best["tokens"]
                                               for k, v in best["cpu_s"].items()}}
                results["streaming"].append(row)
                print(f"flush {flush_s * 1e3:.0f} ms {transport:7s}: {row['tokens_per_s']:8.0f} tok/s, "
                      f"{row['messages']} messages, CPU s / 1k tokens "
                      + ", ".join(f"{k} {v:.3f}" for k, v in row["cpu_s_per_1k_tokens"].items()),
                      flush=True)
            serve.delete("hops")
    finally:
        serve.shutdown()
        ray.shutdown()
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--tokens", type=int, default=200, help="tokens per stream")
    p.add_argument("--step-ms", type=float, default=5.0, help="synthetic engine step")
    p.add_argument("--flush", type=float, nargs="+", default=[0.0, 0.05],
                   help="stream_flush_interval_s values to compare")
    p.add_argument("--unary-calls", type=int, default=500)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    results = run(args)
    results["args"] = vars(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
