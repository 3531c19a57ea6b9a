"""Structured outputs: constraints compiled for the model's tokenizer, a matcher per request, and
the token bitmask the sampler applies.

Built on llguidance: of the maintained grammar engines it is the one whose JSON always parses
(xgrammar and outlines-core let a length-bounded string hold raw control characters), its mask
costs microseconds per row, and it needs nothing else installed (benchmarks/investigations/grammar_libraries.py,
BENCHMARKS.md). A constraint is compiled once, on a thread of its own (never on the step loop),
into a matcher at its start state; each request gets a copy. JSON is written the way `json.dumps`
writes it (", " and ": ", no other whitespace): free whitespace lets a small model spend its
whole budget on it.
"""
from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import llguidance.hf
import numpy as np
import torch

from engine.errors import InvalidRequestError, RequestFailedError
from engine.sampling_params import StructuredOutputsParams
from engine.tool_formats import JSON_STYLE

CACHED_CONSTRAINTS = 256


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The constraint as an llguidance grammar; InvalidRequestError if it is not one."""
    try:
        if spec.regex is not None:
            return llguidance.grammar_from("regex", spec.regex)
        if spec.grammar is not None:  # Lark or GBNF
            return llguidance.grammar_from("grammar", spec.grammar)
        if spec.choice is not None:
            return llguidance.grammar_from("choice", json.dumps(spec.choice))
        schema = spec.json if spec.json is not None else {"type": "object"}  # a schema, or any JSON object
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_STYLE)
    except (ValueError, TypeError, RuntimeError) as e:
        raise InvalidRequestError("structured_outputs", f"the {spec.kind} constraint is not valid: {e}") from None


class GrammarCompiler:
    """Compiles constraints off the caller's thread; the most recent ones stay cached by key."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int]):
        """`tokenizer`: the model's (a fast Hugging Face tokenizer); `vocab_size`: its logits."""
        self._hf_tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = sorted(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None  # made on the compile thread, once
        self._tokenizer_error: InvalidRequestError | None = None  # or why it cannot be made
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[str, Future[llguidance.LLMatcher]] = OrderedDict()

    def compile(self, spec: StructuredOutputsParams) -> Future[llguidance.LLMatcher]:
        """The constraint's matcher at its start state, when compiled; its exception is an
        InvalidRequestError saying what the grammar engine could not compile."""
        key = spec.key
        future = self._cache.get(key)
        if future is None:
            future = self._cache[key] = self._executor.submit(self._compile, spec)
            while len(self._cache) > CACHED_CONSTRAINTS:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return future

    def _compile(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self._llguidance_tokenizer(), grammar_text(spec), log_level=0)
        if matcher.is_error():
            raise InvalidRequestError("structured_outputs", f"the {spec.kind} constraint cannot be compiled: "
                                                            f"{matcher.get_error()}")
        return matcher

    def _llguidance_tokenizer(self) -> llguidance.LLTokenizer:
        """The model's tokenizer as llguidance reads it, made once (or refused once)."""
        if self._tokenizer is None and self._tokenizer_error is None:
            try:
                self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self._vocab_size,
                                                               eos_token=self._eos_token_ids or None)
            except (ValueError, TypeError, AssertionError) as e:  # e.g. a decoder whose bytes it cannot read
                self._tokenizer_error = InvalidRequestError(
                    "structured_outputs", f"structured outputs are not available for this model's tokenizer: {e}")
        if self._tokenizer_error is not None:
            raise self._tokenizer_error
        assert self._tokenizer is not None  # made above, or refused
        return self._tokenizer


class RequestGrammar:
    """One request's matcher, advanced by every token the request appends."""

    __slots__ = ("_start", "_matcher")

    def __init__(self, start: llguidance.LLMatcher):
        self._start = start
        self._matcher = start.deep_copy()

    def fresh(self) -> RequestGrammar:
        """The same constraint from its start (a sibling sample's)."""
        return RequestGrammar(self._start)

    def accept(self, token_id: int) -> None:
        if not self._matcher.consume_token(token_id):
            raise RequestFailedError(f"token {token_id} does not match the output's constraint: "
                                     f"{self._matcher.get_error()}")

    @property
    def is_finished(self) -> bool:
        """Nothing more can follow (the end-of-sequence token excepted): the output is complete."""
        return self._matcher.is_stopped()

    def fill(self, bitmask: torch.Tensor, row: int, drafts: Sequence[int]) -> None:
        """Writes into `bitmask[row]` the tokens allowed after the output so far and `drafts`. A
        draft the constraint rejects leaves the row allowing every token: that row's token is
        never kept, as the row before it cannot sample the rejected draft, so verification
        stops there."""
        consumed = self._matcher.try_consume_tokens(list(drafts)) if drafts else 0
        if consumed < len(drafts):
            bitmask[row] = -1
        else:
            view = bitmask[row]
            self._matcher.unsafe_compute_mask_ptr(view.data_ptr(), view.numel() * view.element_size())
        if consumed:
            self._matcher.rollback(consumed)


def disallowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(R, words) int32 bitmask, bit i of word w set if token 32w + i is allowed -> (R, vocab_size)
    bool, True where a token is not allowed."""
    bits = np.unpackbits(np.invert(bitmask.numpy()).view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(np.ascontiguousarray(bits)).view(torch.bool)


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)
