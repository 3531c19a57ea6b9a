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
    architecture: str  # the checkpoint's transformers class (LlamaForCausalLM, ...)
    model_path: str  # "native" (a family of engine/models/families.py) or "transformers" (its own modeling code)
    top1_agreement: float | None = None  # against fp32 (engine/quality.py), 1 for fp32; None: not measured
    perplexity_increase: float | None = None


@dataclass(frozen=True, slots=True)
class StepStats:
    """The latest step's figures, and the steps' so far, kept by the engine that timed them.

    A decode-only step computes one token a request: no prefill chunk, no drafts. On CUDA such
    steps run in its decode graphs and a step with a prefill chunk runs eagerly, so where a served
    engine's time goes against an offline one's shows in the two kinds' counts and times, in
    the rows its decode-only steps carried, and in how many steps ran ahead (async scheduling:
    only a steady batch of decodes does, and an arrival stops it)."""
    batch_size: int = 0  # requests in the step
    batch_tokens: int = 0  # tokens in the step
    step_latency_s: float = 0.0  # wall
    scheduler_overhead_s: float = 0.0  # schedule + update, wall
    num_steps: int = 0  # steps so far
    num_decode_only_steps: int = 0  # of them, decode-only
    decode_only_rows: int = 0  # their requests, summed
    decode_only_steps_s: float = 0.0  # their wall time
    mixed_steps_s: float = 0.0  # the other steps' wall time
    num_steps_ahead: int = 0  # steps launched before the step before them was collected

    def after(self, batch_size: int, batch_tokens: int, step_latency_s: float,
              scheduler_overhead_s: float, launched_next: bool = False) -> StepStats:
        """These figures once one more step has run; `launched_next`: it launched the next one ahead."""
        decode_only = batch_tokens == batch_size  # each request computes at least one token
        return StepStats(batch_size, batch_tokens, step_latency_s, scheduler_overhead_s, self.num_steps + 1,
                         self.num_decode_only_steps + decode_only,
                         self.decode_only_rows + batch_size * decode_only,
                         self.decode_only_steps_s + step_latency_s * decode_only,
                         self.mixed_steps_s + step_latency_s * (not decode_only),
                         self.num_steps_ahead + launched_next)


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
    num_decode_only_steps: int  # of them, steps that computed one token a request (StepStats)
    decode_only_rows: int  # their requests, summed, cumulative
    decode_only_steps_s: float  # their wall time, cumulative
    mixed_steps_s: float  # the other steps' (a prefill chunk or drafts in them), cumulative
    num_steps_ahead: int  # steps launched before the step before them was collected (async scheduling)
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
    lora_adapters: tuple[str, ...] = ()  # LoRA adapters loaded now, least recently used first
    num_lora_loads: int = 0  # adapters read and installed, cumulative
    num_lora_evictions: int = 0
    lora_load_seconds: float = 0.0  # their reads' time, cumulative

    def as_dict(self) -> dict:
        return asdict(self)
