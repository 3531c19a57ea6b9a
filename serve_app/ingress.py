"""OpenAI-compatible ingress: parse, validate, admit, stream, map errors.

Owns: the FastAPI app (`Ingress.build_asgi_app`), auth, body limits, prompt counting for
admission (the engine's tokenizer, loaded from the path a replica reports), the per-request
flow `admit at router -> stream from the named replica -> release`, and SSE framing.
Does not own: sampling, tokenization for generation (the replica/engine does it), queueing.

`router` and `replicas` are DeploymentHandles in Serve, or `serve_app.local` shims in tests;
the code path is the same.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError

from serve_app.config import AppConfig
from serve_app.formatting import ChatFormatter, CompletionFormatter, Formatter
from serve_app.messages import AdmitRequest, EngineRequest, ModelInfo, StreamChunk
from serve_app.protocol import (
    SSE_DONE,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    model_list,
    sse_event,
)

logger = logging.getLogger("cbserve.ingress")
_MAX_PREFIX_BLOCKS = 32


class PromptTokenizer:
    """Counts prompt tokens the way the engine will (same tokenizer files)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    @classmethod
    def from_path(cls, path: str) -> "PromptTokenizer":
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def encode_chat(self, messages: list[dict]) -> list[int]:
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(out, "keys") and "input_ids" in out:
            out = out["input_ids"]
        return list(out)

    def token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


def prefix_hashes(token_ids: list[int], block_size: int) -> tuple[int, ...]:
    """Chained hashes of the prompt's first full blocks (the router's affinity key)."""
    hashes, parent = [], 0
    for start in range(0, min(len(token_ids), _MAX_PREFIX_BLOCKS * block_size), block_size):
        block = token_ids[start : start + block_size]
        if len(block) < block_size:
            break
        parent = hash((parent, tuple(block)))
        hashes.append(parent)
    return tuple(hashes)


@dataclass
class _Job:
    """One engine request (one prompt, n choices) of an HTTP request."""

    engine_request: EngineRequest
    admit: AdmitRequest
    choice_offset: int  # this job's choice indices start here in the response


class _JobStream:
    """admit -> first chunk (errors here become HTTP errors) -> remaining chunks -> release."""

    def __init__(self, ingress: "Ingress", job: _Job):
        self.ingress, self.job = ingress, job
        self._gen: Any = None
        self._admitted = False
        self._replica_id: str | None = None
        self.first: StreamChunk | None = None

    async def start(self) -> None:
        result = await self.ingress.router.admit.remote(self.job.admit)
        if result.error is not None:
            e = result.error
            headers = {"Retry-After": str(e.retry_after_s)} if e.retry_after_s else None
            raise APIError(e.status, e.message, e.type, e.param, headers=headers)
        self._admitted = True
        self._replica_id = result.replica_id
        self._gen = self.ingress.replica_streams.generate.remote(
            self.job.engine_request, replica_hint=result.replica_id
        )
        self.first = await self._next()
        if self.first is None:
            raise APIError(503, "replica stream ended before any output", "service_unavailable")
        if self.first.error is not None:
            e = self.first.error
            raise APIError(e.status, e.message, e.type, e.param)

    async def _next(self) -> StreamChunk | None:
        try:
            return await self._gen.__anext__()
        except StopAsyncIteration:
            return None
        except asyncio.CancelledError:
            raise
        except Exception as e:  # replica died / unavailable
            logger.warning("replica stream failed: %r", e)
            self.ingress.call_router_later("remove_replica", self._replica_id)
            raise APIError(503, f"engine replica failed: {type(e).__name__}",
                           "service_unavailable") from None

    async def chunks(self) -> AsyncIterator[StreamChunk]:
        chunk = self.first
        while chunk is not None:
            if chunk.error is not None:
                e = chunk.error
                raise APIError(e.status, e.message, e.type, e.param)
            yield chunk
            if chunk.finished:
                await self._next()  # let the replica's generator end normally
                return
            chunk = await self._next()
        raise APIError(503, "replica stream ended without finishing", "service_unavailable")

    def close(self) -> None:
        if self._gen is not None:
            cancel = getattr(self._gen, "cancel", None)
            if cancel is not None:
                cancel()
        if self._admitted:
            self._admitted = False
            self.ingress.call_router_later("release", self.job.admit.request_id)


class Ingress:
    """The ingress deployment (plain class; app.py wraps it with serve.ingress/deployment)."""

    def __init__(self, config: AppConfig, router: Any, replicas: Any, tokenizer: Any = None):
        self.config = config
        # Data-plane calls (admit, release, token streams) over the gRPC transport when enabled:
        # benchmarks/serve_hops.py measures it at about half the CPU per message.
        rpc = {"_by_reference": False} if config.ingress.grpc_transport else {}
        self.router = router.options(**rpc)
        self.replicas = replicas
        self.replica_streams = replicas.options(stream=True, **rpc)
        self.model_name = config.engine.model_name
        self._tokenizer = PromptTokenizer(tokenizer) if tokenizer is not None else None
        self._model_info: ModelInfo | None = None
        self._info_lock = asyncio.Lock()
        self._background: set[asyncio.Task] = set()
        self._created = int(time.time())

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self.build_asgi_app()

    # ------------------------------------------------------------ helpers

    async def model_info(self) -> tuple[ModelInfo, PromptTokenizer]:
        async with self._info_lock:
            if self._model_info is None:
                info = await self.replicas.model_info.remote()
                if self._tokenizer is None and info.tokenizer is not None:
                    self._tokenizer = PromptTokenizer(info.tokenizer)
                if self._tokenizer is None:
                    if not info.tokenizer_path:
                        raise APIError(500, "replica reported no tokenizer path", "internal_error")
                    self._tokenizer = await asyncio.to_thread(
                        PromptTokenizer.from_path, info.tokenizer_path
                    )
                self._model_info = info
        assert self._tokenizer is not None
        return self._model_info, self._tokenizer

    def call_router_later(self, method: str, arg: str | None) -> None:
        """Fire-and-forget router call (release / remove_replica); survives our cancellation."""

        async def _call() -> None:
            try:
                await getattr(self.router, method).remote(arg)
            except Exception:
                logger.warning("router.%s(%s) failed", method, arg, exc_info=True)

        task = asyncio.ensure_future(_call())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _authorize(self, request: Request) -> None:
        keys = self.config.ingress.api_keys
        if not keys:
            return
        auth = request.headers.get("authorization", "")
        token = auth[7:].strip() if auth.lower().startswith("bearer ") else None
        if token not in keys:
            raise APIError(401, "Invalid or missing API key (use 'Authorization: Bearer <key>').",
                           "invalid_request_error", code="invalid_api_key")

    async def _read_json(self, request: Request) -> Any:
        limit = self.config.ingress.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"Request body of {declared} bytes exceeds the limit of {limit} "
                                "bytes.", code="request_too_large")
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > limit:
                raise APIError(413, f"Request body exceeds the limit of {limit} bytes.",
                               code="request_too_large")
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"Malformed JSON body: {e}") from None
        if not isinstance(data, dict):
            raise APIError(400, "The request body must be a JSON object.")
        return data

    def _parse(self, model_cls: type[BaseModel], data: dict) -> Any:
        try:
            return model_cls.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith(("function-", "list[")))
            msg = err["msg"].removeprefix("Value error, ")
            raise APIError(400, f"Invalid value for '{loc}': {msg}" if loc else msg,
                           param=loc or None) from None

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model '{model}' does not exist; this server serves "
                                f"'{self.model_name}'.", code="model_not_found", param="model")

    def _make_job(self, base_id: str, i: int, req: Any, prompt: Any, messages: Any,
                  prompt_ids: list[int], info: ModelInfo, max_tokens: int | None,
                  default_max_tokens: int, num_logprobs: int | None) -> _Job:
        num_prompt = len(prompt_ids)
        if num_prompt == 0:
            raise APIError(400, "The prompt is empty after tokenization.", param="prompt")
        limit = info.max_model_len
        if max_tokens is None:
            max_tokens = min(default_max_tokens, limit - num_prompt)
        if num_prompt + max_tokens > limit or max_tokens < 1:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt + max(max_tokens, 1)} tokens ({num_prompt} in the prompt, "
                f"{max(max_tokens, 1)} in the completion). Please reduce the prompt or max_tokens.",
                param="messages" if messages is not None else "prompt",
                code="context_length_exceeded",
            )
        request_id = f"{base_id}-{i}"
        engine_request = EngineRequest(
            request_id, prompt, messages, req.sampling_kwargs(max_tokens, num_logprobs), req.priority
        )
        admit = AdmitRequest(request_id, req.priority, num_prompt, req.n * max_tokens,
                             prefix_hashes(prompt_ids, info.block_size))
        return _Job(engine_request, admit, i * req.n)

    # ------------------------------------------------------------ request flow

    async def _run(self, jobs: list[_Job], fmt: Formatter, stream: bool):
        streams = [_JobStream(self, job) for job in jobs]
        try:
            starts = [asyncio.ensure_future(s.start()) for s in streams]
            try:
                await asyncio.gather(*starts)
            except BaseException:
                for t in starts:
                    t.cancel()
                await asyncio.gather(*starts, return_exceptions=True)
                raise
        except BaseException:
            for s in streams:
                s.close()
            raise
        if not stream:
            try:
                for s, job in zip(streams, jobs):
                    async for chunk in s.chunks():
                        fmt.add(chunk, job.choice_offset)
            finally:
                for s in streams:
                    s.close()
            return JSONResponse(fmt.response())
        return StreamingResponse(self._sse(streams, jobs, fmt), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def _sse(self, streams: list[_JobStream], jobs: list[_Job], fmt: Formatter):
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(s: _JobStream, job: _Job) -> None:
            try:
                async for chunk in s.chunks():
                    await queue.put((job, chunk, None))
            except APIError as e:
                await queue.put((job, None, e))
            finally:
                await queue.put((job, None, None))

        tasks = [asyncio.ensure_future(pump(s, j)) for s, j in zip(streams, jobs)]
        try:
            remaining = len(tasks)
            while remaining:
                job, chunk, error = await queue.get()
                if error is not None:
                    yield sse_event(error.body())
                    yield SSE_DONE
                    return
                if chunk is None:
                    remaining -= 1
                    continue
                for event in fmt.stream_events(chunk, job.choice_offset):
                    yield sse_event(event)
            usage_event = fmt.usage_event()
            if usage_event is not None:
                yield sse_event(usage_event)
            yield SSE_DONE
        finally:
            for t in tasks:
                t.cancel()
            for s in streams:
                s.close()

    async def completions(self, request: Request):
        self._authorize(request)
        req: CompletionRequest = self._parse(CompletionRequest, await self._read_json(request))
        self._check_model(req.model)
        info, tok = await self.model_info()
        base_id = f"cmpl-{uuid.uuid4().hex}"
        jobs = []
        for i, prompt in enumerate(req.prompts()):
            ids = tok.encode(prompt) if isinstance(prompt, str) else list(prompt)
            jobs.append(self._make_job(base_id, i, req, prompt, None, ids, info, req.max_tokens,
                                       self.config.ingress.default_completion_max_tokens,
                                       req.logprobs))
        fmt = CompletionFormatter(base_id, self.model_name, req, tok, len(jobs) * req.n)
        return await self._run(jobs, fmt, req.stream)

    async def chat_completions(self, request: Request):
        self._authorize(request)
        req: ChatCompletionRequest = self._parse(ChatCompletionRequest,
                                                 await self._read_json(request))
        self._check_model(req.model)
        info, tok = await self.model_info()
        messages = [m.as_template_dict() for m in req.messages]
        try:
            ids = tok.encode_chat(messages)
        except Exception as e:
            raise APIError(400, f"Could not apply the chat template: {e}", param="messages")
        base_id = f"chatcmpl-{uuid.uuid4().hex}"
        job = self._make_job(base_id, 0, req, ids, messages, ids, info,
                             req.requested_max_tokens, info.max_model_len, req.num_logprobs)
        fmt = ChatFormatter(base_id, self.model_name, req, tok, req.n)
        return await self._run([job], fmt, req.stream)

    # ------------------------------------------------------------ app

    def build_asgi_app(self) -> FastAPI:
        app = FastAPI(title="cbserve", docs_url=None, redoc_url=None)

        @app.exception_handler(APIError)
        async def _api_error(_: Request, e: APIError) -> JSONResponse:
            return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

        @app.exception_handler(Exception)
        async def _internal(_: Request, e: Exception) -> JSONResponse:
            logger.exception("unhandled error")
            err = APIError(500, f"Internal error: {type(e).__name__}: {e}", "internal_error")
            return JSONResponse(err.body(), status_code=500)

        @app.get("/health")
        async def health() -> dict:
            return {"status": "ok"}

        @app.get("/v1/models")
        async def models(request: Request) -> dict:
            self._authorize(request)
            return model_list(self.model_name, self._created)

        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        return app
