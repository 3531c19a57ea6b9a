"""Admission: ordering, aging, bounds, headroom, replica choice; then the admission scenarios
(admission_scenarios.py) through HTTP on the in-process stack."""

from __future__ import annotations

import asyncio

import pytest
from admission_scenarios import ENGINE, SCENARIOS, Stack
from conftest import admit_alone, merge, one_lane, run, served_local_stack
from fake_engine import FakeAsyncEngine

from serve_app.admission_queue import AdmissionQueue
from serve_app.config import RouterConfig
from serve_app.messages import AdmitRequest, ReplicaStats
from serve_app.replica_pool import ReplicaPool
from serve_app.router import Router


def req(rid: str, priority: int = 0, prompt: int = 10, new: int = 10, prefix=(), n: int = 1,
        model: str = "m", adapter: str | None = None) -> AdmitRequest:
    return AdmitRequest(rid, model, priority, prompt, new, n, tuple(prefix), adapter)


def stats(rid: str, waiting=0, running=0, free=100, total=100, received=(),
          queued_tokens=0, ready=True, slots=4, ended=(), model: str = "m") -> ReplicaStats:
    return ReplicaStats(rid, model, ready, waiting, running, slots, free, total, 1 - free / total, queued_tokens, 16,
                        tuple(received), tuple(ended), 0.0)


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


def served_order(q: AdmissionQueue) -> list[str]:
    out = []
    while (e := q.peek()) is not None:
        q.remove(e.request.request_id)
        q.served(e)
        out.append(e.request.request_id)
    return out


@pytest.mark.parametrize("policy", ["fcfs", "sjf", "priority"])
def test_a_burst_for_one_adapter_takes_turns_with_the_other_adapters_of_its_class(policy):
    """Six requests for adapter x, then two for y and one for the base, all of one class: after
    x's first, the flows take turns (each its own requests in rank order) instead of y and the
    base waiting behind x's burst; a better class still goes first whatever its flow."""
    q = AdmissionQueue(RouterConfig(policy=policy, aging_rate=0.0))
    for i in range(6):
        q.push(req(f"x{i}", prompt=10 + i, adapter="x"), now=float(i))
    q.push(req("y6", prompt=16, adapter="y"), now=6.0)
    q.push(req("y7", prompt=17, adapter="y"), now=7.0)
    q.push(req("b8", prompt=18), now=8.0)
    assert served_order(q) == ["x0", "y6", "b8", "x1", "y7", "x2", "x3", "x4", "x5"]
    if policy == "priority":
        for i in range(3):
            q.push(req(f"x{i}", priority=1, adapter="x"), now=float(i))
        q.push(req("z", priority=1, adapter="z"), now=3.0)
        q.push(req("urgent", priority=0, adapter="x"), now=4.0)
        assert served_order(q) == ["urgent", "x0", "z", "x1", "x2"]


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
    """1. a replica with its one slot taken gets two admissions -> est waiting 2 -> no headroom (max 2).
    2. a report listing both as received, waiting=1 -> headroom again.
    3. free blocks below the prompt's blocks -> no headroom unless idle."""
    pool = ReplicaPool(RouterConfig(max_waiting_per_replica=2))
    pool.report(stats("r0", running=1, slots=1), now=0.0)
    for rid in ("a", "b"):
        assert pool.choose(req(rid)) == "r0"
        pool.assign("r0", req(rid), now=0.0)
    assert pool.choose(req("c")) is None
    pool.report(stats("r0", waiting=1, running=1, received=["a", "b"], slots=1), now=0.1)
    assert pool.choose(req("c")) == "r0"
    pool.assign("r0", req("c"), now=0.1)
    pool.release("c")  # ended (e.g. client left) before the replica listed it: not pending
    assert not pool.views["r0"].pending
    pool.report(stats("r0", running=1, free=2, slots=1), now=0.2)
    assert pool.choose(req("big", prompt=100)) is None  # needs 7 blocks
    pool.report(stats("r0", free=2), now=0.3)  # idle
    assert pool.choose(req("big", prompt=100)) == "r0"


def test_admissions_fill_free_slots_at_once_then_wait_up_to_the_bound():
    """Requests sent to an engine with free batch slots run at its next step, so they are not
    waiting ones: the router fills the slots without a report in between, then lets
    max_waiting_per_replica more wait. An engine queueing with slots free is short of KV blocks,
    and its reported queue counts."""
    pool = ReplicaPool(RouterConfig(max_waiting_per_replica=2))
    pool.report(stats("r0", running=1, slots=4), now=0.0)
    for rid in "abcde":  # three free slots, then two waiting
        assert pool.choose(req(rid)) == "r0"
        pool.assign("r0", req(rid), now=0.0)
    assert pool.views["r0"].est_waiting() == 2 and pool.choose(req("f")) is None
    pool.report(stats("r0", waiting=2, running=2, slots=4, received="abcde"), now=0.1)  # KV-bound
    assert pool.views["r0"].est_waiting() == 2 and pool.choose(req("f")) is None
    pool.release("a")
    assert pool.choose(req("f")) == "r0"


def test_an_ended_request_frees_its_slot_once_whichever_news_comes_first():
    """The engine fills a freed slot from its waiting queue at once; the router counts that at the
    release, so the replica's queue is topped up without waiting for its next load report. The
    report that shows the end lists it, so the end is not counted twice when the release comes
    after it."""
    pool = ReplicaPool(RouterConfig(max_waiting_per_replica=2))
    pool.report(stats("r0", slots=2), now=0.0)
    for rid in "abcd":
        pool.assign("r0", req(rid), now=0.0)
    pool.report(stats("r0", waiting=2, running=2, received="abcd", slots=2), now=0.1)  # a, b run; c, d wait
    assert pool.choose(req("e")) is None
    pool.release("a")  # ended, released before any report: c takes its slot
    assert pool.views["r0"].est_waiting() == 1
    assert pool.choose(req("e")) == "r0"
    pool.assign("r0", req("e"), now=0.2)
    assert pool.choose(req("f")) is None  # d and e wait
    pool.release("e")  # left before the engine saw it: no slot freed, just no longer pending
    assert pool.views["r0"].est_waiting() == 1
    pool.report(stats("r0", waiting=1, running=2, slots=2, ended="a"), now=0.3)  # the counts now show a's end
    assert pool.views["r0"].est_waiting() == 1 and not pool.views["r0"].ended
    pool.report(stats("r0", running=2, slots=2, ended="b"), now=0.4)  # b ended: the report comes first
    pool.release("b")  # ... so its release frees nothing more
    assert pool.views["r0"].est_waiting() == 0 and pool.choose(req("f")) == "r0"
    assert not pool.views["r0"].ended and not pool.views["r0"].reported_ended
    pool.release("c")
    pool.release("d")
    assert pool.views["r0"].est_waiting() == 0  # never below empty
    pool.assign("r0", req("g"), now=0.5)
    pool.release("g")  # a short request, released while still pending ...
    pool.report(stats("r0", slots=2, received="g", ended="cdg"), now=0.6)  # ... then reported both ways
    assert not pool.views["r0"].ended and not pool.views["r0"].reported_ended and not pool.views["r0"].pending


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
        waiting = asyncio.ensure_future(admit_alone(router, req("a")))
        await asyncio.sleep(0)
        assert len(one_lane(router).queue) == 1
        refused = await admit_alone(router, req("b"))
        assert refused.replica_id is None and refused.error.status == 429
        assert refused.error.retry_after_s >= 1
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        assert len(one_lane(router).queue) == 0
        await router.report(stats("r0", running=4))
        assert (await admit_alone(router, req("c"))).replica_id == "r0"
        router._tick_task.cancel()

    run(go())


def test_router_no_replica_503():
    async def go():
        router = Router(RouterConfig(no_replica_timeout_s=0.2))
        result = await asyncio.wait_for(admit_alone(router, req("a")), timeout=5)
        assert result.error.status == 503
        router._tick_task.cancel()

    run(go())


def test_a_model_without_room_holds_back_only_its_own_requests():
    """Two models behind one router, model a's replica full:
    1. a's requests queue up to a's bound, then a's 429 names a, with a Retry-After;
    2. b's requests, even worse-ranked ones, go to b's replica at once: a's queue neither blocks
       them nor counts against b's bound;
    3. once a's replica has room, a's queued requests go there, best-ranked first, never to b's;
    4. a model with no live replica fails its own queued requests with 503, alone."""
    async def go():
        router = Router(RouterConfig(policy="priority", max_queued_requests=2, max_waiting_per_replica=1,
                                     no_replica_timeout_s=0.3))
        await router.report(stats("a0", waiting=1, running=4, model="a"))  # no headroom
        await router.report(stats("b0", model="b"))
        queued = [asyncio.ensure_future(admit_alone(router, req(f"a{i}", priority=5 - i, model="a")))
                  for i in range(2)]
        await asyncio.sleep(0)
        assert len(router.lanes["a"].queue) == 2
        refused = await admit_alone(router, req("a-extra", priority=0, model="a"))
        assert refused.error.status == 429 and "model 'a'" in refused.error.message
        assert refused.error.retry_after_s >= 1
        for i in range(2):
            got = await admit_alone(router, req(f"b{i}", priority=9, model="b"))
            assert got.replica_id == "b0" and got.error is None
        assert not queued[0].done() and not queued[1].done()
        assert await router.ready_replicas() == {"a": 1, "b": 1}
        await router.report(stats("a0", running=4, model="a"))  # its queue empty: room for one waiting
        first = await asyncio.wait_for(asyncio.shield(queued[1]), 5)  # priority 4 before 5
        assert first.replica_id == "a0" and not queued[0].done()
        router.release_now(["a1"])
        assert (await asyncio.wait_for(queued[0], 5)).replica_id == "a0"
        lonely = await asyncio.wait_for(admit_alone(router, req("c0", model="c")), 5)
        assert lonely.error.status == 503 and "model 'c'" in lonely.error.message
        assert (await admit_alone(router, req("b2", model="b"))).replica_id == "b0"
        router._tick_task.cancel()

    run(go())


def test_the_router_gives_a_later_adapter_its_turn_before_an_earlier_burst_ends():
    """One replica, one request at a time: a burst of three for adapter x, then one for y; y's
    request goes second, not fourth."""
    async def go():
        router = Router(RouterConfig(max_waiting_per_replica=1))
        await router.report(stats("r0", waiting=1, running=4))  # full
        ids = ["x0", "x1", "x2", "y0"]
        waiting = {rid: asyncio.ensure_future(admit_alone(router, req(rid, adapter=rid[0]))) for rid in ids}
        await asyncio.sleep(0)
        order = []
        await router.report(stats("r0", running=4))  # room for one waiting
        for _ in ids:
            done, _ = await asyncio.wait(waiting.values(), timeout=5, return_when=asyncio.FIRST_COMPLETED)
            (rid,) = [r for r, f in waiting.items() if f in done]
            assert waiting.pop(rid).result().replica_id == "r0"
            order.append(rid)
            router.release_now([rid])  # it ended: the next one's turn
        assert order == ["x0", "y0", "x1", "x2"]
        router._tick_task.cancel()

    run(go())


def test_the_router_ticks_ten_times_a_second_while_requests_wait_and_once_a_second_when_none_do(monkeypatch):
    """On a small host every wake-up of an idle actor takes a core from the engine's forward."""
    async def go():
        router = Router(RouterConfig(max_waiting_per_replica=1))
        ticks = 0

        def tick():
            nonlocal ticks
            ticks += 1

        monkeypatch.setattr(router, "tick", tick)
        await asyncio.sleep(2.05)
        idle = ticks
        await router.report(stats("r0", waiting=1, running=4))  # no headroom: the request waits
        waiting = asyncio.ensure_future(admit_alone(router, req("a")))
        await asyncio.sleep(2.05)  # the idle pause under way, then a tick every 0.1 s
        busy = ticks - idle
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        router._tick_task.cancel()
        assert idle <= 3 and busy >= 7, (idle, busy)

    run(go())


# ------------------------------------------------------------ overload through HTTP

SLOW = FakeAsyncEngine.with_options(step_delay_s=0.01, max_num_seqs=1)


def _local_stack(config: dict, num_replicas: int):
    base = {"engine": {"served_model_name": "fake", "stream_flush_interval_s": 0.0, "stats_report_interval_s": 0.05}}
    return served_local_stack(merge(base, config), num_replicas, FakeAsyncEngine.with_options(**ENGINE))


@pytest.mark.parametrize("name", SCENARIOS)
def test_admission_scenario_in_process(name):
    """admission_scenarios.py against the in-process stack behind uvicorn."""
    scenario = SCENARIOS[name]
    with _local_stack(scenario.config, scenario.config["engine"]["num_replicas"]) as (url, router, replicas):
        async def replica_stats():
            return [r.engine.stats() for r in replicas]

        async def routing_counters():
            return [r.routing_counters() for r in replicas]

        async def num_queued():
            return len(one_lane(router).queue)

        asyncio.run(scenario.run(Stack(url, replica_stats, routing_counters, num_queued)))
