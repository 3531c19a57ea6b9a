"""The HTTP edge every API shares: read, authorize, validate, name the model, run the jobs.

Owns: the FastAPI app (`FrontEnd.build_asgi_app`, each API's routes from serve_app.api), the HTTP
edge (content type 415, body size 413 and body timeout 408, JSON that Python cannot take or that
holds invalid Unicode 400, every error in its API's shape, 404 and 405 included), auth and
priorities (serve_app.auth), the model a request names (serve_app.served_model: its prompts
templated and tokenized here, once, with the engine's tokenizer, off the event loop), the
request's limits (prompts a request, work the queue could ever hold), and running its jobs
(serve_app.jobs). Does not own: any API's fields or output (serve_app.api), admission
(serve_app.admission: the router in this process or the Router deployment), the replicas
(serve_app.replicas: in this process or the EngineReplica deployment). What those are is the
graph's shape, chosen in app.py and put together by serve_app.frontend.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException

from engine.errors import InvalidRequestError
from engine.gc_settings import collect_young_less_often
from serve_app.admission import Admission
from serve_app.api.admin import AdminAPI
from serve_app.api.anthropic import MessagesAPI
from serve_app.api.chat import ChatAPI
from serve_app.api.completions import CompletionsAPI
from serve_app.api.embeddings import EmbeddingsAPI
from serve_app.api.outputs import Formatter, StreamFormatter
from serve_app.api.responses import ResponsesAPI
from serve_app.api.wire import APIError, Route
from serve_app.auth import Authorizer, PriorityRange, resolve_priority
from serve_app.config import AppConfig
from serve_app.front_door import CancelOnDisconnect, SharedPortServer
from serve_app.jobs import Job, Target, complete, respond
from serve_app.replicas import Replicas
from serve_app.served_model import Adapter, ServedModel

logger = logging.getLogger("cbserve.ingress")
Body = TypeVar("Body", bound=BaseModel)


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


class FrontEnd:
    """The APIs over an admission and the engine replicas."""

    def __init__(self, config: AppConfig, admission: Admission, replicas: dict[str, Replicas]):
        """`replicas`: each served model's, by its name."""
        collect_young_less_often()  # each request's objects live as long as it does (Serve freezes the rest)
        self.config = config
        self.admission = admission
        self.models = {m.model_name: ServedModel(m, replicas[m.model_name]) for m in config.served_models}
        self.default_model = next(iter(self.models.values()))  # a request that names no model gets it
        self.auth = Authorizer(config.ingress, config.router)
        # Routes are matched in the order they are added: the APIs whose requests come most, first.
        self.apis = (CompletionsAPI(self), ChatAPI(self), ResponsesAPI(self), MessagesAPI(self), EmbeddingsAPI(self),
                     AdminAPI(self))
        self.routes = [route for api in self.apis for route in api.routes]
        self._error_bodies = {route.path: route.error_body for route in self.routes}
        self._schema: dict[str, Any] = {}
        self._app: FastAPI | None = None

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

    # ------------------------------------------------------------ a request's edge

    def authorize(self, request: Request) -> PriorityRange:
        """The priorities the caller's key allows (a 401 for a key that is not one)."""
        return self.auth.authorize(request.headers.get("authorization"), request.headers.get("x-api-key"))

    async def authorized_json(self, request: Request) -> dict[str, Any]:
        self.authorize(request)
        return await self._read_json(request)

    async def authorized_body(self, request: Request, model_cls: type[Body]) -> Body:
        return self.parse(model_cls, await self.authorized_json(request))

    async def validated(self, request: Request, model_cls: type[Body]) -> tuple[Body, ServedModel]:
        """The body as `model_cls` and the model it names (its info loaded)."""
        return await self.parse_for_model(model_cls, await self.authorized_json(request))

    async def parse_for_model(self, model_cls: type[Body], data: dict[str, Any]) -> tuple[Body, ServedModel]:
        req = self.parse(model_cls, data)
        model, _ = await self._named(req)
        return req, model

    async def accept(self, request: Request, model_cls: type[Body]) -> tuple[Body, Target]:
        """Auth, body, fields, the model and adapter it names (the model's info loaded), its priority."""
        allowed = self.authorize(request)
        req = self.parse(model_cls, await self._read_json(request))
        model, adapter = await self._named(req)
        return req, Target(model, adapter, resolve_priority(getattr(req, "priority", None), allowed))

    async def _named(self, req: BaseModel) -> tuple[ServedModel, Adapter]:
        """The model and adapter a body names, the model's info loaded."""
        model, adapter = self.model(_named_model(req))
        await model.load_info()
        return model, adapter

    async def _read_json(self, request: Request) -> dict[str, Any]:
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

    def parse(self, model_cls: type[Body], data: dict[str, Any]) -> Body:
        """The body as `model_cls`, or a 400 naming the first field at fault. Fields no model
        declares are refused, or with ingress.ignore_unknown_fields dropped and logged."""
        try:
            return model_cls.model_validate(data)
        except ValidationError as e:
            errors = e.errors()
        unknown = [err["loc"] for err in errors if err["type"] == "extra_forbidden"]
        if self.config.ingress.ignore_unknown_fields and any([_drop(data, loc) for loc in unknown]):
            logger.info("ignored unknown request fields: %s", ", ".join(map(_field_name, unknown)))
            return self.parse(model_cls, data)  # the body shrank: this ends
        err = errors[0]
        loc = _field_name(err["loc"])
        if err["type"] == "extra_forbidden":
            raise APIError(400, f"Unrecognized request argument supplied: {loc}", param=loc)
        msg = err["msg"].removeprefix("Value error, ")
        raise APIError(400, f"Invalid value for '{loc}': {msg}" if loc else msg, param=loc or None) from None

    def model(self, model: str | None) -> tuple[ServedModel, Adapter]:
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

    def check_num_prompts(self, count: int, param: str) -> None:
        """A request's prompts (or inputs) are at most what the config lets one request hold."""
        limit = min(self.config.ingress.max_prompts_per_request, self.config.router.max_queued_requests)
        if count > limit:
            raise APIError(400, f"A request may hold at most {limit} {param}s, got {count}.", param=param,
                           code=f"too_many_{param}s")

    def check_fits_queue(self, jobs: list[Job]) -> None:
        """A request whose work exceeds the router's whole queue could never be admitted: 413, not
        a 429 that no retry can cure."""
        work, limit = sum(job.admit.num_work_tokens for job in jobs), self.config.router.max_queued_tokens
        if work > limit:
            raise APIError(413, f"This request needs {work} tokens of work (prompts + n * max_tokens); the "
                                f"admission queue holds at most {limit}. Split it or lower max_tokens.",
                           param="max_tokens", code="request_too_large")

    @staticmethod
    def log_user(request_id: str, user: str | None) -> None:
        """OpenAI's `user`: an end-user id for abuse monitoring, logged beside the request id."""
        if user is not None:
            logger.info("%s from user %r", request_id, user[:128])

    # ------------------------------------------------------------ running a request's jobs

    async def respond(self, jobs: list[Job], fmt: StreamFormatter, stream: bool, target: Target) -> Response:
        """The jobs' response: one JSON body, or an SSE stream (serve_app.jobs.respond)."""
        self.check_fits_queue(jobs)
        return await respond(jobs, fmt, stream, self.admission, target.model.replicas)

    async def complete(self, jobs: list[Job], fmt: Formatter, target: Target) -> dict[str, Any]:
        """The jobs run to their end: the formatter's whole response."""
        self.check_fits_queue(jobs)
        return await complete(jobs, fmt, self.admission, target.model.replicas)

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
        for handled, as_api_error in ((APIError, _as_is), (InvalidRequestError, APIError.from_invalid),
                                      (HTTPException, _from_http), (Exception, _internal)):
            app.add_exception_handler(handled, self._error_handler(as_api_error))
        for api in self.apis:
            for route in api.routes:
                app.add_api_route(route.path, getattr(api, route.endpoint), methods=[route.method],
                                  include_in_schema=route.documented)
        self._app = app
        return app

    def _error_handler(self, as_api_error: Callable[[Any], APIError]) -> Callable[..., Any]:
        """A handler answering an error as its route's API answers errors (OpenAI's shape unless
        the route says otherwise)."""
        async def answer(request: Request, e: Exception) -> JSONResponse:
            error = as_api_error(e)
            body = self._error_bodies.get(request.url.path, APIError.body)(error)
            return JSONResponse(body, status_code=error.status, headers=error.headers or None)
        return answer

    def openapi(self) -> dict[str, Any]:
        """The app's OpenAPI schema, built on first use (every route registered by then)."""
        if not self._schema:
            assert self._app is not None, "build_asgi_app() first"
            self._schema.update(openapi_schema(self._app, self.routes))
        return self._schema


def _as_is(e: APIError) -> APIError:
    return e


def _from_http(e: HTTPException) -> APIError:
    """Routing's own errors: 404, 405."""
    return APIError(e.status_code, str(e.detail), code="not_found" if e.status_code == 404 else None,
                    headers=getattr(e, "headers", None))


def _internal(e: Exception) -> APIError:
    logger.error("unhandled error", exc_info=e)
    return APIError(500, f"Internal error: {type(e).__name__}", "internal_error")


def _named_model(req: BaseModel) -> str | None:
    """The model a request body names, if it has the field."""
    name = getattr(req, "model", None)
    return name if isinstance(name, str) else None


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


def openapi_schema(app: FastAPI, routes: list[Route]) -> dict[str, Any]:
    """FastAPI's schema of the routes, with the request bodies we parse ourselves declared."""
    schema = get_openapi(title="cbserve", version="1", routes=app.routes)
    parsed = [route for route in routes if route.bodies]
    _, defs = models_json_schema([(m, "validation") for route in parsed for m in route.bodies],
                                 ref_template="#/components/schemas/{model}")
    schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
    for route in parsed:
        refs = [{"$ref": f"#/components/schemas/{model.__name__}"} for model in route.bodies]
        body = {"required": True, "content": {"application/json": {"schema": refs[0] if len(refs) == 1
                                                                   else {"anyOf": refs}}}}
        schema["paths"][route.path][route.method.lower()]["requestBody"] = body
    return schema
