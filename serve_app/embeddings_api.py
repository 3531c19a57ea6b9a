"""OpenAI's embeddings API (`POST /v1/embeddings`): each input's embedding from the loaded model
(engine.sampling_params.PoolingParams: the engine's pooling, L2-normalised, `dimensions` kept),
computed as engine requests through the same admission, priorities and limits as generation.
"""
from __future__ import annotations

import base64
import struct
from typing import Any, Literal

from pydantic import Field, field_validator

from engine.sampling_params import PoolingParams
from engine.tokenization import all_ints
from serve_app.formatting import Formatter
from serve_app.protocol import WireModel


class EmbeddingRequest(WireModel):
    model: str | None = None
    input: Any = Field(description="A string, a list of strings, a list of token ids, or a list of lists of token ids.",
                       json_schema_extra={"anyOf": [
                           {"type": "string"}, {"type": "array", "items": {"type": "string"}},
                           {"type": "array", "items": {"type": "integer"}},
                           {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}}]})
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    priority: int | None = Field(None, description="Lower is served sooner; None: the API key's default.")

    @field_validator("input")
    @classmethod
    def _input_shape(cls, v: Any) -> Any:
        def ids(x: Any) -> bool:
            return isinstance(x, list) and bool(x) and all_ints(x)
        if (isinstance(v, str) and v) or ids(v) or (isinstance(v, list) and v and (
                all(isinstance(p, str) and p for p in v) or all(ids(p) for p in v))):
            return v
        raise ValueError("input must be a non-empty string, a list of non-empty strings, a list of token ids "
                         "(ints), or a list of such lists")

    def inputs(self) -> list[str | list[int]]:
        v = self.input
        return [v] if isinstance(v, str) or all_ints(v) else list(v)

    def pooling_params(self) -> PoolingParams:
        return PoolingParams(dimensions=self.dimensions)


class EmbeddingsFormatter(Formatter):
    """The list of embeddings, one per input (each a job of its own), as floats or base64 of
    little-endian float32, as OpenAI's API returns them."""

    def __init__(self, model: str, req: EmbeddingRequest, num_inputs: int):
        super().__init__("", model, req, None, num_inputs)
        self._vectors: dict[int, list[float]] = {}

    def add(self, chunk: Any, offset: int) -> None:
        self._account(chunk, offset)
        if chunk.embedding is not None:
            self._vectors[offset] = chunk.embedding

    def response(self) -> dict[str, Any]:
        data = [{"object": "embedding", "index": i, "embedding": self._encoded(self._vectors[i])}
                for i in range(self.num_choices)]
        prompt = self.usage().prompt_tokens
        return {"object": "list", "data": data, "model": self.model,
                "usage": {"prompt_tokens": prompt, "total_tokens": prompt}}

    def _encoded(self, vector: list[float]) -> list[float] | str:
        if self.req.encoding_format == "float":
            return vector
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
