"""Engine statistics: a snapshot after every step plus cumulative counters.

Owns the numbers, not their export (the serve app turns them into Prometheus metrics). The
scheduler fills a snapshot (`Scheduler.make_stats`) from what it owns and the step's figures.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class ModelReport:
    """How the loaded model computes, fixed at start-up; the serve app exports it (the labels of
    cbserve_engine_info, the cbserve_model_* gauges)."""
    quantization: str  # the mode it runs (`auto` resolved)
    dtype: str
    kv_cache_dtype: str
    device: str
    weight_bytes_per_token: int  # matmul weights one decode step reads
    top1_agreement: float | None = None  # against fp32 (engine/quality.py), 1 for fp32; None: not measured
    perplexity_increase: float | None = None


@dataclass(frozen=True, slots=True)
class StepStats:
    """The latest step's figures, kept by the engine that timed it."""
    batch_size: int = 0  # requests in the step
    batch_tokens: int = 0  # tokens in the step
    step_latency_s: float = 0.0  # wall
    scheduler_overhead_s: float = 0.0  # schedule + update, wall
    num_steps: int = 0  # steps so far


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_waiting: int
    num_running: int
    max_num_seqs: int  # the most requests a step runs (the batch's slots)
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
    num_queued_tokens: int  # tokens of waiting requests
    num_preemptions_swap: int
    num_preemptions_recompute: int
    num_blocks_swapped_out: int
    num_blocks_swapped_in: int
    num_recomputed_tokens: int
    num_prompt_tokens: int
    num_generation_tokens: int
    num_failed_requests: int  # requests that failed while running (their batch-mates went on)
    num_spec_proposed_tokens: int = 0  # draft tokens verified
    num_spec_accepted_tokens: int = 0  # of which the target agreed with
    spec_acceptance_rate: float = 0.0  # accepted / proposed, cumulative
    spec_mean_accepted_length: float = 0.0  # accepted drafts per request-step that verified any
    num_spec_unfilled_steps: int = 0  # steps whose reserved drafts a draft model did not fill (late, down, no room)

    def as_dict(self) -> dict:
        return asdict(self)
