"""Engine statistics: a snapshot after every step plus cumulative counters.

Owns the numbers, not their export (the serve app turns them into Prometheus metrics).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from engine.scheduler.output import SchedulerOutput
from engine.scheduler.scheduler import Scheduler


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_waiting: int
    num_running: int
    num_swapped: int
    num_free_blocks: int
    num_total_blocks: int
    kv_usage: float  # fraction of device blocks owned by requests
    prefix_cache_hit_rate: float  # cumulative: prompt tokens served from cache / prompt tokens looked up
    batch_size: int  # requests in the last step
    batch_tokens: int  # tokens in the last step
    step_latency_s: float  # last step, wall
    scheduler_overhead_s: float  # last step: schedule + update, wall
    num_steps: int
    num_queued_tokens: int  # prompt tokens of waiting requests
    num_preemptions_swap: int
    num_preemptions_recompute: int
    num_blocks_swapped_out: int
    num_blocks_swapped_in: int
    num_recomputed_tokens: int
    num_prompt_tokens: int
    num_generation_tokens: int

    def as_dict(self) -> dict:
        return asdict(self)


class StatsCollector:
    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.num_steps = 0
        self._last = (0, 0, 0.0, 0.0)  # batch size, batch tokens, step latency, scheduler overhead

    def record_step(self, out: SchedulerOutput, step_s: float, scheduler_s: float) -> None:
        self.num_steps += 1
        self._last = (len(out.scheduled), out.total_num_scheduled_tokens, step_s, scheduler_s)

    def snapshot(self) -> EngineStats:
        s, kv, c = self.scheduler, self.scheduler.kv, self.scheduler.counters
        waiting = s.waiting.requests()
        return EngineStats(
            num_waiting=len(waiting), num_running=len(s.running), num_swapped=len(s.swapped),
            num_free_blocks=kv.num_free_blocks, num_total_blocks=kv.pool.num_blocks, kv_usage=kv.usage,
            prefix_cache_hit_rate=c.num_prefix_hit_tokens / max(c.num_prefix_query_tokens, 1),
            batch_size=self._last[0], batch_tokens=self._last[1], step_latency_s=self._last[2],
            scheduler_overhead_s=self._last[3], num_steps=self.num_steps,
            num_queued_tokens=sum(r.num_tokens for r in waiting),
            num_preemptions_swap=c.num_preemptions_swap, num_preemptions_recompute=c.num_preemptions_recompute,
            num_blocks_swapped_out=c.num_blocks_swapped_out, num_blocks_swapped_in=c.num_blocks_swapped_in,
            num_recomputed_tokens=c.num_recomputed_tokens, num_prompt_tokens=c.num_prompt_tokens,
            num_generation_tokens=c.num_generation_tokens)
