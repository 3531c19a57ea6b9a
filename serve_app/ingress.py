"""OpenAI-compatible ingress: read, validate, tokenize once, admit and stream, map errors.

Owns: the FastAPI app (`FrontEnd.build_asgi_app`), the HTTP edge (content type 415, body size 413
and body timeout 408, JSON that Python cannot take or that holds invalid Unicode 400, every
error in OpenAI's shape, 404 and 405 included), auth and priorities (serve_app.auth), readiness
(`/health`: 503 until an engine replica is ready and the model's info is here), and validation
with the engine's own rules: each prompt is templated and tokenized here, once, with the
engine's tokenizer (ModelInfo), off the event loop (serve_app.batch_tokenizer), and the engine
gets the token ids. Does not own: the jobs' flow (jobs.py), admission (serve_app.admission: the
router in this process or the Router deployment), the replicas (serve_app.replicas: in this
process or the EngineReplica deployment), sampling. What those are is the graph's shape, chosen
in app.py and put together by serve_app.frontend.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException

from engine.chat_output import ChatOutputParser
from engine.errors import InvalidRequestError
from engine.gc_settings import collect_young_less_often
from engine.tokenization import check_token_ids
from serve_app.admission import Admission
from serve_app.anthropic_api import CountTokensRequest, MessagesFormatter, MessagesRequest
from serve_app.anthropic_api import error_body as anthropic_error
from serve_app.auth import Authorizer, resolve_priority
from serve_app.config import AppConfig
from serve_app.embeddings_api import EmbeddingRequest, EmbeddingsFormatter
from serve_app.formatting import ChatFormatter, CompletionFormatter
from serve_app.jobs import Adapter, Job, check_fits_queue, complete, make_embedding_job, make_job, respond
from serve_app.messages import ModelInfo
from serve_app.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoraAdapterRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    UnloadLoraAdapterRequest,
    model_card,
)
from serve_app.proxy import CancelOnDisconnect
from serve_app.replicas import Replicas
from serve_app.responses_api import (
    ResponsesFormatter,
    ResponsesRequest,
    ResponseStore,
    StoredResponse,
    chat_messages,
    output_history,
    stored_items,
)
from serve_app.served_model import ServedModel
from serve_app.shared_port import SharedPortServer

logger = logging.getLogger("cbserve.ingress")
_BODIES: dict[str, tuple[type[BaseModel], ...]] = {
           "/v1/completions": (CompletionRequest,), "/v1/chat/completions": (ChatCompletionRequest,),
           "/v1/responses": (ResponsesRequest,), "/v1/messages": (MessagesRequest,),
           "/v1/messages/count_tokens": (CountTokensRequest,), "/v1/embeddings": (EmbeddingRequest,),
           "/tokenize": (TokenizeCompletionRequest, TokenizeChatRequest), "/detokenize": (DetokenizeRequest,)}


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


class FrontEnd:
    """The OpenAI front end over an admission and the engine replicas."""

    def __init__(self, config: AppConfig, admission: Admission, replicas: dict[str, Replicas]):
        """`replicas`: each served model's, by its name."""
        collect_young_less_often()  # each request's objects live as long as it does (Serve freezes the rest)
        self.config = config
        self.admission = admission
        self.models = {m.model_name: ServedModel(m, replicas[m.model_name]) for m in config.served_models}
        self.default_model = next(iter(self.models.values()))  # a request that names no model gets it
        self.auth = Authorizer(config.ingress, config.router)
        self._created = int(time.time())
        self.responses = ResponseStore(config.ingress.max_stored_responses, config.ingress.num_replicas)

    # ------------------------------------------------------------ helpers

    async def check_health(self) -> None:
        """Serve's periodic check: the admission's and the replicas' in this process, then each
        model's info loaded once an engine replica of it is ready. A failure to load it is logged,
        not raised: it is no fault of this replica."""
        await self.admission.check_health()
        for model in self.models.values():
            await model.replicas.check_health()
        if all(model.has_info for model in self.models.values()):
            return
        try:
            ready = await self.admission.ready_replicas()
            for model in self.models.values():
                if ready.get(model.name):
                    await model.load_info()
        except Exception:
            logger.warning("loading a model's info failed; the next request tries again", exc_info=True)

    async def _read_json(self, request: Request) -> dict:
        if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
            raise APIError(415, "The request body must be JSON, sent with 'Content-Type: application/json'.",
                           code="unsupported_media_type")
        limit = self.config.ingress.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"Request body of {declared} bytes exceeds the limit of {limit} bytes.",
                           code="request_too_large")
        try:  # a timeout scope, not wait_for: no task of its own, so no turns of the loop to start and end it
            async with asyncio.timeout(self.config.ingress.body_timeout_s):
                body = await self._read_body(request, limit)
        except TimeoutError:
            raise APIError(408, f"The request body was not received within "
                                f"{self.config.ingress.body_timeout_s:g} s.", code="request_timeout") from None
        try:
            data = json.loads(body, parse_constant=_refuse_constant)
            json.dumps(data, ensure_ascii=False).encode("utf-8")  # lone surrogates cannot be text
        except (ValueError, RecursionError, UnicodeError) as e:  # bad JSON, a 5,000-digit int, deep nesting
            raise APIError(400, f"Malformed JSON body: {type(e).__name__}: {str(e)[:200]}") from None
        if not isinstance(data, dict):
            raise APIError(400, "The request body must be a JSON object.")
        return data

    @staticmethod
    async def _read_body(request: Request, limit: int) -> bytes:
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > limit:
                raise APIError(413, f"Request body exceeds the limit of {limit} bytes.", code="request_too_large")
        return bytes(body)

    def _parse(self, model_cls: type[BaseModel], data: dict) -> Any:
        """The body as `model_cls`, or a 400 naming the first field at fault. Fields no model
        declares are refused, or with ingress.ignore_unknown_fields dropped and logged."""
        try:
            return model_cls.model_validate(data)
        except ValidationError as e:
            errors = e.errors()
        unknown = [err["loc"] for err in errors if err["type"] == "extra_forbidden"]
        if self.config.ingress.ignore_unknown_fields and any([_drop(data, loc) for loc in unknown]):
            logger.info("ignored unknown request fields: %s", ", ".join(map(_field_name, unknown)))
            return self._parse(model_cls, data)  # the body shrank: this ends
        err = errors[0]
        loc = _field_name(err["loc"])
        if err["type"] == "extra_forbidden":
            raise APIError(400, f"Unrecognized request argument supplied: {loc}", param=loc)
        msg = err["msg"].removeprefix("Value error, ")
        raise APIError(400, f"Invalid value for '{loc}': {msg}" if loc else msg, param=loc or None) from None

    def _model(self, model: str | None) -> tuple[ServedModel, Adapter]:
        """The served model a request's `model` names, and the LoRA adapter (`base:adapter`, or the
        adapter's own name) with its path where it was loaded at run time ((None, None): the base
        model). A 404 for a model nothing here serves (a name under adapter_dirs is the engine's to
        find)."""
        if model is None:
            return self.default_model, (None, None)
        served = self.models.get(model)
        if served is not None:
            return served, (None, None)
        base, colon, name = model.rpartition(":")
        candidates = ([self.models[base]] if base in self.models else []) if colon else list(self.models.values())
        for served in candidates:  # an adapter a model holds, then one a model's adapter_dirs may hold
            if name in served.adapters and served.may_serve_adapter(name):
                return served, served.adapter(name)
        for served in candidates:
            if served.may_serve_adapter(name):
                return served, served.adapter(name)
        names = ", ".join(f"'{n}'" for m in self.models.values() for n in [m.name, *m.adapters])
        raise APIError(404, f"The model '{model}' does not exist; this server serves {names}.",
                       code="model_not_found", param="model")

    def _adapter_home(self, lora_name: str) -> tuple[ServedModel, str]:
        """The model a load or unload names (`base:adapter`; a bare name: the one model that serves
        adapters, else the one that holds it) and the adapter's name."""
        base, colon, name = lora_name.rpartition(":")
        if colon and base in self.models:
            return self.models[base], name
        with_lora = [m for m in self.models.values() if m.lora.enable_lora]
        holders = [m for m in with_lora if lora_name in m.adapters]
        if len(holders) == 1 or len(with_lora) == 1:
            return (holders or with_lora)[0], lora_name
        if not with_lora:
            raise APIError(400, "No model of this server serves LoRA adapters (engine_args.enable_lora).",
                           param="lora_name")
        names = ", ".join(f"'{m.name}:{lora_name}'" for m in with_lora)
        raise APIError(400, f"Several models serve LoRA adapters: name the base, as one of {names}.",
                       param="lora_name")

    async def _model_card(self, model: ServedModel, adapter: str | None = None) -> dict:
        info = await model.load_info()
        if adapter is not None:
            return model_card(adapter, self._created, model.adapters.get(adapter, adapter), info.max_model_len,
                              parent=model.name)
        return model_card(model.name, self._created, model.config.model or model.name, info.max_model_len)

    async def _accept(self, request: Request, model_cls: type[BaseModel]
                      ) -> tuple[Any, int, ServedModel, Adapter]:
        """Auth, body, parse, model name, priority: the parsed request, its priority, the model
        (its info loaded), the LoRA adapter it names."""
        allowed, data = await self._authorized_json(request)
        req, model, adapter = await self._validated(model_cls, data)
        return req, resolve_priority(req.priority, allowed), model, adapter

    async def _authorized_json(self, request: Request) -> tuple[Any, dict]:
        """What the caller's key allows, and the body."""
        return self._authorize(request), await self._read_json(request)

    def _authorize(self, request: Request) -> Any:
        return self.auth.authorize(request.headers.get("authorization"), request.headers.get("x-api-key"))

    async def _validated(self, model_cls: type[BaseModel], data: dict) -> tuple[Any, ServedModel, Adapter]:
        """The body as `model_cls`, the model it names (its info loaded), and the LoRA adapter the
        model name names."""
        req = self._parse(model_cls, data)
        model, adapter = self._model(req.model)
        await model.load_info()
        return req, model, adapter

    # ------------------------------------------------------------ routes

    async def completions(self, request: Request):
        req, priority, model, adapter = await self._accept(request, CompletionRequest)
        info = model.info
        prompts = req.prompts()
        limit = min(self.config.ingress.max_prompts_per_request, self.config.router.max_queued_requests)
        if len(prompts) > limit:
            raise APIError(400, f"A request may hold at most {limit} prompts, got {len(prompts)}.",
                           param="prompt", code="too_many_prompts")
        base_id = f"cmpl-{uuid.uuid4().hex}"
        _log_user(base_id, req)
        prompt_ids = ([await model.prompt_ids(prompts[0])] if len(prompts) == 1
                      else await asyncio.gather(*map(model.prompt_ids, prompts)))  # a batch's texts together
        jobs = [make_job(f"{base_id}-{i}", ids, req=req, info=info, max_tokens=req.max_tokens,
                         default_max_tokens=self.config.ingress.default_completion_max_tokens,
                         num_logprobs=req.logprobs, priority=priority, choice_offset=i * req.n, param="prompt",
                         adapter=adapter)
                for i, ids in enumerate(prompt_ids)]
        check_fits_queue(jobs, self.config.router.max_queued_tokens)
        fmt = CompletionFormatter(base_id, req.model or model.name, req, info.tokenizer, len(jobs) * req.n)
        return await respond(jobs, fmt, req.stream, self.admission, model.replicas)

    async def _chat_job(self, model: ServedModel, job_id: str, req: Any, messages: list[dict], template_kwargs: dict,
                        max_tokens: int | None, num_logprobs: int | None, priority: int, param: str,
                        adapter: Adapter) -> tuple[Job, Callable[[], ChatOutputParser]]:
        """One chat turn's job (chat completions, Responses, Messages): `messages` through the
        template with `req`'s tools (offered_tools, chosen_tool, forced), its parameters a chat
        turn's in the model's format (engine.chat_output), and the parser its output is read with."""
        calls, forced, info = req.chosen_tool != "none", req.forced, model.info
        text, ids = await model.chat_prompt(messages, req.offered_tools, template_kwargs=template_kwargs)
        job = make_job(job_id, ids, req=req, info=info, max_tokens=max_tokens, default_max_tokens=info.max_model_len,
                       num_logprobs=num_logprobs, priority=priority, choice_offset=0, param=param,
                       chat_turn=lambda params: info.chat_format.sampling_params(params, text, forced, calls),
                       adapter=adapter)
        check_fits_queue([job], self.config.router.max_queued_tokens)
        return job, lambda: info.chat_format.parser(text, calls)

    async def chat_completions(self, request: Request):
        req, priority, model, adapter = await self._accept(request, ChatCompletionRequest)
        base_id = f"chatcmpl-{uuid.uuid4().hex}"
        _log_user(base_id, req)
        job, parser = await self._chat_job(model, f"{base_id}-0", req, req.template_messages(), req.template_kwargs,
                                           req.requested_max_tokens, req.num_logprobs, priority, "messages", adapter)
        fmt = ChatFormatter(base_id, req.model or model.name, req, model.info.tokenizer, req.n, output_parser=parser)
        return await respond([job], fmt, req.stream, self.admission, model.replicas)

    async def create_response(self, request: Request):
        """OpenAI's Responses API (serve_app.responses_api): one chat turn over the items given,
        after a kept response's conversation where previous_response_id names one."""
        req, priority, model, adapter = await self._accept(request, ResponsesRequest)
        info = model.info
        response_id = f"resp_{uuid.uuid4().hex}"
        _log_user(response_id, req)
        items = req.input_items()
        history = self.responses.get(req.previous_response_id, "previous_response_id").history \
            if req.previous_response_id is not None else []
        conversation = history + chat_messages(items)
        instructions = [{"role": "system", "content": req.instructions}] if req.instructions else []
        if not conversation:
            raise APIError(400, "input must hold at least one item", param="input")
        job, parser = await self._chat_job(model, response_id, req, instructions + conversation,
                                           req.template_kwargs(_template(info)), req.max_output_tokens, None, priority,
                                           "input", adapter)
        kept = StoredResponse({}, [], stored_items(items))

        def keep(body: dict, blocks: list) -> None:
            kept.body, kept.history = body, conversation + [output_history(blocks)]

        fmt = ResponsesFormatter(response_id, req.model or model.name, req, info.tokenizer, parser, keep)
        if req.store:
            self.responses.put(response_id, kept)
        if req.background:
            kept.body = fmt.skeleton("queued")
            kept.task = asyncio.ensure_future(self._background(job, fmt, kept, model.replicas))
            return JSONResponse(kept.body)
        return await respond([job], fmt, req.stream, self.admission, model.replicas)

    async def _background(self, job: Job, fmt: ResponsesFormatter, kept: StoredResponse, replicas: Replicas) -> None:
        """A background response run to its end in this process, its state kept as it goes."""
        kept.body = fmt.skeleton("in_progress")
        try:
            await complete([job], fmt, self.admission, replicas)
        except asyncio.CancelledError:
            kept.body = fmt.skeleton("cancelled")
        except APIError as e:
            kept.body = fmt.skeleton("failed") | {"error": {"code": e.code or "server_error", "message": e.message}}
        except Exception as e:
            logger.exception("background response %s failed", fmt.response_id)
            kept.body = fmt.skeleton("failed") | {"error": {"code": "server_error", "message": type(e).__name__}}
        finally:
            kept.task = None

    async def create_message(self, request: Request):
        """Anthropic's Messages API (serve_app.anthropic_api); its errors in Anthropic's shape."""
        req, priority, model, adapter = await self._accept(request, MessagesRequest)
        message_id = f"msg_{uuid.uuid4().hex}"
        job, parser = await self._chat_job(model, message_id, req, req.chat_messages(),
                                           req.template_kwargs(_template(model.info)), req.max_tokens, None, priority,
                                           "messages", adapter)
        fmt = MessagesFormatter(message_id, req.model, req, model.info.tokenizer, parser)
        return await respond([job], fmt, req.stream, self.admission, model.replicas)

    async def count_message_tokens(self, request: Request) -> dict:
        """Anthropic's count_tokens: the prompt tokens a Messages request would take."""
        _, data = await self._authorized_json(request)
        req, model, _ = await self._validated(CountTokensRequest, data)
        _, ids = await model.chat_prompt(req.chat_messages(), req.offered_tools,
                                         template_kwargs=req.template_kwargs(_template(model.info)))
        return {"input_tokens": len(ids)}

    async def create_embeddings(self, request: Request):
        """OpenAI's embeddings API (serve_app.embeddings_api): one engine request per input."""
        req, priority, model, adapter = await self._accept(request, EmbeddingRequest)
        info, inputs = model.info, req.inputs()
        limit = min(self.config.ingress.max_prompts_per_request, self.config.router.max_queued_requests)
        if len(inputs) > limit:
            raise APIError(400, f"A request may hold at most {limit} inputs, got {len(inputs)}.", param="input",
                           code="too_many_inputs")
        base_id = f"embd-{uuid.uuid4().hex}"
        _log_user(base_id, req)
        ids = await asyncio.gather(*(model.prompt_ids(x, param="input") for x in inputs))
        pooling = req.pooling_params()
        if pooling.dimensions is not None and pooling.dimensions > info.hidden_size:
            raise InvalidRequestError("dimensions", f"dimensions must be at most the model's embedding size "
                                                    f"{info.hidden_size}, got {pooling.dimensions}")
        jobs = [make_embedding_job(f"{base_id}-{i}", prompt, info=info, pooling=pooling, priority=priority,
                                   index=i, adapter=adapter) for i, prompt in enumerate(ids)]
        check_fits_queue(jobs, self.config.router.max_queued_tokens)
        return JSONResponse(await complete(jobs, EmbeddingsFormatter(model.name, req, len(jobs)), self.admission,
                                           model.replicas))

    async def tokenize(self, request: Request) -> dict:
        """vLLM's /tokenize: a prompt (completion form) or messages through the chat template."""
        _, data = await self._authorized_json(request)
        req, model, _ = await self._validated(TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest,
                                              data)
        info = model.info
        if isinstance(req, TokenizeChatRequest):
            _, ids = await model.chat_prompt(req.template_messages(), req.offered_tools, req.add_generation_prompt,
                                             req.chat_template_kwargs)
        else:
            ids = await model.encode(req.prompt, req.add_special_tokens)
        body = {"count": len(ids), "max_model_len": info.max_model_len, "tokens": ids}
        if req.return_token_strs:
            body["token_strs"] = info.tokenizer.convert_ids_to_tokens(ids)
        return body

    async def detokenize(self, request: Request) -> dict:
        _, data = await self._authorized_json(request)
        req, model, _ = await self._validated(DetokenizeRequest, data)
        info = model.info
        check_token_ids(req.tokens, info.vocab_size, "tokens", "tokens")
        return {"prompt": info.tokenizer.decode(req.tokens)}

    async def health(self) -> JSONResponse:
        """Ready when the router knows, for every model, an engine replica that takes requests, and
        this ingress holds each model's info."""
        try:
            counts = await asyncio.wait_for(self.admission.ready_replicas(), 5)
            ready = {name: counts.get(name, 0) for name in self.models}
            for model in self.models.values():
                if ready[model.name]:
                    await asyncio.wait_for(model.load_info(), 5)
        except Exception as e:
            logger.warning("health: router or engine replica unreachable: %r", e)
            ready = dict.fromkeys(self.models, 0)
        waiting = [name for name, n in ready.items() if not n]
        if not waiting:
            return JSONResponse({"status": "ok", "ready_replicas": sum(ready.values()), "models": ready})
        names = ", ".join(f"'{name}'" for name in waiting)
        return JSONResponse(APIError(503, f"no engine replica is ready for {names}", "service_unavailable").body(),
                            status_code=503)

    # ------------------------------------------------------------ app

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: FastAPI) -> AsyncGenerator[None, None]:
        """Where `ingress.shared_port` is set, the app is served there too from its start (Serve
        starts it once the replica is built) and drained at its shutdown (Serve's, before it ends
        the replica): new connections go to the replicas still listening, and the requests in
        flight, which Serve does not count as this replica's, finish."""
        if self.config.ingress.shared_port is None:
            yield
            return
        shared = SharedPortServer(app, self.config.ingress.shared_port)
        try:
            yield
        finally:
            await shared.drain()

    def build_asgi_app(self) -> FastAPI:
        app = FastAPI(title="cbserve", docs_url=None, redoc_url=None, openapi_url=None, lifespan=self._lifespan)
        app.add_middleware(CancelOnDisconnect)

        def answer(request: Request, e: APIError, headers: dict | None = None) -> JSONResponse:
            """The error in the shape of the API the request was for: Anthropic's, or OpenAI's."""
            body = anthropic_error(e) if request.url.path.startswith("/v1/messages") else e.body()
            return JSONResponse(body, status_code=e.status, headers=headers)

        @app.exception_handler(APIError)
        async def _api_error(request: Request, e: APIError) -> JSONResponse:
            return answer(request, e, e.headers)

        @app.exception_handler(InvalidRequestError)
        async def _invalid(request: Request, e: InvalidRequestError) -> JSONResponse:  # the engine's rules refuse it
            return answer(request, APIError.from_invalid(e))

        @app.exception_handler(HTTPException)
        async def _http_error(request: Request, e: HTTPException) -> JSONResponse:  # 404, 405 from routing
            err = APIError(e.status_code, str(e.detail), code="not_found" if e.status_code == 404 else None)
            return answer(request, err, getattr(e, "headers", None))

        @app.exception_handler(Exception)
        async def _internal(request: Request, e: Exception) -> JSONResponse:
            logger.exception("unhandled error")
            return answer(request, APIError(500, f"Internal error: {type(e).__name__}", "internal_error"))

        # Routes are matched in the order they are added: the requests that come most, first.
        for path, endpoint in (("/v1/completions", self.completions), ("/v1/chat/completions", self.chat_completions),
                               ("/v1/responses", self.create_response), ("/v1/messages", self.create_message),
                               ("/v1/embeddings", self.create_embeddings),
                               ("/v1/messages/count_tokens", self.count_message_tokens)):
            app.add_api_route(path, endpoint, methods=["POST"])

        @app.get("/v1/responses/{response_id}")
        async def get_response(response_id: str, request: Request) -> dict:
            self._authorize(request)
            return self.responses.get(response_id, "response_id").body

        @app.delete("/v1/responses/{response_id}")
        async def delete_response(response_id: str, request: Request) -> dict:
            self._authorize(request)
            kept = self.responses.delete(response_id)
            if kept.task is not None:
                kept.task.cancel()
            return {"id": response_id, "object": "response", "deleted": True}

        @app.post("/v1/responses/{response_id}/cancel")
        async def cancel_response(response_id: str, request: Request) -> dict:
            self._authorize(request)
            kept = self.responses.get(response_id, "response_id")
            if kept.task is None:
                raise APIError(400, f"Response '{response_id}' is not a background response still running: only "
                                    "those can be cancelled.", param="response_id")
            kept.task.cancel()
            await asyncio.gather(kept.task, return_exceptions=True)
            return kept.body

        @app.get("/v1/responses/{response_id}/input_items")
        async def input_items(response_id: str, request: Request) -> dict:
            self._authorize(request)
            items = self.responses.get(response_id, "response_id").input_items
            return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
                    "last_id": items[-1]["id"] if items else None, "has_more": False}

        @app.get("/v1/models")
        async def models(request: Request) -> dict:
            self._authorize(request)
            cards = [await self._model_card(model, name) for model in self.models.values()
                     for name in [None, *model.adapters]]
            return {"object": "list", "data": cards}

        @app.get("/v1/models/{model_id:path}")
        async def model(model_id: str, request: Request) -> dict:
            self._authorize(request)
            served, (name, _) = self._model(model_id)
            if name is not None and name not in served.adapters:  # one adapter_dirs may hold: not known until used
                raise APIError(404, f"The model '{model_id}' is not loaded.", code="model_not_found", param="model")
            return await self._model_card(served, name)

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: Request) -> PlainTextResponse:
            _, data = await self._authorized_json(request)
            req = self._parse(LoadLoraAdapterRequest, data)
            model, name = self._adapter_home(req.lora_name)
            model.load_adapter(name, req.lora_path)
            return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: Request) -> PlainTextResponse:
            _, data = await self._authorized_json(request)
            lora_name = self._parse(UnloadLoraAdapterRequest, data).lora_name
            model, name = self._adapter_home(lora_name)
            model.unload_adapter(name)
            return PlainTextResponse(f"Success: LoRA adapter '{lora_name}' removed successfully.")

        @app.get("/version")
        async def version() -> dict:
            return {"version": importlib.metadata.version("cbserve")}

        schema: dict = {}  # built on first request: the routes are all registered by then

        @app.get("/openapi.json", include_in_schema=False)
        async def openapi(request: Request) -> dict:
            self._authorize(request)
            if not schema:
                schema.update(openapi_schema(app))
            return schema

        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/tokenize", self.tokenize, methods=["POST"])
        app.add_api_route("/detokenize", self.detokenize, methods=["POST"])
        return app


def _template(info: ModelInfo) -> str:
    """The model's chat template: what a request's template variables are checked against."""
    return getattr(info.tokenizer, "chat_template", None) or ""


def _log_user(request_id: str, req: Any) -> None:
    """OpenAI's `user`: an end-user id for abuse monitoring, logged beside the request id."""
    if req.user is not None:
        logger.info("%s from user %r", request_id, req.user[:128])


def _field_name(loc: tuple) -> str:
    """A validation error's location as the client wrote it (pydantic's union-member tags dropped)."""
    return ".".join(str(p) for p in loc if not str(p).startswith(("function-", "list[")))


def _drop(data: Any, loc: tuple) -> bool:
    """Removes the field at a validation error's location (tags that name no key are skipped);
    False if it is not there."""
    for part in loc[:-1]:
        if isinstance(data, dict) and part in data:
            data = data[part]
        elif isinstance(data, list) and isinstance(part, int) and part < len(data):
            data = data[part]
    if isinstance(data, dict) and loc[-1] in data:
        del data[loc[-1]]
        return True
    return False


def openapi_schema(app: FastAPI) -> dict:
    """FastAPI's schema of the routes, with the request bodies we parse ourselves declared."""
    schema = get_openapi(title="cbserve", version="1", routes=app.routes)
    _, defs = models_json_schema([(m, "validation") for models in _BODIES.values() for m in models],
                                 ref_template="#/components/schemas/{model}")
    schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
    for path, models in _BODIES.items():
        refs = [{"$ref": f"#/components/schemas/{model.__name__}"} for model in models]
        body = {"required": True, "content": {"application/json": {"schema": refs[0] if len(refs) == 1
                                                                   else {"anyOf": refs}}}}
        schema["paths"][path]["post"]["requestBody"] = body
    return schema
