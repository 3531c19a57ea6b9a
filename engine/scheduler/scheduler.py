"""Iteration-level scheduler: which requests run this step and how many tokens each.

There are no prefill or decode phases: every request has `num_tokens` and `num_computed_tokens`,
and each step hands out tokens under one budget (`max_num_batched_tokens`, `max_num_seqs`), so
prefill chunks and decodes share one ragged batch. Owns admission order, preemption (swap or
recompute), finishing, beams parked for their search, and the statistics of all of it; owns no
tensors. Block bookkeeping is the KVCacheManager's. Time comes from the injected `clock`.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.config import SchedulerConfig, SpeculativeConfig
from engine.kv_cache.manager import KVCacheManager
from engine.metrics import EngineStats, StepStats
from engine.outputs import ModelRunnerOutput, SpecCounts
from engine.request import FinishReason, Request, RequestStatus
from engine.scheduler.output import PENDING_TOKEN, ScheduledRequest, SchedulerOutput
from engine.scheduler.output_lengths import OutputLengths
from engine.scheduler.queue import WaitingQueue
from engine.scheduler.speculation.adaptive import AdaptiveSpeculation
from engine.scheduler.speculation.ngram import NgramProposer
from engine.scheduler.speculation.pending import PendingDrafts
from engine.scheduler.step_time import StepTimeModel

if TYPE_CHECKING:
    from engine.lora import Adapter

EMBEDDING_CREDIT_STEPS = 8  # embeddings' earned step time is kept up to this many decode steps' time
MIN_PREFILL_CHUNK = 16  # prompt tokens a step under a latency target still takes: long prompts progress
CATCH_UP_DECAY = 0.7  # weight of the past per newly timed draft-model catch-up


@dataclass(slots=True)
class SchedulerCounters:
    """Cumulative counts since start (make_stats reports them)."""
    num_preemptions_swap: int = 0
    num_preemptions_recompute: int = 0
    num_blocks_swapped_out: int = 0
    num_blocks_swapped_in: int = 0
    num_recomputed_tokens: int = 0  # computed tokens thrown away by recompute preemption
    num_prefix_query_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    num_prompt_tokens: int = 0  # prompt tokens computed (prefix-cache hits excluded)
    num_generation_tokens: int = 0
    num_failed_requests: int = 0
    num_spec_unfilled_steps: int = 0  # steps whose reserved drafts the draft model did not fill
    spec: SpecCounts = field(default_factory=SpecCounts)


@dataclass(frozen=True, slots=True)
class PreemptionCosts:
    """What `auto` preemption weighs: moving KV out and back vs recomputing it."""
    block_bytes: int = 0  # KV bytes of one block across all layers
    swap_bytes_per_s: float = 5e9
    recompute_tokens_per_s: float = 400.0


@dataclass(slots=True)
class SchedulerUpdate:
    """What a step changed: requests that got a token (finished ones included, with status
    FINISHED) and the user requests (groups) that failed, already finished with ERROR."""
    updated: list[Request] = field(default_factory=list)
    failed: dict[str, Exception] = field(default_factory=dict)  # group id -> error


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 eos_token_ids: frozenset[int] = frozenset(), costs: PreemptionCosts = PreemptionCosts(),
                 clock: Callable[[], float] = time.monotonic, speculative: SpeculativeConfig | None = None,
                 max_loras: int | None = None, release_adapter: Callable[[Adapter], None] | None = None):
        """`speculative`: decoding requests get draft tokens to verify in the same forward.
        `max_loras`: most distinct LoRA adapters in one step; `release_adapter`: told when a
        request with an adapter ends (engine.lora.Adapters.release)."""
        self.config = config
        self.max_loras = max_loras
        self.release_adapter = release_adapter
        self.speculative = speculative
        self.proposer = (None if speculative is None else PendingDrafts() if speculative.uses_draft_model
                         else NgramProposer(speculative.prompt_lookup_min, speculative.prompt_lookup_max))
        self.adaptive = (AdaptiveSpeculation(prior_from_engine=speculative.uses_draft_model)
                         if speculative is not None and speculative.adaptive else None)
        self.kv = kv
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.costs = costs
        self.clock = clock
        self.waiting = WaitingQueue(config.policy, config.aging_rate)
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.parked: list[Request] = []  # beams that sampled, until their search forks them (fork_beam)
        self.requests: dict[str, Request] = {}
        self.counters = SchedulerCounters()
        self._groups: dict[str, list[str]] = {}  # group id -> request ids of its samples
        self._finished_ids: list[str] = []  # since the last schedule(): the runner drops their state
        self._static_batch_open = True
        self.step_time = StepTimeModel()  # fed by the engine; sizes steps and speculation
        self._embedding_budget: int | None = None  # this step's embedding tokens left (None: no limit)
        self._embedding_credit = 0.0  # step seconds embeddings have earned and not spent (embedding_budget)
        self.draft_pass_time = StepTimeModel()  # a draft-model pass's seconds by the requests it drafts for
        self.catch_up_seconds_per_token: float | None = None  # a draft model's first pass over a request
        self.output_lengths = OutputLengths()  # of requests that ended by a stop or at their cap

    # ---- requests in and out -------------------------------------------------------------
    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raises ValueError for a request that could never be scheduled. Changes nothing."""
        max_len = min(num_prompt_tokens + max_tokens, self.max_model_len)
        needed = self.kv.peak_blocks(max_len, self.config.max_num_batched_tokens)
        if needed > self.kv.num_blocks:
            raise ValueError(f"prompt + max_tokens needs {needed} KV blocks ({max_len} tokens); the KV cache has "
                             f"{self.kv.num_blocks}")
        if not self.config.enable_chunked_prefill and num_prompt_tokens > self.config.max_num_batched_tokens:
            raise ValueError(f"prompt has {num_prompt_tokens} tokens, over max_num_batched_tokens "
                             f"{self.config.max_num_batched_tokens} with chunked prefill off")

    def add_request(self, request: Request) -> None:
        """Queues a request. Raises ValueError if it could never fit (see check_fits)."""
        self.check_fits(request.num_prompt_tokens, request.params.max_tokens)
        self._track(request)
        self.waiting.add(request)

    def _track(self, request: Request) -> None:
        if request.adapter is not None:
            request.adapter.users += 1
        self.requests[request.request_id] = request
        self._groups.setdefault(request.group_id, []).append(request.request_id)

    def finish_request(self, request_id: str, reason: FinishReason) -> Request | None:
        """Ends a request wherever it is and frees its blocks at once; None if unknown."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.SWAPPED:
            self.swapped.remove(request)
        elif request.status is RequestStatus.PARKED:
            self.parked.remove(request)
        else:
            self.waiting.remove(request_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if reason in (FinishReason.STOP, FinishReason.LENGTH) and not request.beam:
            self.output_lengths.record(request.num_output_tokens)
        request.finished_time = self.clock()
        self.kv.free(request)
        self.kv.forget(request)
        if self.proposer is not None:
            self.proposer.forget(request_id)
        if self.adaptive is not None:
            self.adaptive.forget(request_id)
        self._finished_ids.append(request_id)
        if request.adapter is not None and self.release_adapter is not None:
            self.release_adapter(request.adapter)
        siblings = self._groups[request.group_id]
        siblings.remove(request_id)
        if not siblings:
            del self._groups[request.group_id]
        if not self.running and not self.swapped:
            self._static_batch_open = True
        return request

    def finish_group(self, group_id: str, reason: FinishReason) -> None:
        """Ends every sample of a user request that has not finished yet."""
        if reason is FinishReason.ERROR and group_id in self._groups:
            self.counters.num_failed_requests += 1
        for request_id in list(self._groups.get(group_id, ())):
            self.finish_request(request_id, reason)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def fork_beam(self, parent_id: str, child_id: str, token_id: int) -> None:
        """Adds the beam extending parked beam `parent_id` by `token_id`. It shares the parent's
        blocks: full ones by reference, the last, partial one copy-on-write (copied when a beam
        writes it while another still holds it). A parent whose blocks were reclaimed leaves
        the child to be computed again, its full blocks found in the prefix cache."""
        parent = self.requests[parent_id]
        child = parent.beam_child(child_id, token_id)
        self._track(child)
        if parent.num_computed_tokens > 0:
            self.kv.fork(parent, child)
            child.status = RequestStatus.RUNNING
            self.running.append(child)
        else:
            self.waiting.add(child)

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_ids=self._finished_ids)
        self._finished_ids = []
        if self.config.policy == "priority":
            self._preempt_for_priority(out)
        self._embedding_budget = self.embedding_budget()
        budget = self._schedule_running(out, self.token_budget())
        budget = self._schedule_swapped(out, budget)
        if self.config.policy != "static" or self._static_batch_open:
            self._schedule_waiting(out, budget, self.clock())
        if self.config.policy == "static" and self.running and (
                len(self.running) >= self.config.max_num_seqs or not self.waiting):
            self._static_batch_open = False
        return out

    def schedule_ahead(self, out: SchedulerOutput) -> SchedulerOutput | None:
        """The step after `out`, scheduled before `out`'s tokens are known (async scheduling): a
        steady batch of decodes runs again, each one position on, its input the token `out`
        samples for it (PENDING_TOKEN here; the runner reads it on the device). None where the
        next step could be another one: requests waiting or swapped that could join it (the
        batch has room, or `priority` could preempt for them), beams parked, a prefill chunk or
        drafts in `out`, a running request it left out, a request whose next token depends on
        its output so far beyond the token itself (penalties, min_tokens, a grammar, a beam),
        or blocks short. A request `out` ends by length is left out (its place is free for the
        step after); one that a stop token or string ends is found when `out` is processed, its
        row of this step is dropped, and its place goes to a waiting request a step later."""
        if self.parked or self.speculative is not None:
            return None
        num_running, continuing = 0, []
        for item in out.scheduled:
            request = item.request
            if request.status is not RequestStatus.RUNNING:
                continue  # ended: dropped
            if len(item.token_ids) != 1 or not item.sample or not _samples_ahead(request):
                return None
            num_running += 1
            if not self._at_length(request, 1):
                continuing.append(request)
        if num_running != len(self.running) or not continuing:
            return None
        queued = self.waiting or self.swapped
        if queued and (self.config.policy == "priority" or len(continuing) < self.config.max_num_seqs):
            return None
        kv = self.kv
        # two tokens span at most two blocks of each KV group, each new or copied: counted exactly only if that
        # could not fit
        if (2 * kv.layout.num_groups * len(continuing) > kv.num_free_blocks
                and sum(kv.num_free_blocks_needed(request, 2) for request in continuing) > kv.num_free_blocks):
            return None
        ahead = SchedulerOutput(finished_ids=self._finished_ids)
        self._finished_ids = []
        for request in continuing:  # slots for `out`'s position and the next
            copies = kv.allocate_slots(request, 2)
            assert copies is not None  # counted above
            ahead.blocks_to_copy.extend(copies)
            ahead.scheduled.append(ScheduledRequest(request, [PENDING_TOKEN], request.num_computed_tokens + 1,
                                                    kv.copy_tables(request.request_id), True))
        return ahead

    def _at_length(self, request: Request, num_pending: int = 0) -> bool:
        """Whether the request has reached max_tokens or the model's length, counting
        `num_pending` tokens being sampled for it now."""
        num_tokens = len(request.token_ids) + num_pending
        return num_tokens - request.num_prompt_tokens >= request.params.max_tokens or num_tokens >= self.max_model_len

    def observe_step(self, num_tokens: int, seconds: float, num_draft_passes: int = 0,
                     draft_seconds: float = 0.0, num_drafting: int = 0, num_catch_up_tokens: int = 0) -> None:
        """The engine reports each step's size and wall time without drafting (the step-time
        model's data), and the draft-model passes that filled its drafts, their time, the number
        of requests they drafted for, and the tokens the draft model computed first for requests
        it did not hold (its catch-up, whose time is what the call took beyond its passes' price:
        a one-time cost that would price passes far above what they cost for the rest of a
        request)."""
        if num_tokens > 0:
            self.step_time.observe(num_tokens, seconds)
        if num_catch_up_tokens > 0:
            passes = num_draft_passes * self.draft_pass_seconds(num_drafting)
            per_token = max(draft_seconds - passes, 0.0) / num_catch_up_tokens
            previous = self.catch_up_seconds_per_token
            self.catch_up_seconds_per_token = (per_token if previous is None
                                               else CATCH_UP_DECAY * previous + (1 - CATCH_UP_DECAY) * per_token)
        elif num_draft_passes > 0:
            self.draft_pass_time.observe(num_drafting, draft_seconds / num_draft_passes)

    def draft_pass_seconds(self, num_requests: int) -> float:
        """A draft-model pass over `num_requests` requests: the recent time of passes that size,
        else priced from the nearest size timed (StepTimeModel.estimate). A pass over 64 requests
        costs several over 4, so one price for all sizes kept a pass seen in a full batch from ever
        being tried in a small one. 0 before any pass: drafts are tried, and so timed."""
        estimate = self.draft_pass_time.estimate(num_requests)
        return 0.0 if estimate is None else estimate

    def token_budget(self) -> int:
        """This step's tokens: `max_num_batched_tokens`, or under `target_step_latency_s` what the
        measured step-time model fits in the target, never less than every running decode plus
        MIN_PREFILL_CHUNK (a target the decodes alone exceed cannot be met by taking less)."""
        limit, target = self.config.max_num_batched_tokens, self.config.target_step_latency_s
        fits = None if target is None else self.step_time.tokens_within(target)
        if fits is None:
            return limit
        num_decodes = sum(r.is_decoding for r in self.running)
        return min(limit, max(fits, num_decodes + MIN_PREFILL_CHUNK))

    def embedding_budget(self) -> int | None:
        """Embedding prompt tokens this step may take, so they never hold up generation: while
        requests decode, embeddings earn `embedding_step_share` of each decode step's time (the
        step-time model's figure for the decodes alone) and spend it on the extra time their
        tokens add to a step; a step takes them once the time earned pays for MIN_PREFILL_CHUNK
        tokens or more, as many as it pays for (a step with embeddings can cost far more than
        the decodes' alone: it leaves the decode kernels). None (the whole budget) with nothing
        decoding."""
        decodes = sum(r.is_decoding for r in self.running)
        waiting = self.waiting.num_embeddings or any(r.pooling is not None for r in self.running)
        if not decodes or not waiting:
            self._embedding_credit = 0.0
            return None
        alone = self.step_time.estimate(decodes)
        if alone is None:
            return MIN_PREFILL_CHUNK
        self._embedding_credit = min(self._embedding_credit + self.config.embedding_step_share * alone,
                                     EMBEDDING_CREDIT_STEPS * alone)
        budget = self.config.max_num_batched_tokens - decodes
        while budget >= MIN_PREFILL_CHUNK and self._extra_seconds(decodes, budget) > self._embedding_credit:
            budget //= 2
        return budget if budget >= MIN_PREFILL_CHUNK else 0

    def _extra_seconds(self, decodes: int, tokens: int) -> float:
        """What `tokens` more tokens add to a step of `decodes` decodes (the step-time model's estimate)."""
        more, alone = self.step_time.estimate(decodes + tokens), self.step_time.estimate(decodes)
        return 0.0 if more is None or alone is None else max(more - alone, 0.0)  # None: no step timed yet

    def _embedding_tokens(self, request: Request, num_new: int) -> int:
        """`num_new` cut to what is left of this step's embedding budget, for an embedding request."""
        if request.pooling is None or self._embedding_budget is None:
            return num_new
        return min(num_new, self._embedding_budget)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Best first; a prefill chunk leaves room for the decodes ranked behind it, so a long
        prompt never makes a running stream skip a step."""
        queue = deque(sorted(self.running, key=self._victim_rank))  # best first; victims come from the tail
        decodes_behind = sum(r.is_decoding for r in queue)
        planned = self._plan_drafts() if self.proposer is not None else {}
        while queue and budget > 0:
            request = queue.popleft()
            drafts: list[int] = []
            if request.is_decoding:
                decodes_behind -= 1
                room = budget - decodes_behind - 1  # a draft never takes a decode's place
                drafts = planned.get(request.request_id, [])[:max(room, 0)]
                num_new = 1
            else:
                num_new = self._embedding_tokens(request, min(request.num_uncomputed_tokens, budget - decodes_behind))
                if num_new <= 0:
                    continue
            copies = self.kv.allocate_slots(request, num_new + len(drafts)) if drafts else None
            if copies is None:  # drafts never cost a batch-mate its place
                drafts = []
                copies = self.kv.allocate_slots(request, num_new)
            if copies is None and self._reclaim_parked():
                copies = self.kv.allocate_slots(request, num_new)
            while copies is None and queue:
                victim = queue.pop()
                decodes_behind -= victim.is_decoding
                self._preempt(victim, out)
                copies = self.kv.allocate_slots(request, num_new)
            if copies is None:
                self._preempt(request, out)
                continue
            self._add_scheduled(out, request, num_new, copies, drafts)
            budget -= num_new + len(drafts)
        return budget

    def _plan_drafts(self) -> dict[str, list[int]]:
        """Drafts for each decoding request: up to num_speculative_tokens, none past its
        max_tokens or the model's length (the token after the last draft is always new), then,
        when adaptive, cut to what is expected to pay (engine.scheduler.speculation.adaptive)."""
        assert self.speculative is not None and self.proposer is not None  # called only when speculating
        decoding = [r for r in self.running if r.is_decoding]
        limits = [min(self.speculative.num_speculative_tokens, r.params.max_tokens - r.num_output_tokens - 1,
                      self.max_model_len - r.num_tokens - 1) for r in decoding]
        drafts = self.proposer.propose(decoding, limits)
        if self.adaptive is not None:
            catch_up = None  # none timed (none run, or drafts need none): tried, and so timed
            if self.catch_up_seconds_per_token is not None:  # the request's tokens so far, over those it has left
                catch_up = [self.catch_up_seconds_per_token * r.num_tokens / self.output_lengths.expected_remaining(
                    r.num_output_tokens, min(r.params.max_tokens, self.max_model_len - r.num_prompt_tokens))
                    for r in decoding]
            drafts = self.adaptive.trim([r.request_id for r in decoding], drafts, self.step_time, len(decoding),
                                        self.draft_pass_seconds, catch_up)
        return {r.request_id: d for r, d in zip(decoding, drafts) if d}

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        """Swaps requests back in, best first, ahead of new admissions; never one preempted this
        step, nor (under `priority`) one that ranks below the best waiting request."""
        if not self.swapped:
            return budget
        preempted = set(out.preempted_ids)
        best_waiting = self.waiting.peek() if self.config.policy == "priority" else None
        for request in sorted(self.swapped, key=self._victim_rank):
            if request.request_id in preempted:
                continue
            num_new = self._embedding_tokens(request, min(request.num_uncomputed_tokens, budget))
            if (num_new == 0 or len(self.running) >= self.config.max_num_seqs
                    or (best_waiting is not None and self._victim_rank(best_waiting) < self._victim_rank(request))):
                break
            if not self._adapter_fits(request):
                continue
            needed = self.kv.num_blocks_to_resume(request, num_new)
            if needed > self.kv.num_free_blocks and not (self._reclaim_parked() and needed <= self.kv.num_free_blocks):
                break
            pairs = self.kv.swap_in(request)
            assert pairs is not None  # the blocks were counted above
            self.swapped.remove(request)
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            out.blocks_to_swap_in.extend(pairs)
            self.counters.num_blocks_swapped_in += len(pairs)
            copies = self.kv.allocate_slots(request, num_new)
            assert copies is not None
            self._add_scheduled(out, request, num_new, copies)
            budget -= num_new
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, now: float) -> None:
        """Admits waiting requests best first while the budget and the batch have room; an
        embedding request past this step's embedding budget is passed over (it keeps its place
        for the next step), so a burst of them never holds up generation's admissions."""
        passed: list[Request] = []
        try:
            self._admit_waiting(out, budget, now, passed)
        finally:
            for request in passed:
                self.waiting.add(request)

    def _admit_waiting(self, out: SchedulerOutput, budget: int, now: float, passed: list[Request]) -> None:
        while (request := self.waiting.peek()) is not None:
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                return
            if request.pooling is not None and self._embedding_budget is not None and self._embedding_budget <= 0:
                if len(self.waiting) == self.waiting.num_embeddings:
                    return  # only embeddings wait
                self.waiting.pop()  # the one peeked
                passed.append(request)
                continue
            if not self._adapter_fits(request):  # its adapter's turn comes when one of the step's ends
                self.waiting.pop()  # the one peeked
                passed.append(request)
                continue
            computed = self.kv.get_computed_blocks(request)
            remaining = request.num_tokens - computed.num_tokens
            num_new = self._embedding_tokens(request, min(remaining, budget))
            if not self.config.enable_chunked_prefill and num_new < remaining:
                return
            copies = self.kv.allocate_slots(request, num_new, computed)
            if copies is None and self._reclaim_parked():
                computed = self.kv.get_computed_blocks(request)
                num_new = self._embedding_tokens(request, min(request.num_tokens - computed.num_tokens, budget))
                copies = self.kv.allocate_slots(request, num_new, computed)
            if copies is None:
                return  # no head-of-line bypass: lower ranks wait behind this one
            self.waiting.pop()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = computed.num_tokens
            request.num_cached_prompt_tokens = computed.num_tokens
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            self.counters.num_prefix_query_tokens += request.num_tokens
            self.counters.num_prefix_hit_tokens += computed.num_tokens
            self._add_scheduled(out, request, num_new, copies)
            budget -= num_new

    def _adapter_fits(self, request: Request) -> bool:
        """Whether the request's adapter may join the running batch: it has none, one a running
        request has, or the batch holds fewer than max_loras adapters."""
        if request.adapter is None:
            return True
        running = {id(r.adapter) for r in self.running if r.adapter is not None}
        return id(request.adapter) in running or self.max_loras is None or len(running) < self.max_loras

    def _add_scheduled(self, out: SchedulerOutput, request: Request, num_new: int,
                       copies: list[tuple[int, int]], drafts: list[int] | None = None) -> None:
        if request.pooling is not None and self._embedding_budget is not None:
            decodes = sum(r.is_decoding for r in self.running)
            self._embedding_credit -= self._extra_seconds(decodes, num_new)
            self._embedding_budget -= num_new
        start = request.num_computed_tokens
        if copies:
            out.blocks_to_copy.extend(copies)
        token_ids = request.token_ids[start:start + num_new]
        if drafts:
            token_ids += drafts
        else:
            drafts = []
        out.scheduled.append(ScheduledRequest(request, token_ids, start, self.kv.copy_tables(request.request_id),
                                              start + num_new == len(request.token_ids), drafts))

    # ---- preemption ----------------------------------------------------------------------
    def _reclaim_parked(self) -> bool:
        """Frees the blocks of parked beams, the cheapest to give up: their full blocks stay in
        the prefix cache, and a beam waiting for a sibling that needs blocks would otherwise
        wait forever. True if any were freed."""
        holding = [r for r in self.parked if r.num_computed_tokens > 0]
        for request in holding:
            self.counters.num_recomputed_tokens += request.num_computed_tokens
            self.kv.free(request)
            request.num_computed_tokens = 0
        return bool(holding)

    def _victim_rank(self, request: Request) -> tuple[float, float]:
        """Lower is better; preemption takes the highest. Under `priority` this is the waiting
        queue's key, so a waiting request and a running one compare on one (aged) scale."""
        if self.config.policy == "priority":
            return (self.waiting.key(request), request.arrival_time)
        if self.config.victim_order == "latest_arrival":
            return (0.0, request.arrival_time)
        return (float(request.priority), request.arrival_time)

    def _preempt_for_priority(self, out: SchedulerOutput) -> None:
        """Displaces running requests of strictly worse rank while the best waiting request finds
        the batch or the KV cache full. Never preempts to admit a request of lower rank."""
        best = self.waiting.peek()
        if best is None:
            return
        computed = self.kv.get_computed_blocks(best)
        num_new = min(best.num_tokens - computed.num_tokens, self.config.max_num_batched_tokens)
        while self.running:
            full = (len(self.running) >= self.config.max_num_seqs
                    or self.kv.num_free_blocks_needed(best, num_new, computed) > self.kv.num_free_blocks)
            if not full:
                return
            worst = max(self.running, key=self._victim_rank)
            if self._victim_rank(best) >= self._victim_rank(worst):
                return
            self._preempt(worst, out)

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        request.num_preemptions += 1
        out.preempted_ids.append(request.request_id)
        pairs = self.kv.swap_out(request) if self._prefers_swap(request) else None
        if pairs is not None:
            request.status = RequestStatus.SWAPPED
            self.swapped.append(request)
            out.blocks_to_swap_out.extend(pairs)
            self.counters.num_preemptions_swap += 1
            self.counters.num_blocks_swapped_out += len(pairs)
            return
        self.kv.free(request)
        self.counters.num_preemptions_recompute += 1
        self.counters.num_recomputed_tokens += request.num_computed_tokens
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.add(request)

    def _prefers_swap(self, request: Request) -> bool:
        mode = self.config.preemption_mode
        if mode != "auto":
            return mode == "swap"
        num_blocks = self.kv.num_held_blocks(request)
        swap_s = 2 * num_blocks * self.costs.block_bytes / self.costs.swap_bytes_per_s
        shared = self.kv.num_shared_prefix_tokens(request)
        recompute_s = (request.num_computed_tokens - shared) / self.costs.recompute_tokens_per_s
        return swap_s < recompute_s

    # ---- after the forward ---------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, result: ModelRunnerOutput) -> SchedulerUpdate:
        """Advances computed tokens, appends sampled tokens, forks n > 1 requests after their
        first token, finishes requests that hit a stop condition. A request whose sampling or
        stop check failed fails with its whole group; the others go on."""
        now = self.clock()
        update = SchedulerUpdate()
        self.counters.num_spec_unfilled_steps += result.drafts_unfilled
        errors, prompt_logprobs, sampled, pooled = result.errors, result.prompt_logprobs, result.sampled, result.pooled
        for item in out.scheduled:
            request = item.request
            if request.status is not RequestStatus.RUNNING:
                continue
            error = errors.get(request.request_id) if errors else None
            if error is None:
                try:
                    if prompt_logprobs and request.request_id in prompt_logprobs:
                        request.record_prompt_logprobs(*prompt_logprobs[request.request_id])
                    if self._advance(request, item, sampled, pooled, now):
                        update.updated.append(request)
                except Exception as e:  # this request's fault only
                    error = e
            if error is not None:  # fail its group, free its blocks; the batch goes on
                update.failed[request.group_id] = error
                self.finish_group(request.group_id, FinishReason.ERROR)
        return update

    def _advance(self, request: Request, item: ScheduledRequest, sampled: dict[str, list[int]],
                 pooled: dict[str, list[float]], now: float) -> bool:
        """Applies one scheduled chunk to its request; True if it sampled a token (or, an embedding
        request, ended its prompt: it ends with its embedding). A speculating
        decode gets its accepted drafts and one more token, each stop-checked in turn; the KV of
        rejected drafts is dropped (computed tokens end at the last accepted one, and blocks that
        held only rejected positions are freed)."""
        request.num_computed_tokens += item.num_input_tokens
        if item.start_pos < request.num_prompt_tokens:  # a prompt chunk (a decode computes no prompt token)
            self.counters.num_prompt_tokens += max(0, min(request.num_computed_tokens, request.num_prompt_tokens)
                                                   - item.start_pos)
        self.kv.cache_full_blocks(request)
        if not item.sample:
            return False
        if request.pooling is not None:
            request.embedding = pooled[request.request_id]
            request.first_token_time = now
            self.finish_request(request.request_id, FinishReason.STOP)
            return True
        tokens = sampled[request.request_id]
        if item.draft_token_ids:
            self._observe_verification(request, len(item.draft_token_ids), len(tokens) - 1)
        if request.first_token_time is None:
            request.first_token_time = now
        for i, token in enumerate(tokens):
            if i > 0:  # the token before this one was an accepted draft: its KV is computed
                request.num_computed_tokens += 1
            request.append_token(token)
            self.counters.num_generation_tokens += 1
            if request.params.num_samples > 1 and request.sample_index == 0 and request.num_output_tokens == 1:
                self._fork(request)
            reason = self._stop_reason(request)
            if reason is not None:
                if request.beam:
                    self._park(request)
                else:
                    self.finish_request(request.request_id, reason)
                return True
        if self.speculative is not None:  # also the slots of drafts reserved but not proposed in the end
            self.kv.cache_full_blocks(request)
            self.kv.free_beyond(request, request.num_tokens)
        return True

    def _park(self, beam: Request) -> None:
        self.running.remove(beam)
        beam.status = RequestStatus.PARKED
        self.parked.append(beam)

    def _observe_verification(self, request: Request, num_proposed: int, num_accepted: int) -> None:
        self.counters.spec.add(num_proposed, num_accepted)
        request.spec.add(num_proposed, num_accepted)
        if self.adaptive is not None:
            self.adaptive.observe(request.request_id, num_proposed, num_accepted)

    def _fork(self, parent: Request) -> None:
        for index in range(1, parent.params.num_samples):
            child = parent.fork(index)
            self.kv.fork(parent, child)
            child.status = RequestStatus.RUNNING
            self._track(child)
            self.running.append(child)

    def _stop_reason(self, request: Request) -> FinishReason | None:
        last = request.token_ids[-1]
        params = request.params
        if (not params.ignore_eos and last in self.eos_token_ids) or last in params.stop_token_ids:
            request.ended_on_stop_token = True
            return FinishReason.STOP
        if request.constraint is not None and request.constraint.is_finished:
            return FinishReason.STOP
        if self._at_length(request):
            return FinishReason.LENGTH
        return None

    # ---- statistics ----------------------------------------------------------------------
    def make_stats(self, step: StepStats) -> EngineStats:
        """A snapshot of queues, KV use and counters, with the last step's figures."""
        c = self.counters
        return EngineStats(
            num_waiting=len(self.waiting), num_running=len(self.running), max_num_seqs=self.config.max_num_seqs,
            num_swapped=len(self.swapped),
            num_free_blocks=self.kv.num_free_blocks, num_total_blocks=self.kv.num_blocks, kv_usage=self.kv.usage,
            prefix_cache_hit_rate=c.num_prefix_hit_tokens / max(c.num_prefix_query_tokens, 1),
            batch_size=step.batch_size, batch_tokens=step.batch_tokens, step_latency_s=step.step_latency_s,
            scheduler_overhead_s=step.scheduler_overhead_s, num_steps=step.num_steps,
            num_decode_only_steps=step.num_decode_only_steps, decode_only_rows=step.decode_only_rows,
            decode_only_steps_s=step.decode_only_steps_s, mixed_steps_s=step.mixed_steps_s,
            num_steps_ahead=step.num_steps_ahead,
            num_queued_tokens=self.waiting.num_tokens,
            num_preemptions_swap=c.num_preemptions_swap, num_preemptions_recompute=c.num_preemptions_recompute,
            num_blocks_swapped_out=c.num_blocks_swapped_out, num_blocks_swapped_in=c.num_blocks_swapped_in,
            num_recomputed_tokens=c.num_recomputed_tokens, num_prompt_tokens=c.num_prompt_tokens,
            num_generation_tokens=c.num_generation_tokens, num_failed_requests=c.num_failed_requests,
            num_spec_proposed_tokens=c.spec.proposed, num_spec_accepted_tokens=c.spec.accepted,
            spec_acceptance_rate=c.spec.acceptance_rate, spec_mean_accepted_length=c.spec.mean_accepted_length,
            num_spec_unfilled_steps=c.num_spec_unfilled_steps)


def _samples_ahead(request: Request) -> bool:
    """Whether the request's next token can be sampled before the token before it reaches the
    host: its sampling reads nothing of its output but that token's place."""
    params = request.params
    return (not request.beam and request.pooling is None and request.constraint is None and not params.has_penalties
            and (not params.min_tokens or request.num_output_tokens >= params.min_tokens))
