"""Drafts from a separate model with its own paged KV cache: method `draft_model` (a smaller model
with the target's vocabulary), and `self_draft` when it is placed in the DraftModel actor.

A `DraftWorker` serves the drafts of many target requests, in the engine process (placement
`local`) or in the DraftModel Ray Serve deployment (`actor`), one typed call per engine step
(DraftCall -> DraftReply). The scheduler reserves each speculating request's drafts; the runner's
`DraftModelDrafter` asks for them, sending each request's tokens after those the worker already
holds, so a call carries a few tokens per request and not whole contexts. The worker keeps each
sequence's tokens and KV; where its own drafts and the request's new tokens part (the target
rejected a draft), its computed tokens end and the blocks after them are freed: that is the
rollback. A worker that does not hold a sequence (restarted, or evicted it for room) answers None
for it and is sent the whole sequence next step; a call that fails, or misses the actor's
deadline, means plain decoding for that step: the reserved slots are released like rejected ones.

Drafts are the draft model's argmax (one-hot) for greedy and seeded requests, else drawn from
its sampling distribution under the request's settings, cut to its most likely tokens and sent
with the draft (SampledDraft) so the target accepts it with probability min(1, p/q)
(engine.runner.speculation.verify).
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from engine.attention.selector import kv_block_bytes, select_backend
from engine.config import ModelConfig, SpeculativeConfig
from engine.drafts import DraftCall, DraftQuery, DraftReply, SampledDraft
from engine.kv_cache.manager import KVCacheManager
from engine.model_loader import load_vocabulary
from engine.model_setup import load_model
from engine.request import Request
from engine.runner.inputs import build_inputs
from engine.runner.speculation.self_draft import self_draft_layers
from engine.sampler import draft_params, sample_drafts
from engine.sampling_params import SamplingParams
from engine.scheduler.output import ScheduledRequest

_SEQUENCE_PARAMS = SamplingParams(max_tokens=1)  # a worker's sequences are never sampled by params


def check_same_vocabulary(target_tokenizer, target_vocab_size: int, draft_tokenizer, draft_vocab_size: int,
                          draft_name: str) -> None:
    """A draft is a token id of the target's: a draft model must have the target's vocabulary."""
    if draft_vocab_size != target_vocab_size or draft_tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise ValueError(f"draft model {draft_name!r} has a different vocabulary than the target "
                         f"({len(draft_tokenizer)} tokens, {draft_vocab_size} logits vs {len(target_tokenizer)} "
                         f"tokens, {target_vocab_size} logits): speculative decoding needs the target's tokenizer")


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class DraftWorker:
    """A draft model, its paged KV cache, and the sequences it drafts for (least recently used
    first: evicted when blocks run short)."""

    def __init__(self, model, backend, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, num_layers: int | None = None, seed: int = 0):
        """`num_layers`: draft through the model's first layers only (self-drafting); `seed`: of
        the draws of sampled drafts."""
        self.model, self.backend, self.num_layers = model, backend, num_layers
        self.generator = torch.Generator(device).manual_seed(seed)
        self.block_size, self.device = block_size, device
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False, layout=model.kv_layout)
        self.kv_cache = backend.allocate_kv_cache(model.kv_layout.num_slots, num_blocks, block_size,
                                                  model.num_kv_heads, model.head_dim, dtype=dtype, device=device)
        self._sequences: OrderedDict[str, Request] = OrderedDict()

    @property
    def num_sequences(self) -> int:
        return len(self._sequences)

    @torch.inference_mode()
    def propose(self, call: DraftCall) -> DraftReply:
        for request_id in call.finished_ids:
            self._drop(request_id)
        in_call = {query.request_id for query in call.queries}
        known: list[bool] = []
        drafting: list[tuple[Request, DraftQuery]] = []
        for query in call.queries:
            sequence = self._sync(query)
            known.append(sequence is not None)
            if sequence is not None and query.num_drafts > 0 and self._reserve(sequence, query.num_drafts, in_call):
                drafting.append((sequence, query))
        drafts, sampled = self._draft(drafting)
        return DraftReply([drafts.get(query.request_id, []) if ok else None for query, ok in zip(call.queries, known)],
                          [sampled.get(query.request_id) for query in call.queries])

    def _sync(self, query: DraftQuery) -> Request | None:
        """The query's sequence with the request's tokens, computed tokens rolled back to where
        they still agree; None if the worker lacks the tokens the query keeps."""
        sequence = self._sequences.get(query.request_id)
        if sequence is None or query.num_kept > sequence.num_tokens:
            if query.num_kept:
                self._drop(query.request_id)
                return None
            sequence = self._sequences[query.request_id] = Request(query.request_id, [], _SEQUENCE_PARAMS)
        self._sequences.move_to_end(query.request_id)
        agreed = query.num_kept + _common_prefix(sequence.token_ids[query.num_kept:], query.new_token_ids)
        sequence.token_ids[query.num_kept:] = query.new_token_ids
        sequence.num_computed_tokens = min(sequence.num_computed_tokens, agreed, sequence.num_tokens - 1)
        if query.request_id in self.kv.block_tables:
            self.kv.free_beyond(sequence, sequence.num_computed_tokens)
        return sequence

    def _reserve(self, sequence: Request, num_drafts: int, protected: set[str]) -> bool:
        """Slots for the sequence's uncomputed tokens and its drafts but the last (never fed),
        evicting the least recently used sequences outside this call while blocks are short."""
        num_slots = sequence.num_uncomputed_tokens + num_drafts - 1
        while self.kv.allocate_slots(sequence, num_slots) is None:
            victim = next((i for i in self._sequences if i not in protected), None)
            if victim is None:
                return False
            self._drop(victim)
        return True

    def _draft(self, drafting: list[tuple[Request, DraftQuery]]
               ) -> tuple[dict[str, list[int]], dict[str, list[SampledDraft]]]:
        """Pass 0 computes each sequence's new tokens and drafts after them; pass j feeds draft j.
        Returns the drafts, and the distributions of those drawn at random."""
        drafts: dict[str, list[int]] = {sequence.request_id: [] for sequence, _ in drafting}
        sampled: dict[str, list[SampledDraft]] = {sequence.request_id: [] for sequence, q in drafting if q.params}
        params = {sequence.request_id: query.params for sequence, query in drafting}
        rows = [self._row(sequence) for sequence, _ in drafting]
        while rows:
            inputs = build_inputs(rows, self.block_size, self.device, self.model.kv_layout.windows)
            logits = self.model(inputs.input_ids, inputs.positions, self.kv_cache, self.backend,
                                self.backend.build_metadata(inputs), inputs.sample_indices, num_layers=self.num_layers)
            tokens, distributions = sample_drafts(logits, [params[r.request_id] for r in inputs.sampled_requests],
                                                  self.generator)
            for request, _, row in inputs.verified:
                drafts[request.request_id].append(tokens[row])
                if (distribution := distributions[row]) is not None:
                    sampled[request.request_id].append(distribution)
            for item in rows:
                item.request.num_computed_tokens = item.request.num_tokens
            rows = []
            for sequence, query in drafting:
                mine = drafts[sequence.request_id]
                if len(mine) < query.num_drafts:
                    sequence.token_ids.append(mine[-1])
                    rows.append(self._row(sequence))
        return drafts, sampled

    def _row(self, sequence: Request) -> ScheduledRequest:
        start = sequence.num_computed_tokens
        return ScheduledRequest(sequence, sequence.token_ids[start:], start, self.kv.copy_tables(sequence.request_id),
                                sample=True)

    def _drop(self, request_id: str) -> None:
        sequence = self._sequences.pop(request_id, None)
        if sequence is not None:
            self.kv.free(sequence)
            self.kv.forget(sequence)


Transport = Callable[[DraftCall], DraftReply | None]  # None: no reply in time (plain decoding this step)


class DraftModelDrafter:
    """The runner's side: fills the drafts the scheduler reserved from a DraftWorker reached
    through `transport` (the worker itself, or the DraftModel deployment)."""

    def __init__(self, transport: Transport):
        self.transport = transport
        self._num_sent: dict[str, int] = {}  # request id -> its first tokens the worker holds
        self._finished: list[str] = []  # ended requests the worker holds, to drop with the next call

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            if self._num_sent.pop(request_id, None) is not None:
                self._finished.append(request_id)

    def fill(self, scheduled: list[ScheduledRequest], kv_cache=None, backend=None) -> tuple[int, int]:
        """Replaces each speculating request's reserved drafts with the worker's; fewer or none
        where the worker gave fewer (the scheduler releases the slots left over). Returns the
        number of passes asked of the worker, and the tokens it was sent for requests it did not
        hold (its catch-up: it computes them first, at a one-time cost)."""
        active = [item for item in scheduled if item.draft_token_ids]
        if not active:
            return 0, 0
        queries = []
        for item in active:
            request = item.request
            kept = self._num_sent.get(request.request_id, 0)
            queries.append(DraftQuery(request.request_id, kept, request.token_ids[kept:], len(item.draft_token_ids),
                                      draft_params(request.params)))
        reply = self.transport(DraftCall(queries, self._finished))
        if reply is not None:
            self._finished = []
        for i, (item, query) in enumerate(zip(active, queries)):
            drafts = reply.drafts[i] if reply is not None else []
            if drafts is None:
                self._num_sent.pop(query.request_id, None)
            elif reply is not None:
                self._num_sent[query.request_id] = query.num_kept + len(query.new_token_ids)
            drafts = (drafts or [])[:len(item.draft_token_ids)]
            item.token_ids = item.token_ids[:item.num_input_tokens] + drafts
            item.draft_token_ids = drafts
            sampled = reply.sampled[i] if reply is not None else None
            item.sampled_drafts = sampled[:len(drafts)] if sampled is not None and drafts else None
        catch_up = sum(len(query.new_token_ids) for query in queries if query.num_kept == 0)
        return max(query.num_drafts for query in queries), catch_up


def load_draft_worker(spec: SpeculativeConfig, target: ModelConfig, max_model_len: int | None, block_size: int,
                      kv_cache_memory_bytes: int, max_num_blocks: int | None = None,
                      target_vocabulary: tuple[Any, int] | None = None) -> DraftWorker:
    """The worker of `spec`: the draft model (`draft_model`, its matmuls in `spec.quantization`,
    fp32 by default; refused unless it has the target's vocabulary: `target_vocabulary`
    (tokenizer, logits) when the caller has the target loaded) or the target's first layers
    (`self_draft`). Positions up to `max_model_len` (None: the target's setting, else the draft's
    own); KV blocks in `kv_cache_memory_bytes`, at most `max_num_blocks` (a local draft holds as
    many tokens as the target, no more)."""
    draft = dataclasses.replace(target, max_model_len=max_model_len or target.max_model_len)
    if spec.method == "draft_model":
        # the draft's quality is the acceptance rate: no start-up check against its own fp32
        draft = dataclasses.replace(draft, model=spec.model, quantization=spec.quantization or "none",
                                    quality_check_tokens=0)
    loaded = load_model(draft)
    num_layers = None
    if spec.method == "self_draft":
        if loaded.model.model_path != "native":
            raise ValueError("self_draft needs a natively served family (this model runs through transformers' code)")
        num_layers = self_draft_layers(spec.num_layers, loaded.model.num_layers)
    else:
        if spec.model is None:
            raise ValueError("speculative decoding by a draft model needs its model")
        target_tokenizer, target_logits = target_vocabulary or load_vocabulary(target.model)
        check_same_vocabulary(target_tokenizer, target_logits, loaded.tokenizer, loaded.model.vocab_size, spec.model)
    num_blocks = kv_cache_memory_bytes // kv_block_bytes(loaded.model, block_size, loaded.dtype)
    if max_num_blocks is not None:
        num_blocks = min(num_blocks, max_num_blocks)
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory_bytes {kv_cache_memory_bytes} holds no KV block of the draft model")
    device = torch.device(target.device)
    backend = select_backend(target.attention_backend, device, loaded.dtype, loaded.model.attention,
                             target.max_model_len or loaded.max_model_len)
    return DraftWorker(loaded.model, backend, num_blocks, block_size, device, loaded.dtype, num_layers, target.seed)
