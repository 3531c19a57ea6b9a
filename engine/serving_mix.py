"""The serving mix `auto` times its candidate modes on: the kinds of step a CPU server spends its
time in, each run as the engine runs it (a ragged batch through the engine's attention backend,
its KV cache dtype and, for decode-only steps, the quantized modes' whole-stack decode kernel).

A mode's figure is its time over fp32's on each step, weighted by the share of fp32's serving time
such steps take: half for a lone stream (one decode row a step), half for a saturated server
(decode steps of a few and of many rows, and prefill chunks, in the shares the 64-request
workload spends them: BENCHMARKS.md, "Fast by default"). Two summaries come with it: the lone
stream's ratio and the saturated server's, by which no chosen mode may lose to another on both.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from torch import nn

from engine.attention.base import scratch_cache
from engine.attention.selector import select_backend
from engine.batch import GroupTables, ModelInputs

BLOCK_SIZE = 16
DECODE_CONTEXT = 64  # tokens each decode row attends to
PREFILL_CHUNK = 256  # tokens of one prefill chunk (at most the model's length)
REPEATS = 5


@dataclass(frozen=True)
class MixStep:
    name: str
    num_decode_rows: int  # single-token rows, each its own request
    num_prefill_tokens: int  # one request's prompt chunk
    single_stream_weight: float  # share of a lone stream's time in such steps
    saturated_weight: float  # share of a saturated server's time in such steps

    @property
    def weight(self) -> float:
        return (self.single_stream_weight + self.saturated_weight) / 2


SERVING_MIX = (
    MixStep("decode 1 row", 1, 0, 1.0, 0.04),
    MixStep("decode 8 rows", 8, 0, 0.0, 0.16),
    MixStep("decode 32 rows", 32, 0, 0.0, 0.34),
    MixStep("prefill chunk", 0, PREFILL_CHUNK, 0.0, 0.46),
)


@dataclass(frozen=True)
class MixTiming:
    """A mode's step times over fp32's, by SERVING_MIX step name."""
    ratios: dict[str, float]

    def _weighted(self, weight) -> float:
        steps = [(weight(s), self.ratios[s.name]) for s in SERVING_MIX]
        return sum(w * r for w, r in steps) / sum(w for w, _ in steps)

    @property
    def mix(self) -> float:
        return self._weighted(lambda s: s.weight)

    @property
    def single_stream(self) -> float:
        return self._weighted(lambda s: s.single_stream_weight)

    @property
    def saturated(self) -> float:
        return self._weighted(lambda s: s.saturated_weight)

    def beaten_on_both_by(self, other: MixTiming) -> bool:
        return other.single_stream < self.single_stream and other.saturated < self.saturated

    def __str__(self) -> str:
        return (f"serving mix {self.mix:.2f}x fp32 (single stream {self.single_stream:.2f}x, saturated "
                f"{self.saturated:.2f}x; " + ", ".join(f"{k} {v:.2f}x" for k, v in self.ratios.items()) + ")")


class _StepRunner:
    """Runs one SERVING_MIX step on a model over a scratch paged KV cache."""

    def __init__(self, model: nn.Module, kv_cache_dtype: torch.dtype, max_model_len: int):
        self.model = model
        self.context = min(DECODE_CONTEXT, max_model_len - 1)
        self.chunk = min(PREFILL_CHUNK, max_model_len)
        blocks_per_row = -(-(self.context + 1) // BLOCK_SIZE)
        num_rows = max(s.num_decode_rows for s in SERVING_MIX)
        self.num_blocks = max(num_rows * blocks_per_row, -(-self.chunk // BLOCK_SIZE))
        self.blocks_per_row = blocks_per_row
        cpu = torch.device("cpu")
        self.backend = select_backend("auto", cpu, torch.float32, model.attention)
        self.kv_cache = scratch_cache(self.backend, model, self.num_blocks, BLOCK_SIZE, kv_cache_dtype, cpu)

    def inputs(self, step: MixStep) -> ModelInputs:
        layout = self.model.kv_layout
        if step.num_prefill_tokens:
            n = self.chunk
            return ModelInputs.one_sequence(torch.zeros(n, dtype=torch.long), 0, self.num_blocks, BLOCK_SIZE,
                                            torch.tensor([n - 1]), layout)
        rows, ctx = step.num_decode_rows, self.context
        groups = []
        for g, window in enumerate(layout.windows):  # group g's rows in its own part of the scratch pool
            first = g * self.num_blocks
            tables = [list(range(first + r * self.blocks_per_row, first + (r + 1) * self.blocks_per_row))
                      for r in range(rows)]
            slots = torch.tensor([t[ctx // BLOCK_SIZE] * BLOCK_SIZE + ctx % BLOCK_SIZE for t in tables])
            groups.append(GroupTables(window, slots, tables))
        return ModelInputs(torch.zeros(rows, dtype=torch.long), torch.full((rows,), ctx), groups,
                           list(range(rows + 1)), [ctx + 1] * rows, [ctx] * rows, rows, BLOCK_SIZE,
                           torch.arange(rows), [], [], [])

    @torch.inference_mode()
    def __call__(self, inputs: ModelInputs) -> None:
        self.model(inputs.input_ids, inputs.positions, self.kv_cache, self.backend,
                   self.backend.build_metadata(inputs), inputs.sample_indices)


def time_mix(model: nn.Module, fp32_model: nn.Module, kv_cache_dtype: torch.dtype, max_model_len: int) -> MixTiming:
    """`model`'s time over `fp32_model`'s (fp32 weights and cache) on each step of the mix: the
    median over REPEATS, the two run alternately so that the machine's drift hits both alike."""
    runs = (_StepRunner(model, kv_cache_dtype, max_model_len), _StepRunner(fp32_model, torch.float32, max_model_len))
    ratios = {}
    for step in SERVING_MIX:
        inputs = runs[0].inputs(step)
        for run in runs:
            run(inputs)  # warm-up
        samples = []
        for _ in range(REPEATS):
            seconds = []
            for run in runs:
                start = time.perf_counter()
                run(inputs)
                seconds.append(time.perf_counter() - start)
            samples.append(seconds[0] / seconds[1])
        ratios[step.name] = statistics.median(samples)
    return MixTiming(ratios)
