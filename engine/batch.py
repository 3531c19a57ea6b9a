"""The step's batch as the model, the attention backends and the drafters see it: one flat ragged
batch of every scheduled token (built by engine/runner/inputs.py), the history each sampled
row continues, and the host tensors its lists become (index vectors, padded block tables). Data
types and those conversions only, low in the engine's layers, so attention can take them without
importing the runner, scheduler or speculation.
"""
from __future__ import annotations

import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeAlias

import torch

if TYPE_CHECKING:  # the rows' owners and the cache's groups, named in annotations only
    from engine.drafts import SampledDraft
    from engine.kv_cache.layout import KVLayout
    from engine.lora import LoraBatch
    from engine.request import OutputConstraint, Request
    from engine.sampling_params import SamplingParams


def host_tensor(values: list[int], dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A 1-D host tensor of Python ints through one array conversion: a third of torch.tensor's
    time on a list (the step's index vectors and block tables are built so every step)."""
    if not values:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(array.array(_TYPECODES[dtype], values), dtype=dtype)


def padded_rows(rows: list[list[int]], fill: int, dtype: torch.dtype = torch.long, width: int | None = None
                ) -> torch.Tensor:
    """`rows` (block tables) as one (len(rows), width) host tensor, each row cut or padded with
    `fill` to `width` (default: the longest row's)."""
    longest = max(map(len, rows))
    width = longest if width is None else width
    if longest > width:
        rows = [row[:width] for row in rows]
    flat = [fill] * (len(rows) * width)
    for start, row in zip(range(0, len(flat), width), rows):
        flat[start:start + len(row)] = row
    return host_tensor(flat, dtype).view(len(rows), width)


_TYPECODES = {torch.int32: "i", torch.long: "q"}


@dataclass(slots=True)
class GroupTables:
    """One KV group's view of the step (engine/kv_cache/layout.py): where its layers write each
    token's keys and values, and what each sequence's queries read."""
    window: int | None  # the group's sliding window (None: full attention)
    slot_mapping: torch.Tensor  # (T,) KV slot (block_id * block_size + offset) each token writes
    block_tables: list[list[int]]  # (B, *) the group's blocks of each sequence's request (NULL_BLOCK: dropped)


@dataclass(slots=True)
class ModelInputs:
    input_ids: torch.Tensor  # (T,) token ids of every scheduled token, request after request
    positions: torch.Tensor  # (T,) position of each token in its request
    kv_groups: list[GroupTables]  # per KV group: its slots and block tables
    query_start_loc: list[int]  # (B + 1,) token offsets of each sequence (a request or a row) in the batch
    seq_lens: list[int]  # (B,) context length of each sequence after this step
    start_positions: list[int]  # (B,) tokens already cached before this step
    num_decodes: int  # the first num_decodes sequences have exactly one query token
    block_size: int
    sample_indices: torch.Tensor  # (R,) flat index of each token whose logits are sampled
    sampled_requests: list[Request | WithDrafts]  # (R,) whose history each row continues
    sampled_drafts: list[SampledDraft | None]  # (R,) the sampled draft each row verifies, if any
    verified: list[tuple[Request, list[int], int]]  # (request, drafts, first row) of each request sampled
    # prompt logprobs: flat index of each prompt token whose logits are scored, and per request
    # (request, first position scored, number of positions)
    scored_indices: list[int] = field(default_factory=list)
    scored_prompts: list[tuple[Request, int, int]] = field(default_factory=list)
    # embeddings: flat index of each token whose final hidden state is pooled, and per request
    # (request, its first entry in pooled_indices, number of entries, the chunk's first position, whether its
    # prompt ends here)
    pooled_indices: list[int] = field(default_factory=list)
    pooled: list[tuple[Request, int, int, int, bool]] = field(default_factory=list)
    lora: LoraBatch | None = None  # the rows' LoRA adapters, where any row has one

    @classmethod
    def one_sequence(cls, token_ids: torch.Tensor, start: int, num_blocks: int, block_size: int,
                     sample_indices: torch.Tensor, layout: KVLayout) -> ModelInputs:
        """A chunk of one sequence, its tokens at positions start.., over a scratch cache of
        layout.num_groups * num_blocks blocks where group g's blocks g * num_blocks.. hold it in
        order (KVLayout.scratch_tables): quality scoring, the serving mix's timings and the GPU
        memory profile run the model so, outside the scheduler."""
        n = token_ids.shape[0]
        positions = torch.arange(start, start + n, device=token_ids.device)
        groups = [GroupTables(window, positions + table[0] * block_size, [table])
                  for window, table in zip(layout.windows, layout.scratch_tables(num_blocks))]
        return cls(token_ids, positions, groups, [0, n], [start + n], [start], 0, block_size, sample_indices, [], [],
                   [])


class WithDrafts:
    """A request as seen at a draft position: its tokens followed by the drafts before it. Reads
    like the request for the sampler (params, ids, token history)."""
    __slots__ = ("request", "drafts")

    def __init__(self, request: Request, drafts: list[int]):
        self.request, self.drafts = request, drafts

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def sample_index(self) -> int:
        return self.request.sample_index

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def constraint(self) -> OutputConstraint | None:
        return self.request.constraint

    @property
    def token_ids(self) -> list[int]:
        return self.request.token_ids + self.drafts

    @property
    def output_token_ids(self) -> list[int]:
        return self.request.output_token_ids + self.drafts


if TYPE_CHECKING:
    SampledRow: TypeAlias = "Request | WithDrafts"  # a row the sampler samples: a request, or one at a draft
