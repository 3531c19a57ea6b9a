"""Builds the one flat ragged batch of a step from the scheduled requests (no padding).

Layout: single-token queries (decodes) first, sorted by context length so backends can cut them
into dense buckets of similar length; then prefill chunks. A speculating decode (a request's last
token and its k drafts) is k + 1 single-token rows over the same block table, each with its own
context length, so each draft sees exactly the tokens before it and verification runs on the
decode path (no per-request attention call, whatever the batch). Owns no model state.
"""
from __future__ import annotations

from operator import attrgetter

import torch

from engine.batch import GroupTables, ModelInputs, WithDrafts, host_tensor
from engine.drafts import SampledDraft
from engine.lora import LoraBatch
from engine.request import Request
from engine.scheduler.output import ScheduledRequest

_START_POS = attrgetter("start_pos")


def _as_rows(item: ScheduledRequest) -> bool:
    """One query token, or a decode's last token with its drafts: single-token rows."""
    return len(item.token_ids) == 1 or bool(item.draft_token_ids)


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """A long tensor on `device`. On CUDA through pinned memory: a copy from pageable memory waits
    for the work already queued on the stream, which would end the overlap of async scheduling."""
    host = host_tensor(values)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host


def _ordered(scheduled: list[ScheduledRequest]) -> list[ScheduledRequest]:
    """Rows first, by context length; then prefill chunks, in the order scheduled."""
    rows: list[ScheduledRequest] = []
    chunks: list[ScheduledRequest] = []
    for item in scheduled:
        (rows if _as_rows(item) else chunks).append(item)
    rows.sort(key=_START_POS)
    return rows + chunks


def build_inputs(scheduled: list[ScheduledRequest], block_size: int, device: torch.device,
                 windows: tuple[int | None, ...]) -> ModelInputs:
    """`windows`: the model's KV groups' (KVLayout.windows), one table per group in each item."""
    ordered = _ordered(scheduled)
    num_groups = len(windows)
    input_ids: list[int] = []
    positions: list[int] = []
    starts: list[int] = []
    seq_lens: list[int] = []
    slots: list[list[int]] = [[] for _ in range(num_groups)]
    tables: list[list[list[int]]] = [[] for _ in range(num_groups)]
    query_start_loc = [0]
    sample_indices: list[int] = []
    sampled_requests: list[Request | WithDrafts] = []
    sampled_drafts: list[SampledDraft | None] = []
    verified: list[tuple[Request, list[int], int]] = []
    scored_indices: list[int] = []
    scored_prompts: list[tuple[Request, int, int]] = []
    pooled_indices: list[int] = []
    pooled: list[tuple[Request, int, int, int, bool]] = []
    num_decodes = 0
    for item in ordered:
        n, start = len(item.token_ids), item.start_pos
        if n == 1:  # one row: most of a step's items, so spelled out
            input_ids.append(item.token_ids[0])
            positions.append(start)
            for g, table in enumerate(item.block_tables):
                slots[g].append(table[start // block_size] * block_size + start % block_size)
                tables[g].append(table)
            starts.append(start)
            seq_lens.append(start + 1)
            query_start_loc.append(query_start_loc[-1] + 1)
            num_decodes += 1
        else:
            input_ids.extend(item.token_ids)
            positions.extend(range(start, start + n))
            for g, table in enumerate(item.block_tables):
                slots[g].extend(table[p // block_size] * block_size + p % block_size for p in range(start, start + n))
            as_rows = _as_rows(item)
            sequences = [(p, p + 1) for p in range(start, start + n)] if as_rows else [(start, start + n)]
            for first, end in sequences:
                starts.append(first)
                seq_lens.append(end)
                for g, table in enumerate(item.block_tables):
                    tables[g].append(table)
                query_start_loc.append(query_start_loc[-1] + end - first)
            num_decodes += len(sequences) if as_rows else 0
        unscored = item.request.first_unscored_position
        if unscored is not None and unscored < start + n:  # prompt logprobs: positions up to the last but one
            first, end = max(unscored, start), min(start + n, item.request.num_prompt_tokens - 1)
            if first < end:
                row0 = query_start_loc[-1] - n - start
                scored_indices.extend(range(row0 + first, row0 + end))
                scored_prompts.append((item.request, first, end - first))
        pooling = item.request.pooling
        if pooling is not None:  # an embedding request: hidden states pooled, nothing sampled
            end = query_start_loc[-1]
            mean = pooling.pooling == "mean"
            pooled_rows = range(end - n, end) if mean else range(end - 1, end) if item.sample else range(0)
            if pooled_rows:
                pooled.append((item.request, len(pooled_indices), len(pooled_rows), start, item.sample))
                pooled_indices.extend(pooled_rows)
        elif item.sample:  # the last token's logits, and each draft's: the target's token after it
            drafts = item.draft_token_ids
            verified.append((item.request, drafts, len(sample_indices)))
            sampled_requests.append(item.request)
            if not drafts:
                sample_indices.append(query_start_loc[-1] - 1)
            else:
                sample_indices.extend(range(query_start_loc[-1] - 1 - len(drafts), query_start_loc[-1]))
                sampled_requests.extend(WithDrafts(item.request, drafts[:j]) for j in range(1, len(drafts) + 1))
                sampled_drafts.extend(item.sampled_drafts or [None] * len(drafts))
            sampled_drafts.append(None)  # the bonus token's row

    num_tokens = len(input_ids)
    lora = None
    if any(item.request.adapter is not None for item in ordered):
        lora = LoraBatch.of([item.request.adapter for item in ordered
                             for _ in range(len(item.token_ids))])
    packed = to_device(input_ids + positions + [s for group in slots for s in group] + sample_indices, device)
    after_slots = (2 + num_groups) * num_tokens  # the index vectors in one copy: ids, positions, slots, samples
    return ModelInputs(
        input_ids=packed[:num_tokens],
        positions=packed[num_tokens:2 * num_tokens],
        kv_groups=[GroupTables(window, packed[(2 + g) * num_tokens:(3 + g) * num_tokens], tables[g])
                   for g, window in enumerate(windows)],
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        start_positions=starts,
        num_decodes=num_decodes,
        block_size=block_size,
        sample_indices=packed[after_slots:],
        sampled_requests=sampled_requests,
        sampled_drafts=sampled_drafts,
        verified=verified,
        scored_indices=scored_indices,
        scored_prompts=scored_prompts,
        pooled_indices=pooled_indices,
        pooled=pooled,
        lora=lora,
    )
