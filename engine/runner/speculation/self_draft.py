"""Self-drafting: the target's own first layers, with its final norm and LM head, are the draft
model. No second model and no second KV cache: for tokens the target has computed, the draft's
keys and values in those layers are the target's own, already in the paged cache. A draft pass
writes its layers' KV at the draft positions, slots the scheduler reserved for them; the target's
verifying forward rewrites the same slots (identical values for the same tokens in the same
layers), and slots past the last accepted token are rolled back with the rest of the rejected
positions (computed tokens end there, blocks holding only them are freed).

The scheduler reserves the drafts (engine/scheduler/speculation/pending.py: how many, per request,
adaptive or not); the runner fills them in (SelfDraft) before the target's forward, k one-token passes for the whole
batch of speculating requests. Drafts are the draft model's argmax (a one-hot draft distribution)
for greedy and seeded requests, else drawn from the draft's own sampling distribution
(engine.sampler.sample_drafts), which verification accepts with probability min(1, p/q).
"""
from __future__ import annotations

import torch

from engine.drafts import SampledDraft
from engine.runner.inputs import build_inputs
from engine.sampler import draft_params, sample_drafts
from engine.scheduler.output import ScheduledRequest


def self_draft_layers(num_layers: int | None, num_target_layers: int) -> int:
    """How many of the target's first layers draft: `num_layers`, by default a quarter of them."""
    num_layers = num_layers or max(num_target_layers // 4, 1)
    if not 1 <= num_layers <= num_target_layers:
        raise ValueError(f"self_draft num_layers must be in [1, {num_target_layers}] (the target's layers), "
                         f"got {num_layers}")
    return num_layers


class SelfDraft:
    def __init__(self, model, num_layers: int | None, block_size: int, seed: int = 0):
        if model.model_path != "native":
            raise ValueError("self_draft needs a natively served family (this model runs through transformers' code)")
        self.model, self.block_size = model, block_size
        self.num_layers = self_draft_layers(num_layers, model.num_layers)
        self.generator = torch.Generator(next(model.parameters()).device).manual_seed(seed)

    def forget(self, request_ids: list[str]) -> None:
        """Nothing is kept per request: the drafts' KV is in the target's cache."""

    @torch.inference_mode()
    def fill(self, scheduled: list[ScheduledRequest], kv_cache, backend) -> tuple[int, int]:
        """Replaces the reserved drafts of every speculating request with the draft model's tokens:
        pass j feeds each request's token at position start + j (its last token, then its drafts).
        Returns the number of passes, and no catch-up (the target's KV is the draft's)."""
        active = [item for item in scheduled if item.draft_token_ids]
        drafts: dict[str, list[int]] = {item.request.request_id: [] for item in active}
        sampled: dict[str, list[SampledDraft | None]] = {item.request.request_id: [] for item in active}
        num_passes = max((len(item.draft_token_ids) for item in active), default=0)
        for depth in range(num_passes):
            rows = [ScheduledRequest(item.request, [item.token_ids[depth]], item.start_pos + depth,
                                     item.block_tables, sample=True)
                    for item in active if len(item.draft_token_ids) > depth]
            inputs = build_inputs(rows, self.block_size, kv_cache.device, self.model.kv_layout.windows)
            logits = self.model(inputs.input_ids, inputs.positions, kv_cache, backend,
                                backend.build_metadata(inputs), inputs.sample_indices, num_layers=self.num_layers)
            tokens, distributions = sample_drafts(logits, [draft_params(r.params) for r in inputs.sampled_requests],
                                                  self.generator)
            for request, _, row in inputs.verified:
                drafts[request.request_id].append(tokens[row])
                sampled[request.request_id].append(distributions[row])
            for item in active:
                mine = drafts[item.request.request_id]
                if len(mine) == depth + 1:
                    item.token_ids[item.num_input_tokens + depth] = mine[-1]
        for item in active:
            item.draft_token_ids = drafts[item.request.request_id]
            samples = sampled[item.request.request_id]
            item.sampled_drafts = [s for s in samples if s is not None] if all(samples) else None
        return num_passes, 0
