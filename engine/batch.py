"""The step's batch as the model, the attention backends and the drafters see it: one flat ragged
batch of every scheduled token (built by engine/runner/inputs.py). A data type only, low in the
engine's layers, so attention can take it without importing the runner, scheduler or speculation.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the rows' owners, named in annotations only
    from engine.request import Request
    from engine.spec_decode.messages import SampledDraft
    from engine.spec_decode.verify import WithDrafts


@dataclass(slots=True)
class ModelInputs:
    input_ids: torch.Tensor  # (T,) token ids of every scheduled token, request after request
    positions: torch.Tensor  # (T,) position of each token in its request
    slot_mapping: torch.Tensor  # (T,) KV slot (block_id * block_size + offset) each token writes
    query_start_loc: list[int]  # (B + 1,) token offsets of each sequence (a request or a row) in the batch
    seq_lens: list[int]  # (B,) context length of each sequence after this step
    start_positions: list[int]  # (B,) tokens already cached before this step
    block_tables: list[list[int]]  # (B, *) blocks of each sequence's request
    num_decodes: int  # the first num_decodes sequences have exactly one query token
    block_size: int
    sample_indices: torch.Tensor  # (R,) flat index of each token whose logits are sampled
    sampled_requests: list[Request | WithDrafts]  # (R,) whose history each row continues
    sampled_drafts: list[SampledDraft | None]  # (R,) the sampled draft each row verifies, if any
    verified: list[tuple[Request, list[int], int]]  # (request, drafts, first row) of each request sampled
