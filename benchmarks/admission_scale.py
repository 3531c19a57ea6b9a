"""Admission cost against queue length: the fleet router and the engine scheduler, no model.

Router (serve_app.router.Router in-process, policy priority with aging): the queue is filled
with N requests while every one of R replicas is full, then each event kind is timed:

  admit     a new request joins the queue of N (a batch of one, run until it waits; includes
            creating its asyncio task)
  report    a replica's load report that changes nothing (the queue head fits nowhere)
  dispatch  a replica's report that frees one slot: the best-ranked request is taken from the
            queue of N and sent there (replica choice among R)
  release   a finished request gives its slot back
  cancel    a queued client goes away (its entry leaves the queue)

Engine (engine Scheduler, policy priority with aging, 32 running, N waiting): one step =
schedule() + update_from_output() with one sampled token per running request, plus one new
arrival per step so the waiting queue is not static.

Figures are medians over --repeats runs of --events events (steps) each, in microseconds.

    .venv/bin/python benchmarks/admission_scale.py [--queued 100,1000,10000,50000]
        [--replicas 4,16,100] [--events 2000] [--repeats 5] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import SchedulerConfig  # noqa: E402
from engine.kv_cache.manager import KVCacheManager  # noqa: E402
from engine.outputs import ModelRunnerOutput  # noqa: E402
from engine.request import Request  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.scheduler.scheduler import Scheduler  # noqa: E402
from serve_app.config import RouterConfig  # noqa: E402
from serve_app.messages import AdmitRequest, AdmitResult, ReplicaStats  # noqa: E402
from serve_app.router import Router  # noqa: E402

BLOCK = 16
MAX_WAITING = 2


def _stats(replica: int, num_waiting: int, received: tuple[str, ...] = ()) -> ReplicaStats:
    return ReplicaStats(f"r{replica}", "m", True, num_waiting, 32, 32, 4096, 8192, 0.5, 0, BLOCK, received, (), 0.0)


def _admit_request(rng: random.Random, i: int) -> AdmitRequest:
    prompt = rng.randint(16, 512)
    return AdmitRequest(f"q{i}", "m", rng.randint(0, 9), prompt, rng.randint(8, 256),
                        prefix_hashes=tuple(rng.getrandbits(62) for _ in range(prompt // BLOCK)))


async def _admitted(router: Router, request: AdmitRequest) -> AdmitResult | None:
    """One request's admission, asked as a batch of its own."""
    async for answers in router.admit_many([request]):
        if answers:
            return answers[0][1]
    return None


async def _router_run(num_queued: int, num_replicas: int, events: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    config = RouterConfig(policy="priority", aging_rate=1.0, max_queued_requests=10**7,
                          max_queued_tokens=10**12, max_waiting_per_replica=MAX_WAITING)
    router = Router(config)
    router._tick_task.cancel()  # ticks are periodic housekeeping, not per-event cost
    for r in range(num_replicas):
        await router.report(_stats(r, MAX_WAITING))  # full: nothing dispatches while filling
    ids = iter(range(10**9))
    waiters = [asyncio.ensure_future(_admitted(router, _admit_request(rng, next(ids)))) for _ in range(num_queued)]
    await asyncio.sleep(0)
    assert len(router.lanes["m"].queue) == num_queued
    out: dict[str, float] = {}

    new = [_admit_request(rng, next(ids)) for _ in range(events)]
    t0 = time.perf_counter()
    waiters += [asyncio.ensure_future(_admitted(router, req)) for req in new]
    await asyncio.sleep(0)
    out["admit"] = (time.perf_counter() - t0) / events

    unchanged = [_stats(rng.randrange(num_replicas), MAX_WAITING) for _ in range(events)]
    t0 = time.perf_counter()
    for stats in unchanged:
        await router.report(stats)
    out["report"] = (time.perf_counter() - t0) / events

    dispatched: list[str] = []
    t0 = time.perf_counter()
    for e in range(events):  # each report frees one slot on replica e % R: one dispatch
        r = e % num_replicas
        view = router.lanes["m"].pool.views[f"r{r}"]
        await router.report(_stats(r, MAX_WAITING - 1, tuple(view.pending)))
        dispatched.extend(view.pending)
    out["dispatch"] = (time.perf_counter() - t0) / events
    assert len(dispatched) == events, len(dispatched)

    t0 = time.perf_counter()
    for request_id in dispatched:
        await router.release([request_id])
    out["release"] = (time.perf_counter() - t0) / events

    queued = [w for w in waiters if not w.done()][:events]
    t0 = time.perf_counter()
    for w in queued:
        w.cancel()
    await asyncio.gather(*queued, return_exceptions=True)
    out["cancel"] = (time.perf_counter() - t0) / len(queued)

    for w in waiters:
        w.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
    return out


def _engine_run(num_waiting: int, steps: int, seed: int) -> float:
    rng = random.Random(seed)
    clock_now = [0.0]
    kv = KVCacheManager(num_blocks=32 * 64, block_size=BLOCK, num_host_blocks=0, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(policy="priority", max_num_seqs=32, max_num_batched_tokens=512, aging_rate=1.0),
                      kv, max_model_len=4096, clock=lambda: clock_now[0])
    ids = iter(range(10**9))

    def add() -> None:
        i = next(ids)
        prompt = [rng.randrange(1, 30000) for _ in range(rng.randint(16, 64))]
        sched.add_request(Request(f"w{i}", prompt, SamplingParams(max_tokens=1000, ignore_eos=True),
                                  priority=rng.randint(0, 9), arrival_time=clock_now[0]))

    for _ in range(num_waiting + 32):
        add()

    def step() -> None:
        out = sched.schedule()
        sampled = {s.request.request_id: [7] for s in out.scheduled if s.sample}
        sched.update_from_output(out, ModelRunnerOutput(sampled, {}))
        clock_now[0] += 0.01
        add()

    for _ in range(40):  # the running batch fills (prefill), then steady decoding
        step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t0) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--queued", default="100,1000,10000,50000")
    parser.add_argument("--replicas", default="4,16,100")
    parser.add_argument("--events", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    queued = [int(x) for x in args.queued.split(",")]
    replicas = [int(x) for x in args.replicas.split(",")]
    gc.disable()  # a collection landing in one run's timed window is noise, not admission cost
    cpu0, wall0 = time.process_time(), time.perf_counter()
    results: dict = {"router": {}, "engine": {}}

    print(f"router, microseconds per event (median of {args.repeats} x {args.events} events)")
    print(f"{'queued':>7} {'replicas':>8} " + " ".join(f"{k:>9}" for k in ("admit", "report", "dispatch",
                                                                        "release", "cancel")))
    for n in queued:
        for r in replicas:
            runs = [asyncio.run(_router_run(n, r, args.events, seed)) for seed in range(args.repeats)]
            med = {k: statistics.median(run[k] for run in runs) * 1e6 for k in runs[0]}
            results["router"][f"{n}x{r}"] = med
            print(f"{n:>7} {r:>8} " + " ".join(f"{med[k]:>9.1f}" for k in med), flush=True)
            gc.collect()

    print(f"\nengine scheduler, microseconds per step (32 running; median of {args.repeats} x {args.steps} steps)")
    for n in queued:
        us = statistics.median(_engine_run(n, args.steps, seed) for seed in range(args.repeats)) * 1e6
        results["engine"][str(n)] = us
        print(f"{n:>7} waiting {us:>9.1f}", flush=True)
        gc.collect()

    util = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
    print(f"\nprocess cpu / wall = {util:.2f} (1.00: nothing else took this core); load avg {os.getloadavg()[0]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
