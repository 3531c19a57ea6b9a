"""What every API's wire format shares: the error (OpenAI's shape; Anthropic's is its own module's),
strict request bodies, token usage and SSE framing.

A field no request model declares is refused (as OpenAI refuses unknown arguments), so a client
never gets 200 for a feature it asked for and did not get; the ingress may be told to drop such
fields instead (ingress.ignore_unknown_fields).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict

from engine.errors import AdapterNotFoundError, InvalidRequestError
from serve_app.messages import ErrorInfo


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
    def from_info(cls, info: ErrorInfo) -> APIError:
        """An error that crossed a deployment boundary."""
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


class WireModel(BaseModel):
    """Request bodies: strict JSON types as OpenAI's API has them (no "5" for 5, no true for 1,
    no 2.0 for an int); unknown fields refused. Value ranges are the engine's
    (engine.sampling_params), checked when the SamplingParams is built."""

    model_config = ConfigDict(extra="forbid", strict=True)


NOT_TEXT_PARTS = ("image_url", "input_audio", "file", "image", "document")


def refuse_media(content: Any) -> Any:
    """Content parts of a kind no served model reads are refused by name (the text-only models
    served here), before the parts' own validation would name the union it failed."""
    if isinstance(content, list):
        kinds = [part.get("type") for part in content if isinstance(part, dict)]
        if media := next((kind for kind in kinds if kind in NOT_TEXT_PARTS), None):
            raise ValueError(f"{media} input is not supported by this model: it reads text only")
    return content


@dataclass(frozen=True)
class Route:
    """One of an API's routes: its endpoint is the API object's method of that name; `bodies`,
    the request models its body is parsed as (the OpenAPI schema declares them); `error_body`,
    its errors' shape; `documented`: whether the OpenAPI schema lists it."""
    method: str
    path: str
    endpoint: str
    bodies: tuple[type[BaseModel], ...] = ()
    error_body: Callable[[APIError], dict[str, Any]] = APIError.body
    documented: bool = True


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


def sse_event(payload: dict[str, Any]) -> str:
    return f"data: {_COMPACT_JSON.encode(payload)}\n\n"


_COMPACT_JSON = json.JSONEncoder(separators=(",", ":"))  # json.dumps would build one per event


SSE_DONE = "data: [DONE]\n\n"

