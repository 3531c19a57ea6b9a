"""OpenAI wire format: request models, response models, the error body and SSE framing.

Owns: what crosses the HTTP boundary and its type validation (-> 400 at parse time); value
ranges are the engine's SamplingParams'. Does not own: tokenization, admission, or anything
about replicas. A field no model here declares is refused (as OpenAI refuses unknown
arguments), so a client never gets 200 for a feature it asked for and did not get; the
ingress may be told to drop such fields instead (ingress.ignore_unknown_fields).
"""

from __future__ import annotations

import json
import time
from functools import cached_property
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.beam_search import BeamSearchParams
from engine.errors import AdapterNotFoundError, InvalidRequestError
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from engine.tokenization import all_ints
from engine.tools import Tool, forced_tools, parse_tools, resolve_tool_choice

# ---------------------------------------------------------------- errors


class APIError(Exception):
    """An error answered in OpenAI's shape with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}

    @classmethod
    def from_info(cls, info: Any) -> APIError:
        """From a serve_app.messages.ErrorInfo (an error that crossed a deployment boundary)."""
        headers = {"Retry-After": str(info.retry_after_s)} if info.retry_after_s else None
        return cls(info.status, info.message, info.type, info.param, info.code, headers)

    @classmethod
    def from_invalid(cls, error: InvalidRequestError) -> APIError:
        """A 400 for input the engine's rules refuse; a 404 for a LoRA adapter nothing serves."""
        return cls(404 if isinstance(error, AdapterNotFoundError) else 400, str(error), param=error.param,
                   code=error.code)

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code if self.code is not None else self.status,
            }
        }


# ---------------------------------------------------------------- requests


class WireModel(BaseModel):
    """Request bodies: strict JSON types as OpenAI's API has them (no "5" for 5, no true for 1,
    no 2.0 for an int); unknown fields refused. Value ranges are the engine's
    (engine.sampling_params), checked when the SamplingParams is built."""

    model_config = ConfigDict(extra="forbid", strict=True)


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


class _SamplingFields(WireModel):
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

    @model_validator(mode="after")
    def _best_of(self) -> _SamplingFields:
        if self.stream and self.best_of is not None and self.best_of > self.n:
            raise ValueError("best_of > n cannot be streamed: the best choices are known when all are done")
        return self

    @property
    def prompt_logprobs(self) -> int | None:
        """Logprobs asked of the prompt's tokens (completions' echo with logprobs)."""
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk: continuous_usage_stats with include_usage, as vLLM reads them."""
        return bool(self.stream_options and self.stream_options.include_usage
                    and self.stream_options.continuous_usage_stats)

    def sampling_params(self, max_tokens: int, num_logprobs: int | None) -> SamplingParams:
        """The engine's SamplingParams; raises InvalidRequestError naming the field."""
        return SamplingParams(
            n=self.n, max_tokens=max_tokens, temperature=self.temperature, top_k=self.top_k,
            top_p=self.top_p, min_p=self.min_p, seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else self.stop or [],
            stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logprobs=num_logprobs, min_tokens=self.min_tokens,
            logit_bias=_token_id_keys(self.logit_bias), best_of=self.best_of, prompt_logprobs=self.prompt_logprobs,
            structured_outputs=self.output_constraint())

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
                            ("guided_grammar", "grammar")):
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


_NOT_WITH_BEAM_SEARCH = ("top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty",
                         "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "best_of", "logprobs",
                         "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                         "guided_grammar")


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all_ints(value)


class CompletionRequest(_SamplingFields):
    prompt: Any = Field(description="A string, a list of strings, a list of token ids, or a list of "
                                    "lists of token ids.", json_schema_extra={"anyOf": [
                                        {"type": "string"}, {"type": "array", "items": {"type": "string"}},
                                        {"type": "array", "items": {"type": "integer"}},
                                        {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}}]})
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    use_beam_search: bool = Field(False, description="Beam search (vLLM's): n beams, the n best returned, as "
                                                     "transformers' generate(num_beams=n) finds them.")
    length_penalty: float = Field(1.0, description="With use_beam_search: scores are divided by length ** this.")

    @field_validator("prompt")
    @classmethod
    def _prompt_shape(cls, v: Any) -> Any:
        if (isinstance(v, str) and v) or _is_token_ids(v) or (
                isinstance(v, list) and v and (all(isinstance(p, str) and p for p in v)
                                               or all(_is_token_ids(p) for p in v))):
            return v
        raise ValueError("prompt must be a non-empty string, a list of non-empty strings, a list of token "
                         "ids (ints), or a list of such lists")

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self

    @property
    def prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None

    def beam_search_params(self, max_tokens: int) -> BeamSearchParams | None:
        """Refuses a field beam search would not apply (it is deterministic: temperature 0 only)."""
        given = self.model_fields_set
        if not self.use_beam_search:
            if "length_penalty" in given:
                raise InvalidRequestError("length_penalty", "length_penalty applies to beam search only "
                                                            "(use_beam_search)")
            return None
        defaults = type(self).model_fields
        unapplied = [f for f in _NOT_WITH_BEAM_SEARCH if f in given and getattr(self, f) != defaults[f].default]
        if "temperature" in given and self.temperature != 0:
            unapplied.insert(0, "temperature")
        if unapplied:
            raise InvalidRequestError(unapplied[0], f"{unapplied[0]} does not apply to beam search (use_beam_search)")
        return BeamSearchParams(self.n, max_tokens, self.length_penalty, self.ignore_eos)

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of single prompts (text or token ids)."""
        p = self.prompt
        return [p] if isinstance(p, str) or _is_token_ids(p) else list(p)


class ContentPart(WireModel):
    type: Literal["text"]
    text: str


class FunctionCall(WireModel):
    name: str
    arguments: str = Field(description="The arguments as JSON text.")


class ToolCallIn(WireModel):
    """A call the assistant made earlier in the conversation."""
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(WireModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = Field(None, description="An assistant turn's reasoning, as responses return it "
                                                            "(templates that keep earlier reasoning render it).")

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        for name in ("tool_calls", "reasoning_content"):
            if getattr(self, name) is not None and self.role != "assistant":
                raise ValueError(f"{name} is only for assistant messages")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("a tool message needs the tool_call_id it answers, and only a tool message takes one")
        return self

    def as_template_dict(self) -> dict[str, Any]:
        """The message in OpenAI's format, as engine.tokenization.encode_chat takes it."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                                   "content": content or ""}
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:  # as Qwen3's template reads it, and gpt-oss's
            message["reasoning_content"] = message["thinking"] = self.reasoning_content
        return message


class FunctionDefinition(WireModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON schema of the arguments object.")
    strict: bool | None = Field(None, description="Accepted; forced calls always follow the schema.")


class ToolDefinition(WireModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(WireModel):
    name: str


class NamedToolChoice(WireModel):
    type: Literal["function"]
    function: NamedFunction


class _ChatFields(WireModel):
    """The conversation and its tools (chat completions and chat-form /tokenize)."""
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDefinition] | None = None

    @cached_property
    def offered_tools(self) -> list[Tool]:
        """The tools, checked (each parameters schema against its metaschema)."""
        return parse_tools([t.model_dump(exclude_none=True) for t in self.tools or []])

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.as_template_dict() for m in self.messages]


class ChatCompletionRequest(_SamplingFields, _ChatFields):
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = Field(
        None, description="Reaches the chat template as reasoning_effort, where the template takes it.")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="Variables the chat template reads, such "
                                                                          "as enable_thinking (vLLM's).")

    @cached_property
    def chosen_tool(self) -> str:
        """`none`, `auto`, `required`, or the function the output must call."""
        choice = self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedToolChoice) else self.tool_choice
        return resolve_tool_choice(choice, self.offered_tools)

    @property
    def forced(self) -> tuple[list[Tool], bool] | None:
        """The calls a `required` or named tool_choice forces (engine.tools.forced_tools)."""
        return forced_tools(self.offered_tools, self.chosen_tool, self.parallel_tool_calls)

    @property
    def template_kwargs(self) -> dict[str, Any]:
        effort = {"reasoning_effort": self.reasoning_effort} if self.reasoning_effort is not None else {}
        return (self.chat_template_kwargs or {}) | effort

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeCompletionRequest(WireModel):
    """/tokenize, completion form (vLLM's)."""
    model: str | None = None
    prompt: str = Field(min_length=1)
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_ChatFields):
    """/tokenize, chat form: the messages (and tools) through the chat template (vLLM's)."""
    model: str | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="Variables the chat template reads.")


class DetokenizeRequest(WireModel):
    model: str | None = None
    tokens: list[int] = Field(min_length=1)


# ---------------------------------------------------------------- responses


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    reasoning: str | None = None  # vLLM's newer name of reasoning_content: both are sent
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


def model_card(model_name: str, created: int, root: str, max_model_len: int, parent: str | None = None
               ) -> dict[str, Any]:
    """A /v1/models entry, with vLLM's `root` (the checkpoint served, or a LoRA adapter's path),
    `parent` (an adapter's base model) and `max_model_len`."""
    return {"id": model_name, "object": "model", "created": created, "owned_by": "cbserve", "root": root,
            "parent": parent, "max_model_len": max_model_len}


class LoadLoraAdapterRequest(BaseModel):
    """vLLM's /v1/load_lora_adapter body."""
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str


# ---------------------------------------------------------------- SSE


def sse_event(payload: dict[str, Any]) -> str:
    return f"data: {_COMPACT_JSON.encode(payload)}\n\n"


_COMPACT_JSON = json.JSONEncoder(separators=(",", ":"))  # json.dumps would build one per event


SSE_DONE = "data: [DONE]\n\n"
