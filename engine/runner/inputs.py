"""Builds the one flat ragged batch of a step from the scheduled requests (no padding).

Layout: single-token queries (decodes) first, sorted by context length so backends can cut them
into dense buckets of similar length; then prefill chunks and speculating decodes (a request's
last token and its drafts: a short chunk). Owns no model state.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.request import Request
from engine.scheduler.output import ScheduledRequest
from engine.spec_decode.verify import WithDrafts


@dataclass(slots=True)
class ModelInputs:
    input_ids: torch.Tensor  # (T,) token ids of every scheduled token, request after request
    positions: torch.Tensor  # (T,) position of each token in its request
    slot_mapping: torch.Tensor  # (T,) KV slot (block_id * block_size + offset) each token writes
    query_start_loc: list[int]  # (B + 1,) token offsets of each request in the flat batch
    seq_lens: list[int]  # (B,) context length of each request after this step
    start_positions: list[int]  # (B,) tokens already cached before this step
    block_tables: list[list[int]]  # (B, *) blocks of each request
    num_decodes: int  # the first num_decodes requests have exactly one query token
    block_size: int
    sample_indices: torch.Tensor  # (R,) flat index of each token whose logits are sampled
    sampled_requests: list[Request | WithDrafts]  # (R,) whose history each row continues
    verified: list[tuple[Request, list[int], int]]  # (request, drafts, first row) of each request sampled


def build_inputs(scheduled: list[ScheduledRequest], block_size: int, device: torch.device) -> ModelInputs:
    ordered = sorted(scheduled, key=lambda s: (len(s.token_ids) > 1, s.start_pos if len(s.token_ids) == 1 else 0))
    input_ids, positions, slots, starts, seq_lens, tables = [], [], [], [], [], []
    query_start_loc, sample_indices, sampled_requests, verified = [0], [], [], []
    for item in ordered:
        n, start = len(item.token_ids), item.start_pos
        input_ids.extend(item.token_ids)
        positions.extend(range(start, start + n))
        table = item.block_table
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, start + n))
        starts.append(start)
        seq_lens.append(start + n)
        tables.append(table)
        query_start_loc.append(query_start_loc[-1] + n)
        if item.sample:  # the last token's logits, and each draft's: the target's token after it
            drafts = item.draft_token_ids
            verified.append((item.request, drafts, len(sample_indices)))
            sample_indices.extend(range(query_start_loc[-1] - 1 - len(drafts), query_start_loc[-1]))
            sampled_requests.append(item.request)
            sampled_requests.extend(WithDrafts(item.request, drafts[:j]) for j in range(1, len(drafts) + 1))

    def as_tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    return ModelInputs(
        input_ids=as_tensor(input_ids),
        positions=as_tensor(positions),
        slot_mapping=as_tensor(slots),
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        start_positions=starts,
        block_tables=tables,
        num_decodes=sum(1 for s in ordered if len(s.token_ids) == 1),
        block_size=block_size,
        sample_indices=as_tensor(sample_indices),
        sampled_requests=sampled_requests,
        verified=verified,
    )
