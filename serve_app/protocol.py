"""OpenAI wire format: request models, response models, the error body and SSE framing.

Owns: what crosses the HTTP boundary and its validation (field ranges -> 400 at parse time).
Does not own: tokenization, admission, or anything about replicas.
Unknown request fields are ignored (as OpenAI and vLLM do); known fields are range-checked.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

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


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions (incl. vLLM extensions)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM extensions
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    priority: int = 0

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and any(s == "" for s in v) or v == "":
            raise ValueError("stop strings must be non-empty")
        if isinstance(v, list) and len(v) > 16:
            raise ValueError("at most 16 stop strings")
        return v

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_kwargs(self, max_tokens: int, num_logprobs: int | None) -> dict[str, Any]:
        """Keyword arguments for engine.SamplingParams."""
        return dict(
            n=self.n,
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logprobs=num_logprobs,
        )


PromptType = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(_SamplingFields):
    prompt: PromptType
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, v: PromptType) -> PromptType:
        if v == "" or v == [] or (isinstance(v, list) and any(p in ("", []) for p in v)):
            raise ValueError("prompt must not be empty")
        return v

    @model_validator(mode="after")
    def _unsupported(self) -> "CompletionRequest":
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of single prompts (text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def as_template_dict(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# ---------------------------------------------------------------- responses


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> "Usage":
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
    content: str


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


def model_list(model_name: str, created: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "cbserve"}],
    }


# ---------------------------------------------------------------- SSE


def sse_event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"
