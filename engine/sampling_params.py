"""User-facing sampling parameters, validated on construction (vLLM's SamplingParams fields).

This is the one home of every sampling range: the engine checks them here and the serve app
builds a SamplingParams at its edge, so a value either side accepts the other accepts too.
Integers are bounded to what the sampler's tensors hold (int64 seeds, int32 counts), floats
must be finite, and a temperature below `GREEDY_EPS` means greedy, as in vLLM (dividing logits
by 1e-300 would overflow them). Torch-free.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from engine.errors import InvalidRequestError

GREEDY_EPS = 1e-5
MAX_N = 128
MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _show(value) -> str:
    """The value as an error message shows it: short even for a 5,000-digit int."""
    text = repr(value) if not isinstance(value, int) or abs(value) < 10**30 else f"an int of {value.bit_length()} bits"
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _int_in(lo: int, hi: int):
    return lambda v: _is_int(v) and lo <= v <= hi


def _number_in(lo: float, hi: float, lo_open: bool = False):
    return lambda v: _is_number(v) and (lo < v if lo_open else lo <= v) and v <= hi


_RULES = (  # field, accepts, rule as the error message states it
    ("n", _int_in(1, MAX_N), f"must be an int in [1, {MAX_N}]"),
    ("max_tokens", _int_in(1, INT32_MAX), f"must be an int in [1, {INT32_MAX}]"),
    ("temperature", _number_in(0, math.inf), "must be a finite number >= 0"),
    ("top_k", lambda v: v == -1 or _int_in(0, INT32_MAX)(v), f"must be an int in [1, {INT32_MAX}], or 0/-1 to disable"),
    ("top_p", _number_in(0, 1, lo_open=True), "must be a number in (0, 1]"),
    ("min_p", _number_in(0, 1), "must be a number in [0, 1]"),
    ("seed", lambda v: v is None or _int_in(INT64_MIN, INT64_MAX)(v), "must be a 64-bit signed int or null"),
    ("ignore_eos", lambda v: isinstance(v, bool), "must be a bool"),
    ("skip_special_tokens", lambda v: isinstance(v, bool), "must be a bool"),
    ("include_stop_str_in_output", lambda v: isinstance(v, bool), "must be a bool"),
    ("presence_penalty", _number_in(-2, 2), "must be a number in [-2, 2]"),
    ("frequency_penalty", _number_in(-2, 2), "must be a number in [-2, 2]"),
    ("repetition_penalty", _number_in(0, math.inf, lo_open=True), "must be a finite number > 0"),
    ("logprobs", lambda v: v is None or _int_in(0, MAX_LOGPROBS)(v), f"must be an int in [0, {MAX_LOGPROBS}] or null"),
    ("prompt_logprobs", lambda v: v is None or _int_in(0, MAX_LOGPROBS)(v),
     f"must be an int in [0, {MAX_LOGPROBS}] or null"),
    ("stop", lambda v: len(v) <= MAX_STOP_STRINGS and all(isinstance(s, str) and s for s in v),
     f"must be at most {MAX_STOP_STRINGS} non-empty strings"),
    ("stop_token_ids", lambda v: all(_int_in(0, INT32_MAX)(t) for t in v), f"must be ints in [0, {INT32_MAX}]"),
    ("min_tokens", _int_in(0, INT32_MAX), f"must be an int in [0, {INT32_MAX}]"),
    ("logit_bias", lambda v: len(v) <= MAX_LOGIT_BIAS and all(_int_in(0, INT32_MAX)(t) and _number_in(-100, 100)(b)
                                                             for t, b in v.items()),
     f"must map at most {MAX_LOGIT_BIAS} token ids (ints in [0, {INT32_MAX}]) to numbers in [-100, 100]"),
)


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(slots=True, frozen=True)
class StructuredOutputsParams:
    """What an output must match (vLLM's `structured_outputs`), exactly one of: a JSON schema
    (`json`, a dict or its JSON text), a regular expression, one of `choice`'s strings, a Lark or
    GBNF `grammar`, or any JSON object (`json_object`, OpenAI's response_format json_object).
    Checked here as far as it can be without the tokenizer: the kind, the types, and the schema
    against its JSON Schema metaschema; what the grammar engine cannot compile is refused by the
    engine before the request runs."""
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = self._given()
        if len(given) != 1:
            raise InvalidRequestError("structured_outputs", "structured_outputs must give exactly one of "
                                      f"{', '.join(STRUCTURED_KINDS)}, got {given or 'none'}")
        if isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", json.loads(self.json))
            except ValueError as e:
                raise InvalidRequestError("structured_outputs", f"the JSON schema is not valid JSON: {e}") from None
        if self.json is not None:
            check_json_schema(self.json)
        if self.regex is not None and not (isinstance(self.regex, str) and self.regex):
            raise InvalidRequestError("structured_outputs",
                                      f"regex must be a non-empty string, got {_show(self.regex)}")
        if self.choice is not None and not (isinstance(self.choice, list) and self.choice
                                            and all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidRequestError("structured_outputs", "choice must be a non-empty list of non-empty strings, "
                                                            f"got {_show(self.choice)}")
        if self.grammar is not None and not (isinstance(self.grammar, str) and self.grammar.strip()):
            raise InvalidRequestError("structured_outputs", f"grammar must be a non-empty string, got "
                                                            f"{_show(self.grammar)}")
        if not isinstance(self.json_object, bool):
            raise InvalidRequestError("structured_outputs",
                                      f"json_object must be a bool, got {_show(self.json_object)}")

    def _given(self) -> list[str]:
        return [kind for kind in STRUCTURED_KINDS if getattr(self, kind) not in (None, False)]

    @property
    def kind(self) -> str:
        return self._given()[0]

    @property
    def key(self) -> str:
        """The constraint as one string: compiled grammars are cached by it."""
        value = getattr(self, self.kind)
        return self.kind + ":" + (value if isinstance(value, str) else json.dumps(value, sort_keys=True))


def check_json_schema(schema) -> None:
    """A JSON schema is an object valid against its metaschema."""
    import jsonschema

    if not isinstance(schema, dict):
        raise InvalidRequestError("structured_outputs", f"a JSON schema must be an object, got {_show(schema)}")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        raise InvalidRequestError("structured_outputs", f"invalid JSON schema{' at ' + where if where else ''}: "
                                                        f"{e.message[:200]}") from None


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0  # below GREEDY_EPS = greedy
    top_k: int = 0  # 0 or -1 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # stop strings (one: a string), cut from the text unless
    include_stop_str_in_output: bool = False  # the stop string that ended a sample ends its text too (vLLM's)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # number of top logprobs to return per token (plus the sampled one)
    prompt_logprobs: int | None = None  # the same for each prompt token after the first (vLLM's)
    min_tokens: int = 0  # no EOS, stop token or stop string ends the output before this many tokens
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit before sampling
    best_of: int | None = None  # samples generated, the n with the highest cumulative logprob returned; None: n
    structured_outputs: StructuredOutputsParams | None = None  # what the output must match (constrained decoding)
    skip_special_tokens: bool = True  # special tokens left out of the text (kept: a parser reads its markers)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple, type(None))):
            raise InvalidRequestError("stop", f"stop must be a string or a list of strings, got {_show(self.stop)}")
        if not isinstance(self.stop_token_ids, (list, tuple, type(None))):
            raise InvalidRequestError("stop_token_ids", f"stop_token_ids must be a list of ints, got "
                                                        f"{_show(self.stop_token_ids)}")
        if not isinstance(self.logit_bias, (dict, type(None))):
            raise InvalidRequestError("logit_bias", f"logit_bias must map token ids to numbers, got "
                                                    f"{_show(self.logit_bias)}")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias or {})
        for name, accepts, rule in _RULES:
            value = getattr(self, name)
            if not accepts(value):
                raise InvalidRequestError(name, f"{name} {rule}, got {_show(value)}")
        if self.best_of is None:
            self.best_of = self.n
        if not (_is_int(self.best_of) and self.n <= self.best_of <= MAX_N):
            raise InvalidRequestError("best_of", f"best_of must be an int in [n, {MAX_N}] (n is {self.n}), "
                                                 f"got {_show(self.best_of)}")
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError("min_tokens", f"min_tokens must be <= max_tokens ({self.max_tokens}), "
                                                    f"got {self.min_tokens}")
        if not isinstance(self.structured_outputs, (StructuredOutputsParams, type(None))):
            raise InvalidRequestError("structured_outputs", "structured_outputs must be a StructuredOutputsParams, "
                                                            f"got {_show(self.structured_outputs)}")
        if self.top_k == -1:
            self.top_k = 0

    @property
    def num_samples(self) -> int:
        """Samples generated: best_of, n where it was not given."""
        return self.best_of or self.n

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS or self.top_k == 1

    @property
    def ranks_samples(self) -> bool:
        """More samples are generated than returned: each sampled token's logprob is kept to rank them."""
        return self.num_samples > self.n

    @property
    def keeps_logprobs(self) -> bool:
        """The sampled tokens' logprobs are computed: asked for, or needed to rank best_of's samples."""
        return self.logprobs is not None or self.ranks_samples

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


@dataclass(slots=True, frozen=True)
class PoolingParams:
    """An embedding request (vLLM's PoolingParams): the prompt's final hidden states (after the
    model's final norm) pooled, its last token's (`last`) or the mean over its tokens (`mean`;
    None: the engine's `pooling` argument), L2-normalised; `dimensions`: only the first ones kept,
    then normalised again (Matryoshka-style truncation, at most the hidden size)."""
    pooling: str | None = None
    dimensions: int | None = None

    def __post_init__(self):
        if self.pooling not in (None, "last", "mean"):
            raise InvalidRequestError("pooling", f"pooling must be 'last' or 'mean', got {_show(self.pooling)}")
        if self.dimensions is not None and not _int_in(1, INT32_MAX)(self.dimensions):
            raise InvalidRequestError("dimensions", f"dimensions must be an int >= 1, got {_show(self.dimensions)}")
