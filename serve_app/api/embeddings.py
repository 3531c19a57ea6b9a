"""OpenAI's embeddings API (`POST /v1/embeddings`): each input's embedding from the loaded model
(engine.sampling_params.PoolingParams: the engine's pooling, L2-normalised, `dimensions` kept),
computed as engine requests through the same admission, priorities and limits as generation.
"""
from __future__ import annotations

import asyncio
import base64
import struct
import uuid
from typing import TYPE_CHECKING, Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import Field, field_validator

from engine.errors import InvalidRequestError
from engine.sampling_params import PoolingParams
from engine.tokenization import all_ints
from serve_app.api.outputs import Tally
from serve_app.api.wire import Route, WireModel
from serve_app.jobs import make_embedding_job
from serve_app.messages import StreamChunk

if TYPE_CHECKING:
    from serve_app.ingress import FrontEnd


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


class EmbeddingsFormatter:
    """The list of embeddings, one per input (each a job of its own), as floats or base64 of
    little-endian float32, as OpenAI's API returns them."""

    def __init__(self, model: str, req: EmbeddingRequest, num_inputs: int):
        self.model, self.req = model, req
        self.tally = Tally(num_inputs)
        self._vectors: dict[int, list[float]] = {}

    def add(self, chunk: StreamChunk, offset: int) -> None:
        self.tally.count(chunk, offset)
        if chunk.embedding is not None:
            self._vectors[offset] = chunk.embedding

    def response(self) -> dict[str, Any]:
        data = [{"object": "embedding", "index": i, "embedding": self._encoded(self._vectors[i])}
                for i in range(self.tally.num_choices)]
        prompt = self.tally.usage().prompt_tokens
        return {"object": "list", "data": data, "model": self.model,
                "usage": {"prompt_tokens": prompt, "total_tokens": prompt}}

    def _encoded(self, vector: list[float]) -> list[float] | str:
        if self.req.encoding_format == "float":
            return vector
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


class EmbeddingsAPI:
    routes = (Route("POST", "/v1/embeddings", "create", (EmbeddingRequest,)),)

    def __init__(self, front: FrontEnd):
        self.front = front

    async def create(self, request: Request) -> JSONResponse:
        """One engine request per input."""
        req, target = await self.front.accept(request, EmbeddingRequest)
        model, inputs = target.model, req.inputs()
        self.front.check_num_prompts(len(inputs), "input")
        base_id = f"embd-{uuid.uuid4().hex}"
        self.front.log_user(base_id, req.user)
        ids = await asyncio.gather(*(model.prompt_ids(x, param="input") for x in inputs))
        pooling = req.pooling_params()
        if pooling.dimensions is not None and pooling.dimensions > model.info.hidden_size:
            raise InvalidRequestError("dimensions", f"dimensions must be at most the model's embedding size "
                                                    f"{model.info.hidden_size}, got {pooling.dimensions}")
        jobs = [make_embedding_job(f"{base_id}-{i}", prompt, target, pooling, i) for i, prompt in enumerate(ids)]
        return JSONResponse(await self.front.complete(jobs, EmbeddingsFormatter(model.name, req, len(jobs)), target))
