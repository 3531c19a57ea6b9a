"""Admission: ordering, aging, bounds, headroom, replica choice; then overload through HTTP."""

from __future__ import annotations

import asyncio
import time

import pytest
from conftest import local_stack, run
from fake_engine import FakeAsyncEngine

from serve_app.admission import AdmissionQueue
from serve_app.config import RouterConfig
from serve_app.messages import AdmitRequest, ReplicaStats
from serve_app.replica_pool import ReplicaPool
from serve_app.router import Router


def req(rid: str, priority: int = 0, prompt: int = 10, new: int = 10, prefix=(), n: int = 1) -> AdmitRequest:
    return AdmitRequest(rid, priority, prompt, new, n, tuple(prefix))


def stats(rid: str, waiting=0, running=0, free=100, total=100, received=(),
          queued_tokens=0, ready=True) -> ReplicaStats:
    return ReplicaStats(rid, ready, waiting, running, free, total, 1 - free / total, queued_tokens, 16,
                        tuple(received), 0.0)


def order(q: AdmissionQueue) -> list[str]:
    out = []
    while (e := q.peek()) is not None:
        out.append(e.request.request_id)
        q.remove(e.request.request_id)
    return out


@pytest.mark.parametrize("policy,expected", [
    ("fcfs", ["a", "b", "c", "d"]),
    ("priority", ["c", "a", "d", "b"]),
    ("sjf", ["d", "b", "a", "c"]),
])
def test_queue_order_by_policy(policy, expected):
    q = AdmissionQueue(RouterConfig(policy=policy, aging_rate=0.0))
    q.push(req("a", priority=1, prompt=50), now=0.0)
    q.push(req("b", priority=2, prompt=20), now=1.0)
    q.push(req("c", priority=0, prompt=90), now=2.0)
    q.push(req("d", priority=1, prompt=5), now=3.0)
    assert order(q) == expected


def test_aging_bound_priority_and_sjf():
    """1. low-priority (5) request arrives at t=0, aging 1 class/s.
    2. a fresh priority-0 request arrives at every t: before t=5 it wins, from t=5 the old one.
    3. same for sjf: 1000 tokens vs fresh 100-token requests at 100 tokens/s -> bound 9 s."""
    q = AdmissionQueue(RouterConfig(policy="priority", aging_rate=1.0))
    q.push(req("old", priority=5), now=0.0)
    q.push(req("new", priority=0), now=4.9)
    assert q.peek().request.request_id == "new"
    q.remove("new")
    q.push(req("new2", priority=0), now=5.0)
    assert q.peek().request.request_id == "old"

    q = AdmissionQueue(RouterConfig(policy="sjf", aging_rate=100.0))
    q.push(req("long", prompt=500, new=500), now=0.0)
    q.push(req("short", prompt=50, new=50), now=8.9)
    assert q.peek().request.request_id == "short"
    q.remove("short")
    q.push(req("short2", prompt=50, new=50), now=9.0)
    assert q.peek().request.request_id == "long"


def test_queue_bounds_requests_and_tokens_and_counts_depth_per_priority():
    """Work = prompt + n * max_tokens; the ingress refuses (413) a request over the whole bound."""
    q = AdmissionQueue(RouterConfig(max_queued_requests=2, max_queued_tokens=100))
    q.push(req("a", prompt=30, new=15, n=2, priority=3), 0.0)
    assert q.num_tokens == 60 and q.depth_by_priority[3] == 1
    assert not q.can_accept(req("b", prompt=30, new=30))  # 120 tokens > 100
    assert q.can_accept(req("c", prompt=10, new=10))
    q.push(req("c", prompt=10, new=10), 0.0)
    assert not q.can_accept(req("d", prompt=1, new=1))  # 2 requests
    q.remove("a")
    assert q.num_tokens == 20 and q.depth_by_priority[3] == 0 and len(q) == 1


def test_headroom_unseen_admissions_and_blocks():
    """1. replica with waiting=0 gets two admissions -> est waiting 2 -> no headroom (max 2).
    2. a report listing both as received, waiting=1 -> headroom again.
    3. free blocks below the prompt's blocks -> no headroom unless idle."""
    pool = ReplicaPool(RouterConfig(max_waiting_per_replica=2))
    pool.report(stats("r0", running=1), now=0.0)
    for rid in ("a", "b"):
        assert pool.choose(req(rid)) == "r0"
        pool.assign("r0", req(rid), now=0.0)
    assert pool.choose(req("c")) is None
    pool.report(stats("r0", waiting=1, running=2, received=["a", "b"]), now=0.1)
    assert pool.choose(req("c")) == "r0"
    pool.assign("r0", req("c"), now=0.1)
    pool.release("c")  # ended (e.g. client left) before the replica listed it: not pending
    assert not pool.views["r0"].pending
    pool.report(stats("r0", running=2, free=2), now=0.2)
    assert pool.choose(req("big", prompt=100)) is None  # needs 7 blocks
    pool.report(stats("r0", free=2), now=0.3)  # idle
    assert pool.choose(req("big", prompt=100)) == "r0"


def test_choice_least_loaded_then_prefix_affinity():
    pool = ReplicaPool(RouterConfig(affinity_load_slack=0.05))
    pool.report(stats("r0", running=1, free=50), 0.0)
    pool.report(stats("r1", running=1, free=80), 0.0)
    assert pool.choose(req("a", prefix=(1, 2))) == "r1"  # least KV usage
    pool.report(stats("r0", running=1, free=78), 0.0)  # now a near-tie (0.22 vs 0.20)
    pool.views["r0"].remember_prefixes((1, 2))
    assert pool.choose(req("b", prefix=(1, 2, 3))) == "r0"  # prefix decides the tie
    assert pool.choose(req("c", prefix=(9,))) == "r1"
    pool.report(stats("r1", running=1, free=80, queued_tokens=16 * 30), 0.0)  # 30 blocks queued
    assert pool.choose(req("d", prefix=(9,))) == "r0"


def test_stale_replica_expires():
    pool = ReplicaPool(RouterConfig(replica_stale_after_s=1.0))
    pool.report(stats("r0"), 0.0)
    pool.report(stats("r1"), 0.9)
    assert pool.expire(1.5) == ["r0"]
    assert list(pool.views) == ["r1"]


def test_router_queue_full_429_with_retry_after_and_cancel_removes():
    async def go():
        router = Router(RouterConfig(max_queued_requests=1, max_waiting_per_replica=1))
        await router.report(stats("r0", waiting=1, running=4))  # no headroom
        waiting = asyncio.ensure_future(router.admit(req("a")))
        await asyncio.sleep(0)
        assert len(router.queue) == 1
        refused = await router.admit(req("b"))
        assert refused.replica_id is None and refused.error.status == 429
        assert refused.error.retry_after_s >= 1
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        assert len(router.queue) == 0
        await router.report(stats("r0", running=4))
        assert (await router.admit(req("c"))).replica_id == "r0"
        router._tick_task.cancel()

    run(go())


def test_router_no_replica_503():
    async def go():
        router = Router(RouterConfig(no_replica_timeout_s=0.2))
        result = await asyncio.wait_for(router.admit(req("a")), timeout=5)
        assert result.error.status == 503
        router._tick_task.cancel()

    run(go())


# ------------------------------------------------------------ overload through HTTP

SLOW = FakeAsyncEngine.with_options(step_delay_s=0.01, max_num_seqs=1)


async def _post(client, prompt: str, max_tokens: int, priority: int = 0):
    return await client.post("/v1/completions", json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "priority": priority})


def _started(replicas) -> list[str]:
    return [rid for r in replicas for rid in r.engine.started]


def test_queue_full_429_retry_after_and_admitted_complete():
    async def go():
        async with local_stack(engine_cls=SLOW, router={"max_queued_requests": 3,
                                                        "max_waiting_per_replica": 1}) as (
                client, router, replicas):
            tasks = [asyncio.ensure_future(_post(client, f"p{i}", 10)) for i in range(10)]
            results = await asyncio.gather(*tasks)
            ok = [r for r in results if r.status_code == 200]
            refused = [r for r in results if r.status_code == 429]
            assert len(ok) + len(refused) == 10 and refused and len(ok) >= 4
            for r in refused:
                assert int(r.headers["Retry-After"]) >= 1
                assert "queue full" in r.json()["error"]["message"]
            for r in ok:
                assert r.json()["usage"]["completion_tokens"] == 10
            assert len(replicas[0].engine.finished) == len(ok)

    run(go())


def test_priority_classes_at_overload_high_first_across_two_replicas():
    """1. two replicas, one slot each, max_waiting 1: four long requests saturate them.
    2. queue 6 low-priority (5) requests, then 6 high-priority (0) ones.
    3. every high request starts before any low one that was queued."""
    async def go():
        async with local_stack(num_replicas=2, engine_cls=SLOW,
                               router={"policy": "priority", "aging_rate": 0.0,
                                       "max_waiting_per_replica": 1}) as (client, router,
                                                                          replicas):
            fill = [asyncio.ensure_future(_post(client, f"fill{i}", 15)) for i in range(4)]
            await asyncio.sleep(0.05)
            low = [asyncio.ensure_future(_post(client, f"low{i}", 3, priority=5))
                   for i in range(6)]
            await asyncio.sleep(0.02)
            high = [asyncio.ensure_future(_post(client, f"high{i}", 3, priority=0))
                    for i in range(6)]
            results = await asyncio.gather(*fill, *low, *high)
            assert all(r.status_code == 200 for r in results)
            t = {rid: ts for r in replicas for rid, ts in r.engine.start_times.items()}
            low_t = [t[r.json()["id"] + "-0"] for r in results[4:10]]
            high_t = [t[r.json()["id"] + "-0"] for r in results[10:16]]
            assert max(high_t) < min(low_t)
            assert all(len(r.engine.started) >= 4 for r in replicas)  # both replicas served

    run(go())


def test_sjf_short_request_overtakes_long_ones():
    async def go():
        async with local_stack(engine_cls=SLOW, router={"policy": "sjf", "aging_rate": 0.0,
                                                        "max_waiting_per_replica": 1}) as (
                client, router, replicas):
            running = asyncio.ensure_future(_post(client, "first", 10))
            await asyncio.sleep(0.03)
            longs = [asyncio.ensure_future(_post(client, f"long{i}", 40)) for i in range(3)]
            await asyncio.sleep(0.03)
            short = asyncio.ensure_future(_post(client, "short", 2))
            results = await asyncio.gather(running, *longs, short)
            started = replicas[0].engine.started
            short_id = results[-1].json()["id"] + "-0"
            long_ids = [r.json()["id"] + "-0" for r in results[1:4]]
            # one long may already sit in the engine's waiting slot; the rest come after short
            assert sum(started.index(short_id) < started.index(lid) for lid in long_ids) >= 2

    run(go())


def test_aging_serves_starved_request_within_bound():
    """Priority policy, aging 20 classes/s, a steady flood of priority-0 requests slightly above
    capacity (the queue is never empty, so without aging a priority-10 request would wait for
    the whole flood). With aging it ranks like a priority-0 request that arrived 10/20 = 0.5 s
    later: it starts before every flood request sent after t0 + 0.5 s, while the flood goes on."""
    async def go():
        async with local_stack(engine_cls=SLOW, router={"policy": "priority", "aging_rate": 20.0,
                                                        "max_waiting_per_replica": 1}) as (
                client, router, replicas):
            loop = asyncio.get_running_loop()
            stop_at = loop.time() + 2.0
            sent: list[tuple[float, asyncio.Future]] = []

            async def flood():
                i = 0
                while loop.time() < stop_at:
                    sent.append((time.monotonic(), asyncio.ensure_future(
                        _post(client, f"hi{i}", 3))))
                    i += 1
                    await asyncio.sleep(0.025)

            flooder = asyncio.ensure_future(flood())
            await asyncio.sleep(0.2)
            t0 = time.monotonic()
            starved = await _post(client, "starved", 2, priority=10)
            await flooder
            results = await asyncio.gather(*(f for _, f in sent))
            assert starved.status_code == 200
            starts = replicas[0].engine.start_times
            starved_start = starts[starved.json()["id"] + "-0"]
            assert starved_start < t0 + 0.5 + 1.0  # bound + service of what was ahead
            late = [starts[r.json()["id"] + "-0"] for (ts, _), r in zip(sent, results)
                    if ts > t0 + 0.5 + 0.05]
            assert late and all(s > starved_start for s in late)
            assert len(router.queue) == 0

    run(go())
