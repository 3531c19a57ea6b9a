"""Scheduler decisions without a model: budgets, chunking, static batching, preemption."""
from __future__ import annotations

import pytest

from engine.request import FinishReason
from tests.engine.helpers import make_request, make_scheduler, step


def test_token_budget_chunks_prefill_after_decodes():
    """1. Three prompts of 30 under a budget of 40: 30 + 10 scheduled. 2. Next step: the first
    decodes (1), the second finishes its prefill (20), the third gets the rest (19)."""
    sched = make_scheduler(max_num_batched_tokens=40, block_size=4, num_blocks=64)
    reqs = [make_request(30, max_tokens=5) for _ in range(3)]
    for r in reqs:
        sched.add_request(r)
    out = step(sched)
    assert out.num_scheduled_tokens == {reqs[0].request_id: 30, reqs[1].request_id: 10}
    out = step(sched)
    assert out.num_scheduled_tokens == {reqs[0].request_id: 1, reqs[1].request_id: 20, reqs[2].request_id: 19}
    assert [s.sample for s in out.scheduled] == [True, True, False]


def test_max_num_seqs_bounds_the_batch():
    sched = make_scheduler(max_num_seqs=2)
    for _ in range(3):
        sched.add_request(make_request(5))
    assert len(step(sched).scheduled) == 2


@pytest.mark.parametrize("policy", ["static", "fcfs"])
def test_a_freed_slot_is_refilled_at_once_only_by_continuous_batching(policy):
    """1. A batch of two; one member finishes after its first token. 2. A late request arrives.
    3. fcfs admits it at the next step; static makes it wait until the whole batch has drained."""
    sched = make_scheduler(policy=policy, max_num_seqs=2)
    first = [make_request(5, max_tokens=3), make_request(5, max_tokens=1)]
    for r in first:
        sched.add_request(r)
    step(sched)
    late = make_request(5, max_tokens=2)
    sched.add_request(late)
    out = step(sched)
    assert (late.request_id in out.num_scheduled_tokens) == (policy == "fcfs")
    while first[0].request_id in sched.requests:
        step(sched)
    assert late.is_finished or late.request_id in step(sched).num_scheduled_tokens


def test_recompute_preemption_takes_the_latest_arrival_and_requeues_it():
    sched = make_scheduler(num_blocks=4, block_size=4, preemption_mode="recompute")
    early, late = make_request(7, max_tokens=8, arrival_time=1.0), make_request(7, max_tokens=8, arrival_time=2.0)
    sched.add_request(early)
    sched.add_request(late)
    step(sched)  # 7 prompt tokens each: 2 blocks each, the pool is full
    step(sched)  # position 7 still fits
    out = step(sched)  # position 8 needs a third block
    assert out.preempted_ids == [late.request_id]
    assert late.num_computed_tokens == 0 and late.request_id in sched.waiting
    assert sched.counters.num_preemptions_recompute == 1 and sched.counters.num_recomputed_tokens == 8


def test_swap_preemption_emits_block_pairs_and_swaps_back_first():
    sched = make_scheduler(num_blocks=4, block_size=4, num_host_blocks=4, preemption_mode="swap")
    early, late = make_request(7, max_tokens=3, arrival_time=1.0), make_request(7, max_tokens=3, arrival_time=2.0)
    sched.add_request(early)
    sched.add_request(late)
    step(sched)
    step(sched)
    out = step(sched)
    assert len(out.blocks_to_swap_out) == 2
    assert sched.swapped == [late]
    while early.request_id in sched.requests:
        step(sched)
    out = step(sched)
    assert len(out.blocks_to_swap_in) == 2 and late.request_id in out.num_scheduled_tokens


def _parked_beam(sched, num_tokens: int):
    beam = make_request(num_tokens, max_tokens=1)
    beam.beam = True
    sched.add_request(beam)
    step(sched, token=9)
    assert beam in sched.parked and beam.token_ids[-1] == 9  # sampled; held with its blocks
    return beam


def test_a_forked_beam_shares_its_parents_blocks_and_copies_the_tail_it_writes():
    """A parked beam of 6 tokens (2 blocks of 4, the second partial) forked twice: each child
    holds both blocks; the first child to write the shared tail copies it, the last writes it in
    place once the parent has ended."""
    sched = make_scheduler(block_size=4)
    parent = _parked_beam(sched, 6)
    table = sched.kv.block_tables[parent.request_id][0]
    sched.fork_beam(parent.request_id, "a", 11)
    sched.fork_beam(parent.request_id, "b", 12)
    sched.finish_request(parent.request_id, FinishReason.LENGTH)
    assert [sched.kv.block_tables[c][0] for c in "ab"] == [table, table]
    assert [sched.requests[c].token_ids[-1] for c in "ab"] == [11, 12]
    out = step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}  # only the token each beam was extended by
    assert len(out.blocks_to_copy) == 1 and out.blocks_to_copy[0][0] == table[1]
    assert sched.kv.block_tables["a"][0][0] == sched.kv.block_tables["b"][0][0] == table[0]


def test_parked_beams_give_their_blocks_up_to_a_request_that_needs_them():
    """The pool holds 4 blocks: a parked beam takes 2, a new prompt needs 3. The beam's blocks
    are reclaimed; the beam forked from it later is computed again."""
    sched = make_scheduler(num_blocks=4, block_size=4)
    parent = _parked_beam(sched, 6)
    other = make_request(10, max_tokens=2)
    sched.add_request(other)
    assert step(sched).num_scheduled_tokens == {other.request_id: 10}
    assert parent.num_computed_tokens == 0 and parent.request_id not in sched.kv.block_tables
    sched.fork_beam(parent.request_id, "child", 11)
    sched.finish_request(parent.request_id, FinishReason.LENGTH)
    assert "child" in sched.waiting and sched.requests["child"].num_computed_tokens == 0
