"""What OpenAI's completions and chat completions share: the sampling fields (vLLM's extensions
included), the output constraints, and the stream of chunk objects with its usage options.

Value ranges are the engine's SamplingParams', checked when it is built.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from engine.beam_search import BeamSearchParams
from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from serve_app.api.outputs import Tally
from serve_app.api.wire import SSE_DONE, APIError, WireModel, sse_event


class StreamOptions(WireModel):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="Usage so far on every chunk (vLLM's).")


class JsonSchemaFormat(WireModel):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="The JSON schema; none: any JSON object.")
    strict: bool | None = Field(None, description="Accepted; outputs always follow the schema.")


class ResponseFormat(WireModel):
    """OpenAI's response_format: free text, any JSON object, or JSON following a schema."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only with it")
        return self


class StructuredOutputs(WireModel):
    """vLLM's structured_outputs: exactly one of a JSON schema, a regex, choices, a grammar
    (Lark or GBNF), or any JSON object."""
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingFields(WireModel):
    """Fields shared by /v1/completions and /v1/chat/completions (incl. vLLM extensions)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM extensions
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    logit_bias: dict[str, float] | None = Field(None, description="Token id (as a string) -> bias in [-100, 100] "
                                                                  "added to its logit.")
    min_tokens: int = 0
    best_of: int | None = Field(None, description="Samples generated, the n with the highest cumulative logprob "
                                                  "returned (not with stream); null: n.")
    priority: int | None = Field(None, description="Lower is served sooner; None: the API key's default.")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = Field(None, description="vLLM's older spelling of structured_outputs.")
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    skip_special_tokens: bool = Field(True, description="Special tokens left out of the text (vLLM's).")
    include_stop_str_in_output: bool = Field(False, description="The stop string that ended an output ends its "
                                                                "text too (vLLM's).")
    prompt_logprobs: int | None = Field(None, description="Logprobs of each prompt token and its k likeliest "
                                                          "alternatives, as vLLM returns them.")
    return_token_ids: bool = Field(False, description="The prompt's and each output's token ids beside the text "
                                                      "(vLLM's).")
    return_tokens_as_token_ids: bool = Field(False, description="Logprobs' tokens as 'token_id:{id}' (vLLM's).")
    n_predict: int | None = Field(None, ge=1, description="llama.cpp's name of max_tokens.")
    grammar: str | None = Field(None, description="llama.cpp's: a GBNF (or Lark) grammar the output follows.")
    json_schema: dict[str, Any] | None = Field(None, description="llama.cpp's: a JSON schema the output follows.")

    @model_validator(mode="after")
    def _streaming(self) -> SamplingFields:
        if self.stream and self.best_of is not None and self.best_of > self.n:
            raise ValueError("best_of > n cannot be streamed: the best choices are known when all are done")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")  # as OpenAI and vLLM refuse it
        if self.max_tokens is not None and self.n_predict is not None:
            raise ValueError("give max_tokens or llama.cpp's n_predict, not both")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        """The output's length the request asks for, by OpenAI's name or llama.cpp's."""
        return self.max_tokens if self.max_tokens is not None else self.n_predict

    def prompt_logprobs_computed(self) -> int | None:
        """The prompt tokens' top logprobs the engine computes (completions' echo asks for some too)."""
        return self.prompt_logprobs

    def sampling_params(self, max_tokens: int, num_logprobs: int | None) -> SamplingParams:
        """The engine's SamplingParams; raises InvalidRequestError naming the field."""
        return SamplingParams(
            n=self.n, max_tokens=max_tokens, temperature=self.temperature, top_k=self.top_k,
            top_p=self.top_p, min_p=self.min_p, seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else self.stop or [],
            stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logprobs=num_logprobs, min_tokens=self.min_tokens,
            logit_bias=_token_id_keys(self.logit_bias), best_of=self.best_of,
            prompt_logprobs=self.prompt_logprobs_computed(), structured_outputs=self.output_constraint(),
            skip_special_tokens=self.skip_special_tokens, include_stop_str_in_output=self.include_stop_str_in_output)

    def beam_search_params(self, max_tokens: int) -> BeamSearchParams | None:
        """A beam search's parameters, or None for sampling (completions override it)."""
        return None

    def output_constraint(self) -> StructuredOutputsParams | None:
        """What the output must match, from whichever field gave it (one at most)."""
        given = {field: spec for field, spec in self._constraint_fields().items() if spec is not None}
        if not given:
            return None
        if len(given) > 1:
            raise InvalidRequestError(list(given)[1], f"give one output constraint, got {', '.join(given)}")
        ((field, spec),) = given.items()
        try:
            return StructuredOutputsParams(**spec)
        except InvalidRequestError as e:
            raise InvalidRequestError(field, f"{field}: {e.message}") from None

    def _constraint_fields(self) -> dict[str, dict[str, Any] | None]:
        """Each field that can constrain the output -> its StructuredOutputsParams arguments."""
        so = self.structured_outputs
        fields = {"response_format": _response_format_constraint(self.response_format),
                  "structured_outputs": so.model_dump(by_alias=True, exclude_none=True) if so is not None else None}
        for field, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                            ("guided_grammar", "grammar"), ("grammar", "grammar"), ("json_schema", "json")):
            value = getattr(self, field)
            fields[field] = {kind: value} if value is not None else None
        return fields


def _response_format_constraint(fmt: ResponseFormat | None) -> dict[str, Any] | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_schema" and fmt.json_schema is not None and fmt.json_schema.schema_ is not None:
        return {"json": fmt.json_schema.schema_}
    return {"json_object": True}


def _token_id_keys(logit_bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias keys are token ids written as JSON strings."""
    if logit_bias is None:
        return {}
    bad = [key for key in logit_bias if not (key.isascii() and key.isdigit() and len(key) <= 10)]
    if bad:
        raise InvalidRequestError("logit_bias", f"logit_bias keys must be token ids, got {bad[0][:40]!r}")
    return {int(key): bias for key, bias in logit_bias.items()}


class Choice(BaseModel):
    """What a completion's and a chat completion's choices share, vLLM's fields included."""
    index: int
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: str | None = None  # vLLM's: the stop string that ended it
    token_ids: list[int] | None = None  # vLLM's, with return_token_ids


class ChunkStream:
    """OpenAI's stream of chunk objects: a chunk per choice's delta, with usage so far where
    stream_options asks for it on every chunk (vLLM's continuous_usage_stats), the whole usage in
    a last chunk where it asks for include_usage, then [DONE]."""

    def __init__(self, response_id: str, object_name: str, model: str, options: StreamOptions | None, tally: Tally):
        self.response_id, self.object_name, self.model, self.tally = response_id, object_name, model, tally
        self.created = int(time.time())
        self.include_usage = bool(options and options.include_usage)
        self.continuous_usage = bool(options and options.include_usage and options.continuous_usage_stats)

    def chunk(self, choice: dict[str, Any], fields: dict[str, Any] | None = None) -> str:
        """A chunk of one choice's delta; `fields`: the chunk's own beside it."""
        event: dict[str, Any] = {"id": self.response_id, "object": self.object_name, "created": self.created,
                                 "model": self.model, "choices": [choice], **(fields or {})}
        if self.include_usage:
            event["usage"] = self.tally.usage().model_dump() if self.continuous_usage else None
        return sse_event(event)

    def end(self) -> str:
        if not self.include_usage:
            return SSE_DONE
        return sse_event({"id": self.response_id, "object": self.object_name, "created": self.created,
                          "model": self.model, "choices": [], "usage": self.tally.usage().model_dump()}) + SSE_DONE

    @staticmethod
    def error(error: APIError) -> str:
        return sse_event(error.body()) + SSE_DONE


PromptLogprobs = list[tuple[int, dict[int, float] | None]]  # (token, it and its top logprobs), None for the first


class Tokens:
    """Tokens as a response shows them: decoded, or with return_tokens_as_token_ids as
    'token_id:{id}', so that a token no text can hold is still told apart (vLLM's)."""

    def __init__(self, tokenizer: Any, as_ids: bool):
        self.tokenizer, self.as_ids = tokenizer, as_ids

    def __call__(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_ids else self.tokenizer.decode([token_id])

    @staticmethod
    def top(entries: dict[int, float], k: int | None = None) -> list[tuple[int, float]]:
        """A token's candidates, the likeliest first (the first k)."""
        return sorted(entries.items(), key=lambda kv: -kv[1])[:k]

    def entry(self, token_id: int, logprob: float | None) -> dict[str, Any]:
        """A token as chat completions' and the Responses API's logprobs show it."""
        token = self(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    def entries(self, pairs: Iterable[tuple[int, dict[int, float]]], k: int) -> list[dict[str, Any]]:
        """Each token's entry with its k likeliest candidates' (`top_logprobs`)."""
        return [self.entry(token_id, candidates.get(token_id))
                | {"top_logprobs": [self.entry(t, lp) for t, lp in self.top(candidates, k)]}
                for token_id, candidates in pairs]

    def prompt_logprobs(self, pairs: PromptLogprobs, k: int) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's prompt_logprobs: per prompt token (None for the first) each of the token and its
        k likeliest alternatives by id, with its logprob, its rank (known for those k; the token's
        own when among them) and its text."""
        shown: list[dict[str, dict[str, Any]] | None] = []
        for token_id, entries in pairs:
            if entries is None:
                shown.append(None)
                continue
            ranked = self.top(entries)
            shown.append({str(t): {"logprob": lp, "rank": i + 1 if i < k else None, "decoded_token": self(t)}
                          for i, (t, lp) in enumerate(ranked) if i < k or t == token_id})
        return shown
