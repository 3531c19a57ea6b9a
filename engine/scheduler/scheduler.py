"""Iteration-level scheduler: which requests run this step and how many tokens each.

There are no prefill or decode phases: every request has `num_tokens` and `num_computed_tokens`,
and each step hands out tokens under one budget (`max_num_batched_tokens`, `max_num_seqs`), so
prefill chunks and decodes share one ragged batch. Owns admission order, preemption (swap or
recompute) and finishing; owns no tensors. Block bookkeeping is the KVCacheManager's.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from engine.config import SchedulerConfig
from engine.kv_cache.manager import KVCacheManager
from engine.request import FinishReason, Request, RequestStatus
from engine.scheduler.output import ScheduledRequest, SchedulerOutput
from engine.scheduler.queue import WaitingQueue


@dataclass(slots=True)
class SchedulerCounters:
    """Cumulative counts since start (metrics read them)."""
    num_preemptions_swap: int = 0
    num_preemptions_recompute: int = 0
    num_blocks_swapped_out: int = 0
    num_blocks_swapped_in: int = 0
    num_recomputed_tokens: int = 0  # computed tokens thrown away by recompute preemption
    num_prefix_query_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    num_prompt_tokens: int = 0  # prompt tokens computed (prefix-cache hits excluded)
    num_generation_tokens: int = 0


@dataclass(frozen=True, slots=True)
class PreemptionCosts:
    """What `auto` preemption weighs: moving KV out and back vs recomputing it."""
    block_bytes: int = 0  # KV bytes of one block across all layers
    swap_bytes_per_s: float = 5e9
    recompute_tokens_per_s: float = 400.0


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 eos_token_ids: frozenset[int] = frozenset(), costs: PreemptionCosts = PreemptionCosts()):
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.costs = costs
        self.waiting = WaitingQueue(config.policy, config.aging_rate)
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.counters = SchedulerCounters()
        self._static_batch_open = True

    # ---- requests in and out -------------------------------------------------------------
    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raises ValueError for a request that could never be scheduled. Changes nothing."""
        max_len = min(num_prompt_tokens + max_tokens, self.max_model_len)
        if self.kv.num_blocks_for(max_len) > self.kv.pool.num_blocks:
            raise ValueError(f"prompt + max_tokens needs {self.kv.num_blocks_for(max_len)} KV blocks "
                             f"({max_len} tokens); the KV cache has {self.kv.pool.num_blocks}")
        if not self.config.enable_chunked_prefill and num_prompt_tokens > self.config.max_num_batched_tokens:
            raise ValueError(f"prompt has {num_prompt_tokens} tokens, over max_num_batched_tokens "
                             f"{self.config.max_num_batched_tokens} with chunked prefill off")

    def add_request(self, request: Request) -> None:
        """Queues a request. Raises ValueError if it could never fit (see check_fits)."""
        self.check_fits(request.num_prompt_tokens, request.params.max_tokens)
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_request(self, request_id: str, reason: FinishReason) -> Request | None:
        """Ends a request wherever it is and frees its blocks at once; None if unknown."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.SWAPPED:
            self.swapped.remove(request)
        else:
            self.waiting.remove(request_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finished_time = time.monotonic()
        self.kv.free(request)
        self.kv.forget(request)
        if not self.running and not self.swapped:
            self._static_batch_open = True
        return request

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        now = time.monotonic()
        out = SchedulerOutput()
        if self.config.policy == "priority":
            self._preempt_for_priority(out, now)
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        budget = self._schedule_swapped(out, budget, now)
        if self.config.policy != "static" or self._static_batch_open:
            self._schedule_waiting(out, budget, now)
        if self.config.policy == "static" and self.running and (
                len(self.running) >= self.config.max_num_seqs or not self.waiting):
            self._static_batch_open = False
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        queue = sorted(self.running, key=self._victim_rank)  # best first; victims come from the tail
        while queue and budget > 0:
            request = queue.pop(0)
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            copies = self.kv.allocate_slots(request, num_new)
            while copies is None and queue:
                self._preempt(queue.pop(), out)
                copies = self.kv.allocate_slots(request, num_new)
            if copies is None:
                self._preempt(request, out)
                continue
            self._add_scheduled(out, request, num_new, copies)
            budget -= num_new
        return budget

    def _schedule_swapped(self, out: SchedulerOutput, budget: int, now: float) -> int:
        """Swaps requests back in, best first, ahead of new admissions; never one preempted this
        step, nor (under `priority`) one that ranks below the best waiting request."""
        if not self.swapped:
            return budget
        preempted = set(out.preempted_ids)
        best_waiting = next(self.waiting.ordered(now), None) if self.config.policy == "priority" else None
        for request in sorted(self.swapped, key=self._victim_rank):
            if request.request_id in preempted:
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if (num_new == 0 or len(self.running) >= self.config.max_num_seqs
                    or self.kv.num_blocks_for(request.num_computed_tokens + num_new) > self.kv.num_free_blocks
                    or (best_waiting is not None
                        and self.waiting.rank(best_waiting, now) < self._victim_rank(request))):
                break
            pairs = self.kv.swap_in(request)
            self.swapped.remove(request)
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            out.blocks_to_swap_in.extend(pairs)
            self.counters.num_blocks_swapped_in += len(pairs)
            self._add_scheduled(out, request, num_new, self.kv.allocate_slots(request, num_new))
            budget -= num_new
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, now: float) -> None:
        for request in self.waiting.ordered(now):
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                return
            computed = self.kv.get_computed_blocks(request)
            remaining = request.num_tokens - computed.num_tokens
            num_new = min(remaining, budget)
            if not self.config.enable_chunked_prefill and num_new < remaining:
                return
            copies = self.kv.allocate_slots(request, num_new, computed)
            if copies is None:
                return  # no head-of-line bypass: lower ranks wait behind this one
            self.waiting.remove(request.request_id)
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

    def _add_scheduled(self, out: SchedulerOutput, request: Request, num_new: int,
                       copies: list[tuple[int, int]]) -> None:
        start = request.num_computed_tokens
        out.blocks_to_copy.extend(copies)
        out.scheduled.append(ScheduledRequest(
            request=request,
            token_ids=request.token_ids[start:start + num_new],
            start_pos=start,
            block_table=list(self.kv.block_table(request.request_id)),
            sample=start + num_new == request.num_tokens,
        ))

    # ---- preemption ----------------------------------------------------------------------
    def _victim_rank(self, request: Request) -> tuple[float, float]:
        """Lower is better; preemption takes the highest. Under `priority` this is the aged rank
        of the waiting queue, so a waiting request and a running one compare on one scale."""
        if self.config.policy == "priority":
            return self.waiting.rank(request, time.monotonic())
        if self.config.victim_order == "latest_arrival":
            return (0.0, request.arrival_time)
        return (float(request.priority), request.arrival_time)

    def _preempt_for_priority(self, out: SchedulerOutput, now: float) -> None:
        """Displaces running requests of strictly worse rank while the best waiting request finds
        the batch or the KV cache full. Never preempts to admit a request of lower rank."""
        for best in self.waiting.ordered(now):
            computed = self.kv.get_computed_blocks(best)
            num_new = min(best.num_tokens - computed.num_tokens, self.config.max_num_batched_tokens)
            while self.running:
                worst = max(self.running, key=self._victim_rank)
                full = (len(self.running) >= self.config.max_num_seqs
                        or self.kv.num_free_blocks_needed(best, num_new, computed) > self.kv.num_free_blocks)
                if not full or self.waiting.rank(best, now) >= self._victim_rank(worst):
                    return
                self._preempt(worst, out)
            return

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
        num_blocks = len(self.kv.block_table(request.request_id))
        swap_s = 2 * num_blocks * self.costs.block_bytes / self.costs.swap_bytes_per_s
        shared = self.kv.num_shared_prefix_tokens(request)
        recompute_s = (request.num_computed_tokens - shared) / self.costs.recompute_tokens_per_s
        return swap_s < recompute_s

    # ---- after the forward ---------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advances computed tokens, appends sampled tokens, forks n > 1 requests after their
        first token, finishes requests that hit a stop condition. Returns the requests that got a
        token this step (finished ones included, with status FINISHED)."""
        now = time.monotonic()
        updated = []
        for item in out.scheduled:
            request = item.request
            if request.status is not RequestStatus.RUNNING:
                continue
            request.num_computed_tokens += len(item.token_ids)
            self.counters.num_prompt_tokens += max(
                0, min(request.num_computed_tokens, request.num_prompt_tokens) - item.start_pos)
            self.kv.cache_full_blocks(request)
            if not item.sample:
                continue
            request.append_token(sampled[request.request_id])
            self.counters.num_generation_tokens += 1
            if request.first_token_time is None:
                request.first_token_time = now
            if request.params.n > 1 and request.sample_index == 0 and request.num_output_tokens == 1:
                self._fork(request)
            reason = self._stop_reason(request)
            if reason is not None:
                self.finish_request(request.request_id, reason)
            updated.append(request)
        return updated

    def _fork(self, parent: Request) -> None:
        for index in range(1, parent.params.n):
            child = parent.fork(index)
            self.kv.fork(parent, child)
            child.status = RequestStatus.RUNNING
            self.requests[child.request_id] = child
            self.running.append(child)

    def _stop_reason(self, request: Request) -> FinishReason | None:
        last = request.token_ids[-1]
        params = request.params
        if (not params.ignore_eos and last in self.eos_token_ids) or last in params.stop_token_ids:
            return FinishReason.STOP
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None
