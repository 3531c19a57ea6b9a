"""Samples one token per row from logits, every row with its own parameters, in one pass.

A row's logits first take its adjustments: penalties, `logit_bias`, and while its output is
shorter than `min_tokens`, no end-of-sequence or stop token (they are masked, as vLLM does).
A structured output's row then keeps only the tokens its constraint allows after the tokens
before the row (a draft row's too, so a draft the constraint rejects is never accepted); where
min_tokens and the constraint leave nothing, the constraint wins. Greedy rows then take the
argmax. Other rows go through temperature, top-k, top-p and min-p, then an exponential race
(argmax of p / E, E ~ Exp(1)), which equals drawing from p. A seeded
request draws its noise from its own generator (kept here, by request id, until the runner says
the request ended), so its tokens do not depend on what else is in the batch.

One row's failure is that row's alone: if the batched pass raises, every generator is put back
as it was and the rows are sampled one by one, so the rows that raise fail and the others get
exactly the tokens the batched pass would have given them. Owns no stop checks.

`launch` queues a batch's sampling and its copy to the host without waiting for the device: the
tokens stay readable on the device (the next step's inputs, under async scheduling) and come to
the host at `SampledBatch.result()`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.drafts import SampledDraft
from engine.grammar import disallowed_tokens, new_bitmask
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.batch import SampledRow

DRAFT_SUPPORT = 64  # tokens a sampled draft's distribution keeps (and a DraftReply carries)
ARGMAX_PIECES = 128  # a few rows' greedy argmax on CUDA: pieces of the vocabulary reduced first


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int | None]  # (R,) one per row; None where the row failed
    logprobs: list[dict[int, float] | None]  # (R,) sampled + top-`logprobs` tokens, if asked
    errors: dict[str, Exception] = field(default_factory=dict)  # request id -> why its row failed


class SampledBatch:
    """A batch's sampling as queued on the device: `token_ids` there, and at `result()` the
    output `finish` makes of the `host` copies once they have landed."""

    def __init__(self, token_ids: torch.Tensor, host: list[torch.Tensor],
                 finish: Callable[[list[torch.Tensor]], SamplerOutput]):
        self.token_ids = token_ids  # (R,) on the logits' device
        self._host, self._finish = host, finish
        self._done: SamplerOutput | None = None
        self._copied = None
        if token_ids.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()

    def result(self) -> SamplerOutput:
        """The tokens and logprobs on the host: the step's one wait for the device."""
        if self._done is None:
            if self._copied is not None:
                self._copied.synchronize()
            self._done = self._finish(self._host)
        return self._done


class Sampler:
    def __init__(self, seed: int, device: torch.device = torch.device("cpu"),
                 eos_token_ids: frozenset[int] = frozenset()):
        """`device`: where the logits are; the noise and every per-row tensor are made there.
        `eos_token_ids`: the model's, masked with each request's stop tokens below min_tokens."""
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.generator = torch.Generator(device).manual_seed(seed)
        self._request_generators: dict[str, torch.Generator] = {}

    def forget(self, request_ids: list[str]) -> None:
        """Drops the generators of requests that ended."""
        for request_id in request_ids:
            self._request_generators.pop(request_id, None)

    def __call__(self, logits: torch.Tensor, requests: list[SampledRow],
                 drafts: list[SampledDraft | None] | None = None) -> SamplerOutput:
        return self.launch(logits, requests, drafts).result()

    @torch.inference_mode()
    def launch(self, logits: torch.Tensor, requests: list[SampledRow],
               drafts: list[SampledDraft | None] | None = None) -> SampledBatch:
        """`drafts`: per row, the sampled draft it verifies (Leviathan et al.'s rule), or None: the
        row is sampled as it is (a one-hot draft is verified by comparing with that sample)."""
        drafts = drafts or [None] * len(requests)
        kinds = _RowKinds.of(requests)
        snapshot = self._snapshot([requests[i] for i in kinds.random])
        masks = _constraint_masks(requests, kinds.constrained, logits.shape[-1])
        try:
            return self._sample_batch(logits, requests, drafts, masks, kinds)
        except Exception:
            self._restore(snapshot)
        token_ids: list[int | None] = []
        logprobs: list[dict[int, float] | None] = []
        errors: dict[str, Exception] = {}
        for row, request in enumerate(requests):
            try:
                one = self._sample_batch(logits[row:row + 1], [request], drafts[row:row + 1],
                                         masks.of_row(row) if masks is not None else None,
                                         _RowKinds.of([request])).result()
            except Exception as e:  # this request's own fault: fail it, keep its batch-mates
                token_ids.append(None)
                logprobs.append(None)
                errors[request.request_id] = e
                continue
            token_ids += one.token_ids
            logprobs += one.logprobs
        # a failed row's token on the device is 0: its request ends with this step, no step reads it
        device_ids = torch.tensor([t or 0 for t in token_ids], dtype=torch.long, device=logits.device)
        output = SamplerOutput(token_ids, logprobs, errors)
        return SampledBatch(device_ids, [], lambda _: output)

    def _sample_batch(self, logits: torch.Tensor, requests: list[SampledRow], drafts: list[SampledDraft | None],
                      masks: _ConstraintMasks | None, kinds: _RowKinds) -> SampledBatch:
        logits = raw = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if kinds.logprobs else None
        if kinds.adjusted:
            logits = logits.clone()  # the caller's logits stay intact for a row-by-row retry
            for row in kinds.adjusted:
                self._adjust(logits[row], requests[row])
        if masks is not None:
            logits = _constrain(logits, raw, requests, masks)
        token_ids = greedy_tokens(logits)
        random_rows = kinds.random
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            token_ids[rows] = self._sample(logits[rows], [requests[i] for i in random_rows],
                                           [drafts[i] for i in random_rows])
        return _gathered(token_ids, raw_logprobs, requests, kinds.logprobs)

    def _sample(self, logits: torch.Tensor, requests: list[SampledRow], drafts: list[SampledDraft | None]
                ) -> torch.Tensor:
        probs = sampling_probs(logits, [r.params for r in requests])
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, request in enumerate(requests):
            if request.params.seed is not None:
                noise[row].exponential_(generator=self._request_generator(request))
        for row, draft in enumerate(drafts):
            if draft is not None:
                probs[row] = self._verify(probs[row], draft)
        return (probs / noise).argmax(dim=-1)

    def _adjust(self, row: torch.Tensor, request: SampledRow) -> None:
        """In place: the row's penalties, logit bias and min_tokens mask."""
        params = request.params
        if params.has_penalties:
            _apply_penalties(row, request)
        if params.logit_bias:
            ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=row.device)
            row.index_add_(0, ids, torch.tensor(list(params.logit_bias.values()), dtype=row.dtype, device=row.device))
        if _below_min_tokens(request):
            stops = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
            row.index_fill_(0, torch.tensor(sorted(stops), dtype=torch.long, device=row.device), float("-inf"))

    def _verify(self, p: torch.Tensor, draft: SampledDraft) -> torch.Tensor:
        """Leviathan et al. / Chen et al.: the draft d, drawn from q, is accepted with probability
        min(1, p(d) / q(d)), else a token is drawn from norm(max(0, p - q)). So each token has
        probability p. Returns the distribution to draw the row's token from: one-hot at d when
        accepted, else the residual."""
        p = p / p.sum()
        q = torch.zeros_like(p).index_put_((torch.tensor(draft.support, device=p.device),),
                                            torch.tensor(draft.probs, device=p.device, dtype=p.dtype))
        d = draft.token_id
        if float(torch.rand((), generator=self.generator, device=p.device)) * float(q[d]) <= float(p[d]):
            return torch.zeros_like(p).index_fill_(0, torch.tensor([d], device=p.device), 1.0)
        return (p - q).clamp_(min=0)

    def _request_generator(self, request: SampledRow) -> torch.Generator:
        generator = self._request_generators.get(request.request_id)
        if generator is None:
            seed = hash((request.params.seed, request.sample_index)) & 0x7FFF_FFFF_FFFF_FFFF
            generator = self._request_generators[request.request_id] = torch.Generator(self.device).manual_seed(seed)
        return generator

    def _snapshot(self, sampled: list[SampledRow]) -> tuple[list[tuple[torch.Generator, torch.Tensor]], list[str]]:
        """States of the generators a pass over the `sampled` (not greedy) rows may draw from
        (none for an all-greedy batch), and the seeded requests that have no generator yet."""
        if not sampled:
            return [], []
        seeded = [r.request_id for r in sampled if r.params.seed is not None]
        generators = [self.generator] + [self._request_generators[i] for i in seeded if i in self._request_generators]
        return [(g, g.get_state()) for g in generators], [i for i in seeded if i not in self._request_generators]

    def _restore(self, snapshot: tuple[list[tuple[torch.Generator, torch.Tensor]], list[str]]) -> None:
        states, new_ids = snapshot
        for generator, state in states:
            generator.set_state(state)
        self.forget(new_ids)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1), the first maximum of each row. On CUDA a few rows go in two passes, over
    ARGMAX_PIECES equal pieces of the vocabulary and then their maxima: torch reduces one row of
    128k values on a single block (27 us a step on an H100, a 1B model's decode step being ~1.5 ms)."""
    rows, vocab = logits.shape
    if not logits.is_cuda or rows > ARGMAX_PIECES or vocab % ARGMAX_PIECES:
        return logits.argmax(dim=-1)
    values, within = logits.reshape(rows, ARGMAX_PIECES, -1).max(dim=-1)  # first maximum of each piece
    piece = values.argmax(dim=-1)  # the first piece holding the row's maximum
    return piece * (vocab // ARGMAX_PIECES) + within.gather(1, piece[:, None])[:, 0]


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Each row's distribution under its temperature, top-k, top-p and min-p (unnormalised
    after min-p)."""
    device = logits.device
    logits = logits / torch.tensor([p.temperature for p in params], device=device)[:, None]
    top_k = torch.tensor([p.top_k for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        logits = _top_k_top_p(logits, top_k, top_p)
    probs = torch.softmax(logits, dim=-1)
    min_p = torch.tensor([p.min_p for p in params], device=device)
    if bool((min_p > 0).any()):
        probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs


def draft_params(params: SamplingParams) -> SamplingParams | None:
    """What a draft model samples its drafts under for a request: None (argmax) for greedy
    requests, whose target token is the argmax, and for seeded ones, whose tokens must not depend
    on a draft's own randomness."""
    return None if params.greedy or params.seed is not None else params


def sample_drafts(logits: torch.Tensor, params: list[SamplingParams | None], generator: torch.Generator
                  ) -> tuple[list[int], list[SampledDraft | None]]:
    """A draft model's next token per row: the argmax where `params` is None (greedy or seeded
    requests: a one-hot draft, no randomness of the draft's own), else a draw from the row's
    sampling distribution cut to its DRAFT_SUPPORT most likely tokens (any draft distribution is
    exact under verification; this one is close to the target's and small to send)."""
    tokens = logits.argmax(dim=-1).tolist()
    rows = [i for i, p in enumerate(params) if p is not None]
    drafts: list[SampledDraft | None] = [None] * len(params)
    if rows:
        probs = sampling_probs(logits[rows].float(), [p for p in params if p is not None])
        top = probs.topk(min(DRAFT_SUPPORT, probs.shape[-1]), dim=-1)
        top_probs = top.values / top.values.sum(dim=-1, keepdim=True)
        picks = torch.multinomial(top_probs, 1, generator=generator).flatten().tolist()
        for j, i in enumerate(rows):
            keep = top_probs[j] > 0
            support, q = top.indices[j][keep].tolist(), top_probs[j][keep].tolist()
            tokens[i] = int(top.indices[j, picks[j]])
            drafts[i] = SampledDraft(tokens[i], support, q)
    return tokens, drafts


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Masks logits outside each row's top-k and top-p nucleus (the top token always stays)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    drop = ranks >= k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
    drop |= before >= top_p[:, None]
    drop[:, 0] = False
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))


@dataclass(slots=True)
class _ConstraintMasks:
    rows: list[int]  # the rows with a constraint
    disallowed: torch.Tensor  # (len(rows), vocab) bool: the tokens each may not sample

    def of_row(self, row: int) -> _ConstraintMasks | None:
        """The one row's mask, as a batch of one (the row-by-row retry)."""
        if row not in self.rows:
            return None
        j = self.rows.index(row)
        return _ConstraintMasks([0], self.disallowed[j:j + 1])


def _constraint_masks(rows: list[SampledRow], constrained: list[int], vocab_size: int) -> _ConstraintMasks | None:
    """Each constrained row's disallowed tokens; None when no row has a constraint."""
    if not constrained:
        return None
    bitmask = new_bitmask(len(constrained), vocab_size)
    for j, i in enumerate(constrained):
        constraint = rows[i].constraint
        if constraint is None:
            raise ValueError(f"row {i} has no constraint to fill")
        constraint.fill(bitmask, j, getattr(rows[i], "drafts", ()))  # a WithDrafts row: after its drafts
    return _ConstraintMasks(constrained, disallowed_tokens(bitmask, vocab_size))


def _constrain(logits: torch.Tensor, raw: torch.Tensor, rows: list[SampledRow], masks: _ConstraintMasks
               ) -> torch.Tensor:
    """The constrained rows keep only their allowed tokens; a row that min_tokens' masked ends
    left with none takes its raw logits, constrained."""
    logits = logits.clone() if logits is raw else logits
    disallowed = masks.disallowed.to(logits.device)
    if len(masks.rows) == logits.shape[0]:
        logits.masked_fill_(disallowed, float("-inf"))
    else:
        index = torch.tensor(masks.rows, device=logits.device)
        logits[index] = logits[index].masked_fill_(disallowed, float("-inf"))
    for j, i in enumerate(masks.rows):
        if _below_min_tokens(rows[i]) and bool(torch.isneginf(logits[i]).all()):
            logits[i] = raw[i].masked_fill(disallowed[j], float("-inf"))
    return logits


def _below_min_tokens(request: SampledRow) -> bool:
    return bool(request.params.min_tokens) and len(request.output_token_ids) < request.params.min_tokens


def _has_adjustments(request: SampledRow) -> bool:
    return request.params.has_penalties or bool(request.params.logit_bias) or _below_min_tokens(request)


@dataclass(slots=True)
class _RowKinds:
    """The rows of a batch that take more than a greedy argmax, each kind's found in one pass
    over its requests (a full batch's per-row checks are host work every step)."""
    random: list[int]  # sampled, not greedy
    logprobs: list[int]  # their logprobs kept
    adjusted: list[int]  # penalties, logit bias or min_tokens
    constrained: list[int]  # a structured output's

    @classmethod
    def of(cls, requests: list[SampledRow]) -> _RowKinds:
        kinds = cls([], [], [], [])
        for row, request in enumerate(requests):
            params = request.params
            if not params.greedy:
                kinds.random.append(row)
            if params.keeps_logprobs:
                kinds.logprobs.append(row)
            if _has_adjustments(request):
                kinds.adjusted.append(row)
            if request.constraint is not None:
                kinds.constrained.append(row)
        return kinds


def _apply_penalties(row: torch.Tensor, request: SampledRow) -> None:
    """In place. Repetition penalty (HF/vLLM) over prompt and output; presence and frequency
    penalties (OpenAI) over the output only."""
    params = request.params
    if params.repetition_penalty != 1:
        seen = torch.tensor(sorted(set(request.token_ids)), dtype=torch.long, device=row.device)
        values = row[seen]
        row[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    output = request.output_token_ids
    if output and (params.presence_penalty or params.frequency_penalty):
        output_ids = torch.tensor(output, dtype=torch.long, device=row.device)
        counts = torch.bincount(output_ids, minlength=row.shape[0]).to(row.dtype)
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(row.dtype)


def _gathered(token_ids: torch.Tensor, raw: torch.Tensor | None, requests: list[SampledRow], rows: list[int]
              ) -> SampledBatch:
    """The rows' tokens, and for `rows` their logprobs from `raw` (the sampled token's and the top
    `logprobs` ones; the sampled one alone where only best_of's ranking needs it), selected on
    the logits' device; their copies to the host are queued together, so a step waits once."""
    values = [token_ids]
    if rows:
        if raw is None:
            raise ValueError("rows keeping logprobs need the raw logits")
        index = torch.tensor(rows, device=token_ids.device)
        kept = raw[index]
        top_values, top_ids = kept.topk(max(requests[i].params.logprobs or 0 for i in rows))
        values += [kept.gather(1, token_ids[index, None])[:, 0], top_values, top_ids]

    def finish(host: list[torch.Tensor]) -> SamplerOutput:
        ids = host[0].tolist()
        logprobs: list[dict[int, float] | None] = [None] * len(requests)
        if rows:
            chosen, top_values, top_ids = (t.tolist() for t in host[1:])
            for j, i in enumerate(rows):
                num = requests[i].params.logprobs or 0
                logprobs[i] = {ids[i]: chosen[j]} | dict(zip(top_ids[j][:num], top_values[j][:num]))
        return SamplerOutput(ids, logprobs)

    host = values if token_ids.device.type == "cpu" else [t.to("cpu", non_blocking=True) for t in values]
    return SampledBatch(token_ids, host, finish)
