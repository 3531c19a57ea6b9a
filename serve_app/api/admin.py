"""The server's own routes: health, the models served (`/v1/models`), LoRA adapters loaded and
unloaded at run time (vLLM's `/v1/load_lora_adapter`), vLLM's `/tokenize` and `/detokenize`, the
version and the OpenAPI schema.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import time
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from engine.tokenization import check_token_ids
from serve_app.api.chat import ChatFields
from serve_app.api.chat_turn import ToolUse
from serve_app.api.wire import APIError, Route, WireModel
from serve_app.served_model import ServedModel

if TYPE_CHECKING:
    from serve_app.ingress import FrontEnd

logger = logging.getLogger("cbserve.ingress")


class TokenizeCompletionRequest(WireModel):
    """/tokenize, completion form (vLLM's)."""
    model: str | None = None
    prompt: str = Field(min_length=1)
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatFields):
    """/tokenize, chat form: the messages (and tools) through the chat template (vLLM's)."""
    model: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="Variables the chat template reads.")


class DetokenizeRequest(WireModel):
    model: str | None = None
    tokens: list[int] = Field(min_length=1)


class LoadLoraAdapterRequest(BaseModel):
    """vLLM's /v1/load_lora_adapter body."""
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str


def model_card(model_name: str, created: int, root: str, max_model_len: int, parent: str | None = None
               ) -> dict[str, Any]:
    """A /v1/models entry, with vLLM's `root` (the checkpoint served, or a LoRA adapter's path),
    `parent` (an adapter's base model) and `max_model_len`."""
    return {"id": model_name, "object": "model", "created": created, "owned_by": "cbserve", "root": root,
            "parent": parent, "max_model_len": max_model_len}


class AdminAPI:
    routes = (Route("GET", "/v1/models", "list_models"),
              Route("GET", "/v1/models/{model_id:path}", "get_model"),
              Route("POST", "/v1/load_lora_adapter", "load_lora_adapter", (LoadLoraAdapterRequest,)),
              Route("POST", "/v1/unload_lora_adapter", "unload_lora_adapter", (UnloadLoraAdapterRequest,)),
              Route("GET", "/version", "version"),
              Route("GET", "/openapi.json", "openapi", documented=False),
              Route("GET", "/health", "health"),
              Route("POST", "/tokenize", "tokenize", (TokenizeCompletionRequest, TokenizeChatRequest)),
              Route("POST", "/detokenize", "detokenize", (DetokenizeRequest,)))

    def __init__(self, front: FrontEnd):
        self.front = front
        self._created = int(time.time())

    async def health(self) -> JSONResponse:
        """Ready when the router knows, for every model, an engine replica that takes requests, and
        this ingress holds each model's info."""
        models = self.front.models
        try:
            counts = await asyncio.wait_for(self.front.admission.ready_replicas(), 5)
            ready = {name: counts.get(name, 0) for name in models}
            for model in models.values():
                if ready[model.name]:
                    await asyncio.wait_for(model.load_info(), 5)
        except Exception as e:
            logger.warning("health: router or engine replica unreachable: %r", e)
            ready = dict.fromkeys(models, 0)
        waiting = [name for name, n in ready.items() if not n]
        if not waiting:
            return JSONResponse({"status": "ok", "ready_replicas": sum(ready.values()), "models": ready})
        names = ", ".join(f"'{name}'" for name in waiting)
        return JSONResponse(APIError(503, f"no engine replica is ready for {names}", "service_unavailable").body(),
                            status_code=503)

    async def _model_card(self, model: ServedModel, adapter: str | None = None) -> dict[str, Any]:
        info = await model.load_info()
        if adapter is not None:
            return model_card(adapter, self._created, model.adapters.get(adapter, adapter), info.max_model_len,
                              parent=model.name)
        return model_card(model.name, self._created, model.config.model or model.name, info.max_model_len)

    async def list_models(self, request: Request) -> dict[str, Any]:
        self.front.authorize(request)
        cards = [await self._model_card(model, name) for model in self.front.models.values()
                 for name in [None, *model.adapters]]
        return {"object": "list", "data": cards}

    async def get_model(self, model_id: str, request: Request) -> dict[str, Any]:
        self.front.authorize(request)
        served, (name, _) = self.front.model(model_id)
        if name is not None and name not in served.adapters:  # one adapter_dirs may hold: not known until used
            raise APIError(404, f"The model '{model_id}' is not loaded.", code="model_not_found", param="model")
        return await self._model_card(served, name)

    def _adapter_home(self, lora_name: str) -> tuple[ServedModel, str]:
        """The model a load or unload names (`base:adapter`; a bare name: the one model that serves
        adapters, else the one that holds it) and the adapter's name."""
        models = self.front.models
        base, colon, name = lora_name.rpartition(":")
        if colon and base in models:
            return models[base], name
        with_lora = [m for m in models.values() if m.lora.enable_lora]
        holders = [m for m in with_lora if lora_name in m.adapters]
        if len(holders) == 1 or len(with_lora) == 1:
            return (holders or with_lora)[0], lora_name
        if not with_lora:
            raise APIError(400, "No model of this server serves LoRA adapters (engine_args.enable_lora).",
                           param="lora_name")
        names = ", ".join(f"'{m.name}:{lora_name}'" for m in with_lora)
        raise APIError(400, f"Several models serve LoRA adapters: name the base, as one of {names}.",
                       param="lora_name")

    async def load_lora_adapter(self, request: Request) -> PlainTextResponse:
        req = await self.front.authorized_body(request, LoadLoraAdapterRequest)
        model, name = self._adapter_home(req.lora_name)
        model.load_adapter(name, req.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    async def unload_lora_adapter(self, request: Request) -> PlainTextResponse:
        lora_name = (await self.front.authorized_body(request, UnloadLoraAdapterRequest)).lora_name
        model, name = self._adapter_home(lora_name)
        model.unload_adapter(name)
        return PlainTextResponse(f"Success: LoRA adapter '{lora_name}' removed successfully.")

    async def version(self) -> dict[str, str]:
        return {"version": importlib.metadata.version("cbserve")}

    async def openapi(self, request: Request) -> dict[str, Any]:
        self.front.authorize(request)
        return self.front.openapi()

    async def tokenize(self, request: Request) -> dict[str, Any]:
        """A prompt (completion form) or messages through the chat template."""
        data = await self.front.authorized_json(request)
        if "messages" in data:
            chat, model = await self.front.parse_for_model(TokenizeChatRequest, data)
            _, ids = await model.chat_prompt(chat.template_messages(), ToolUse.of(chat.tool_definitions()).offered,
                                             chat.add_generation_prompt, chat.chat_template_kwargs,
                                             chat.continue_final_message)
            strs = chat.return_token_strs
        else:
            text, model = await self.front.parse_for_model(TokenizeCompletionRequest, data)
            ids, strs = await model.encode(text.prompt, text.add_special_tokens), text.return_token_strs
        body: dict[str, Any] = {"count": len(ids), "max_model_len": model.info.max_model_len, "tokens": ids}
        if strs:
            body["token_strs"] = model.info.tokenizer.convert_ids_to_tokens(ids)
        return body

    async def detokenize(self, request: Request) -> dict[str, Any]:
        req, model = await self.front.validated(request, DetokenizeRequest)
        check_token_ids(req.tokens, model.info.vocab_size, "tokens", "tokens")
        return {"prompt": model.info.tokenizer.decode(req.tokens)}
