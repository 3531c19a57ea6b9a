"""Scheduling policies (fcfs, sjf, priority), aging and preemption (swap, recompute, auto), without a
model: the scheduler and KV manager are driven directly with fake sampled tokens on a fake clock."""
from __future__ import annotations

import math

import pytest

from engine.request import RequestStatus
from engine.scheduler.scheduler import PreemptionCosts
from tests.engine.helpers import FakeClock, make_request, make_scheduler, step


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def _admission_order(sched) -> list[str]:
    """Steps until idle; request ids in the order they were first scheduled."""
    order = []
    while sched.has_unfinished():
        for s in step(sched).scheduled:
            if s.request.request_id not in order:
                order.append(s.request.request_id)
    return order


# ---- policies ------------------------------------------------------------------------------
def test_fcfs_admits_in_arrival_order_not_insertion_order(clock):
    sched = make_scheduler(clock=clock, policy="fcfs", max_num_seqs=1)
    reqs = [make_request(4, max_tokens=1, arrival_time=t) for t in (3.0, 1.0, 2.0)]
    for r in reqs:
        sched.add_request(r)
    assert _admission_order(sched) == [reqs[1].request_id, reqs[2].request_id, reqs[0].request_id]


def test_sjf_lets_a_short_request_overtake_long_ones(clock):
    """1. Two long requests (40 + 8 tokens of work) arrive first, a short one (4 + 2) last.
    2. With one sequence slot the short one is admitted first, then the longs in arrival order."""
    sched = make_scheduler(clock=clock, policy="sjf", max_num_seqs=1, aging_rate=0.0)
    long_a = make_request(40, max_tokens=8, arrival_time=0.0)
    long_b = make_request(40, max_tokens=8, arrival_time=1.0)
    short = make_request(4, max_tokens=2, arrival_time=2.0)
    for r in (long_a, long_b, short):
        sched.add_request(r)
    clock.now = 3.0
    out = step(sched)
    assert out.num_scheduled_tokens == {short.request_id: 4}
    assert _admission_order(sched)[1:] == [long_a.request_id, long_b.request_id]


def test_sjf_estimate_counts_max_tokens(clock):
    """Equal prompts: the one allowed fewer output tokens is the shorter job."""
    sched = make_scheduler(clock=clock, policy="sjf", max_num_seqs=1, aging_rate=0.0)
    many = make_request(8, max_tokens=30, arrival_time=0.0)
    few = make_request(8, max_tokens=3, arrival_time=1.0)
    sched.add_request(many)
    sched.add_request(few)
    assert sched.waiting.key(few) == 8 + 3 and sched.waiting.key(many) == 8 + 30
    assert _admission_order(sched) == [few.request_id, many.request_id]


def test_fcfs_ignores_length_and_priority(clock):
    sched = make_scheduler(clock=clock, policy="fcfs", max_num_seqs=1)
    long_low = make_request(40, max_tokens=8, priority=9, arrival_time=0.0)
    short_high = make_request(4, max_tokens=1, priority=0, arrival_time=1.0)
    sched.add_request(short_high)
    sched.add_request(long_low)
    assert _admission_order(sched) == [long_low.request_id, short_high.request_id]


def test_priority_serves_the_high_class_first_ties_by_arrival(clock):
    sched = make_scheduler(clock=clock, policy="priority", max_num_seqs=1, aging_rate=0.0)
    low = make_request(4, max_tokens=1, priority=2, arrival_time=0.0)
    high_late = make_request(4, max_tokens=1, priority=0, arrival_time=2.0)
    high_early = make_request(4, max_tokens=1, priority=0, arrival_time=1.0)
    mid = make_request(4, max_tokens=1, priority=1, arrival_time=0.5)
    for r in (low, high_late, high_early, mid):
        sched.add_request(r)
    clock.now = 3.0
    assert _admission_order(sched) == [high_early.request_id, high_late.request_id, mid.request_id,
                                       low.request_id]


def test_priority_preempts_a_running_low_priority_request_when_the_batch_is_full(clock):
    """1. A low-priority request runs alone in a batch of one (prefill 6, then a decode).
    2. A high-priority request arrives: the low one is preempted (recompute) and the high one
       prefills in the same step. 3. The low one resumes only after the high one finished."""
    sched = make_scheduler(clock=clock, policy="priority", max_num_seqs=1, aging_rate=0.0, preemption_mode="recompute")
    low = make_request(6, max_tokens=10, priority=5, arrival_time=0.0)
    sched.add_request(low)
    step(sched)
    step(sched)
    assert low.num_computed_tokens == 7
    high = make_request(6, max_tokens=2, priority=0, arrival_time=1.0)
    sched.add_request(high)
    clock.now = 1.0
    out = step(sched)
    assert out.preempted_ids == [low.request_id]
    assert out.num_scheduled_tokens == {high.request_id: 6}
    assert low.status is RequestStatus.WAITING and low.num_computed_tokens == 0
    assert sched.counters.num_preemptions_recompute == 1 and sched.counters.num_recomputed_tokens == 7
    out = step(sched)  # the high request's last token; it finishes
    assert out.num_scheduled_tokens == {high.request_id: 1} and high.is_finished
    out = step(sched)  # 6 prompt + 2 outputs, 4 of them (one block) served from the prefix cache
    assert out.num_scheduled_tokens == {low.request_id: 8 - 4}


def test_priority_preempts_when_the_kv_cache_is_full(clock):
    """Batch has room, blocks do not: 4 blocks of 4, the low request holds 3 (10 tokens) and the
    high request needs 2. The low one is preempted and its blocks go to the high one."""
    sched = make_scheduler(clock=clock, policy="priority", num_blocks=4, block_size=4, aging_rate=0.0, max_num_seqs=8,
                           preemption_mode="recompute", enable_prefix_caching=False)
    low = make_request(10, max_tokens=6, priority=3, arrival_time=0.0)
    sched.add_request(low)
    step(sched)
    assert len(sched.kv.block_tables[low.request_id][0]) == 3
    high = make_request(8, max_tokens=2, priority=1, arrival_time=1.0)
    sched.add_request(high)
    out = step(sched)
    assert out.preempted_ids == [low.request_id]
    assert out.num_scheduled_tokens == {high.request_id: 8}
    assert sched.kv.num_free_blocks == 2


@pytest.mark.parametrize("waiting_priority, waiting_arrival", [(7, 1.0), (3, 1.0)],
                         ids=["lower-class", "same-class-later"])
def test_priority_never_preempts_to_admit_a_lower_or_equal_rank(clock, waiting_priority, waiting_arrival):
    sched = make_scheduler(clock=clock, policy="priority", max_num_seqs=1, aging_rate=0.0)
    running = make_request(6, max_tokens=10, priority=3, arrival_time=0.0)
    sched.add_request(running)
    step(sched)
    waiting = make_request(6, max_tokens=2, priority=waiting_priority, arrival_time=waiting_arrival)
    sched.add_request(waiting)
    clock.now = 2.0
    for _ in range(5):
        out = step(sched)
        assert out.preempted_ids == [] and out.num_scheduled_tokens == {running.request_id: 1}
    assert sched.counters.num_preemptions_recompute == sched.counters.num_preemptions_swap == 0


def test_priority_victim_is_the_lowest_priority_then_the_latest_arrival(clock):
    """Batch of three full with priorities 1, 2 (early), 2 (late): a priority-0 arrival displaces
    the late priority-2 request only."""
    sched = make_scheduler(clock=clock, policy="priority", max_num_seqs=3, aging_rate=0.0)
    p1 = make_request(4, max_tokens=10, priority=1, arrival_time=2.0)
    p2_early = make_request(4, max_tokens=10, priority=2, arrival_time=0.0)
    p2_late = make_request(4, max_tokens=10, priority=2, arrival_time=1.0)
    for r in (p1, p2_early, p2_late):
        sched.add_request(r)
    clock.now = 3.0
    step(sched)
    urgent = make_request(4, max_tokens=2, priority=0, arrival_time=3.0)
    sched.add_request(urgent)
    out = step(sched)
    assert out.preempted_ids == [p2_late.request_id]
    assert set(out.num_scheduled_tokens) == {p1.request_id, p2_early.request_id, urgent.request_id}


def test_priority_swap_preemption_admits_the_high_priority_request(clock):
    """Same as the recompute case above, with swap: the high request must prefill this step and the
    low one must stay swapped out until the high one is done."""
    sched = make_scheduler(clock=clock, policy="priority", max_num_seqs=1, aging_rate=0.0, preemption_mode="swap",
                           num_host_blocks=16)
    low = make_request(6, max_tokens=10, priority=5, arrival_time=0.0)
    sched.add_request(low)
    step(sched)
    high = make_request(6, max_tokens=2, priority=0, arrival_time=1.0)
    sched.add_request(high)
    clock.now = 1.0
    out = step(sched)
    assert out.preempted_ids == [low.request_id]
    assert out.blocks_to_swap_in == []  # the victim is not swapped straight back in
    assert out.num_scheduled_tokens == {high.request_id: 6}
    assert low.status is RequestStatus.SWAPPED


def test_priority_does_not_preempt_when_the_cached_prefix_makes_the_request_fit(clock):
    """4 blocks of 4. The low request (8 shared tokens + 1) holds 3 blocks, 2 of them cached.
    The high request (the same 8 tokens + 1) hits those 2 blocks and needs 1 new block: exactly
    the one free block. Nothing must be preempted; both run this step."""
    sched = make_scheduler(clock=clock, policy="priority", num_blocks=4, block_size=4, aging_rate=0.0)
    shared = [11, 12, 13, 14, 15, 16, 17, 18]
    low = make_request(prompt=shared + [40], max_tokens=3, priority=5, arrival_time=0.0)
    sched.add_request(low)
    step(sched)
    assert sched.kv.num_free_blocks == 1
    high = make_request(prompt=shared + [50], max_tokens=2, priority=0, arrival_time=1.0)
    sched.add_request(high)
    out = step(sched)
    assert out.preempted_ids == []
    assert out.num_scheduled_tokens == {low.request_id: 1, high.request_id: 1}
    assert sched.counters.num_recomputed_tokens == 0


# ---- aging ---------------------------------------------------------------------------------
AGING_CASES = {
    # policy: (rank units between the classes, starving request, flood request, aging rate)
    "priority": dict(low=dict(num_tokens=4, max_tokens=3, priority=10),
                     high=dict(num_tokens=4, max_tokens=1, priority=0), gap=10.0, aging_rate=3.0),
    "sjf": dict(low=dict(num_tokens=20, max_tokens=3), high=dict(num_tokens=4, max_tokens=1),
                gap=(20 + 3) - (4 + 1), aging_rate=4.0),
}


def _run_flood(clock, policy: str, aging_rate: float, horizon_steps: int, case: dict,
               arrivals_per_step: int = 2, dt: float = 1.0):
    """One sequence slot; the starving request arrives at t=0 and every step of `dt` seconds brings
    `arrivals_per_step` short/high requests (each done in one step: overload, the queue grows).
    Returns (time the starving request was admitted or None, time it finished or None)."""
    sched = make_scheduler(clock=clock, policy=policy, max_num_seqs=1, aging_rate=aging_rate, max_num_batched_tokens=64)
    starving = make_request(arrival_time=0.0, **case["low"])
    sched.add_request(starving)
    for k in range(horizon_steps):
        clock.now = k * dt
        for _ in range(arrivals_per_step):
            sched.add_request(make_request(arrival_time=clock.now, **case["high"]))
        out = step(sched)
        assert out.preempted_ids == []
        if starving.first_scheduled_time is not None and starving.is_finished:
            return starving.first_scheduled_time, starving.finished_time
    return starving.first_scheduled_time, None


@pytest.mark.parametrize("policy", ["priority", "sjf"])
def test_aging_bounds_the_wait_of_a_starving_request(clock, policy):
    """Bound: the starving request's rank gap is G rank units (priority classes, or SJF tokens),
    so with aging rate a it outranks every request arriving more than D = G / a seconds after it.
    Only requests arriving in [0, D] can be served before it: at arrival rate lam and service
    rate mu that is at most (lam / mu) * (D + dt) seconds of work. Here lam = 2/dt, mu = 1/dt.
    1. With aging it is admitted within that bound (exactly after the 2 * (floor(D) + 1) flood
       requests that arrived by D), is never preempted by later arrivals and finishes.
    2. With aging_rate = 0 it is not admitted within three times the bound."""
    case, dt = AGING_CASES[policy], 1.0
    delay = case["gap"] / case["aging_rate"]
    assert delay != math.floor(delay)  # no exact rank ties at step boundaries
    bound = 2 * (delay + dt)
    horizon = int(3 * bound / dt) + 1

    admitted, finished = _run_flood(clock, policy, case["aging_rate"], horizon, case)
    assert admitted is not None and admitted <= bound
    assert admitted == 2 * (math.floor(delay / dt) + 1) * dt
    assert finished == admitted + (case["low"]["max_tokens"] - 1) * dt

    admitted, finished = _run_flood(clock, policy, 0.0, horizon, case)
    assert admitted is None and finished is None


def test_aging_improves_rank_linearly_with_waiting_time(clock):
    """The aged rank at time t is key - aging_rate * t: the class at arrival, 3 classes better
    after 6 s at 0.5 classes/s; a later arrival of the same class ranks worse by the gap."""
    sched = make_scheduler(clock=clock, policy="priority", aging_rate=0.5)
    request = make_request(4, priority=4, arrival_time=10.0)
    later = make_request(4, priority=4, arrival_time=16.0)
    assert sched.waiting.key(request) - 0.5 * 10.0 == 4.0
    assert sched.waiting.key(request) - 0.5 * 16.0 == 1.0
    assert sched.waiting.key(later) - sched.waiting.key(request) == 0.5 * 6.0


# ---- preemption modes ----------------------------------------------------------------------
def _two_requests_contending(sched, max_tokens: int = 3):
    """4 blocks of 4. Two 7-token prompts take 2 blocks each (step 1); position 7 still fits
    (step 2); in step 3 the early request needs a third block and the late one is preempted
    with 8 computed tokens in 2 blocks."""
    early = make_request(7, max_tokens=max_tokens, arrival_time=1.0)
    late = make_request(7, max_tokens=max_tokens, arrival_time=2.0)
    sched.add_request(early)
    sched.add_request(late)
    step(sched)
    step(sched)
    out = step(sched)
    assert out.preempted_ids == [late.request_id]
    return early, late, out


def test_swap_preemption_counters_are_exact(clock):
    """1. Steps 1-3 as in _two_requests_contending, swap mode: 2 blocks swapped out; the early
    request finishes in step 3 (3 outputs). 2. Step 4: the late one swaps its 2 blocks back in,
    gets a third and decodes its last token. Nothing recomputed."""
    sched = make_scheduler(clock=clock, num_blocks=4, block_size=4, num_host_blocks=4, preemption_mode="swap")
    early, late, out = _two_requests_contending(sched)
    assert len(out.blocks_to_swap_out) == 2 and sched.kv.host_pool.num_free_blocks == 2
    assert late.status is RequestStatus.SWAPPED and early.is_finished
    out = step(sched)
    assert len(out.blocks_to_swap_in) == 2 and out.num_scheduled_tokens == {late.request_id: 1}
    assert late.is_finished
    c = sched.counters
    assert (c.num_preemptions_swap, c.num_preemptions_recompute, c.num_blocks_swapped_out,
            c.num_blocks_swapped_in, c.num_recomputed_tokens) == (1, 0, 2, 2, 0)
    assert sched.kv.num_free_blocks == 4 and sched.kv.host_pool.num_free_blocks == 4


@pytest.mark.parametrize("prefix_caching, recomputed_step", [(False, 9), (True, 9 - 4)])
def test_recompute_preemption_counters_are_exact(clock, prefix_caching, recomputed_step):
    """1. Steps 1-3: the late request is preempted with 8 computed tokens, which are thrown away.
    2. Step 4: it is re-admitted and recomputes its 9 tokens; with prefix caching its first full
    block is still cached (the second was handed to the early request) and is not recomputed."""
    sched = make_scheduler(clock=clock, num_blocks=4, block_size=4, preemption_mode="recompute",
                           enable_prefix_caching=prefix_caching)
    early, late, _ = _two_requests_contending(sched)
    assert late.status is RequestStatus.WAITING and late.num_computed_tokens == 0
    out = step(sched)
    assert out.num_scheduled_tokens == {late.request_id: recomputed_step}
    c = sched.counters
    assert (c.num_preemptions_swap, c.num_preemptions_recompute, c.num_blocks_swapped_out,
            c.num_blocks_swapped_in, c.num_recomputed_tokens) == (0, 1, 0, 0, 8)


def test_full_swap_pool_falls_back_to_recompute(clock):
    """The victim holds 2 blocks, the host pool has 1: swap is impossible, it is recomputed."""
    sched = make_scheduler(clock=clock, num_blocks=4, block_size=4, num_host_blocks=1, preemption_mode="swap")
    _, late, out = _two_requests_contending(sched)
    assert out.blocks_to_swap_out == [] and late.status is RequestStatus.WAITING
    assert sched.kv.host_pool.num_free_blocks == 1
    c = sched.counters
    assert (c.num_preemptions_swap, c.num_preemptions_recompute, c.num_recomputed_tokens) == (0, 1, 8)


@pytest.mark.parametrize("block_bytes, expect_swap", [(1_000, True), (10**9, False)],
                         ids=["swap-cheaper", "swap-dearer"])
def test_auto_preemption_weighs_swap_against_recompute(clock, block_bytes, expect_swap):
    """No prefix cache: recomputing 8 tokens at 400 tok/s costs 20 ms; moving 2 blocks out and
    back costs 2 * 2 * block_bytes / 5e9 s: 0.8 us for 1 kB blocks, 0.8 s for 1 GB blocks."""
    sched = make_scheduler(clock=clock, num_blocks=4, num_host_blocks=4, enable_prefix_caching=False,
                           preemption_mode="auto", costs=PreemptionCosts(block_bytes=block_bytes))
    _, late, _ = _two_requests_contending(sched)
    c = sched.counters
    assert (c.num_preemptions_swap, c.num_preemptions_recompute) == ((1, 0) if expect_swap else (0, 1))
    assert late.status is (RequestStatus.SWAPPED if expect_swap else RequestStatus.WAITING)


def test_auto_preemption_recomputes_a_victim_whose_prefix_is_shared_and_cached(clock):
    """The late request's 8 tokens are the early request's prompt prefix, which stays owned (and
    cached) by the early request: recomputing costs nothing, so auto recomputes even though swap
    is cheap, and re-admission serves those 8 tokens from the cache."""
    sched = make_scheduler(clock=clock, num_blocks=6, num_host_blocks=8, preemption_mode="auto",
                           costs=PreemptionCosts(block_bytes=50_000_000))  # swap dearer than a few tokens
    shared = list(range(1, 9))
    early = make_request(prompt=shared + [40, 41, 42, 43, 44], max_tokens=8, arrival_time=1.0)
    sched.add_request(early)
    step(sched)  # 13 tokens: 4 blocks, the first 2 cached
    late = make_request(prompt=shared + [50], max_tokens=8, arrival_time=2.0)
    sched.add_request(late)
    out = step(sched)  # late reuses the 2 cached blocks, computes 1 token in a block of its own
    assert out.num_scheduled_tokens == {early.request_id: 1, late.request_id: 1}
    while not out.preempted_ids:
        out = step(sched)
    assert out.preempted_ids == [late.request_id]
    assert sched.counters.num_preemptions_recompute == 1 and sched.counters.num_preemptions_swap == 0
    hits_before = sched.counters.num_prefix_hit_tokens
    while late.status is not RequestStatus.RUNNING:
        step(sched)
    assert sched.counters.num_prefix_hit_tokens - hits_before >= 8


def test_auto_preemption_swaps_when_only_the_victim_holds_its_blocks(clock):
    """Prefix caching on (the default), swap cheap (2 blocks of 1 kB). The victim's full blocks are
    cached under its own hashes only: preemption frees them for the allocation that failed, so
    they are no cache to count on. Auto must weigh recomputing all 8 tokens and swap."""
    sched = make_scheduler(clock=clock, num_blocks=4, num_host_blocks=4, preemption_mode="auto",
                       costs=PreemptionCosts(block_bytes=1_000))
    _, late, _ = _two_requests_contending(sched)
    assert late.status is RequestStatus.SWAPPED
    assert sched.counters.num_recomputed_tokens == 0
