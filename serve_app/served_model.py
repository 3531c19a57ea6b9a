"""`ServedModel`: one model as the ingress serves it, and the LoRA adapters it serves.

Owns: the model's replicas (serve_app.replicas), its info and tokenizer (fetched once from a
replica, the tokenizer run off the event loop: serve_app.batch_tokenizer), and its adapters: those
the config names, then those loaded at run time (/v1/load_lora_adapter), whose paths go with their
requests so that every replica, later ones too, loads them on first use. The ingress holds one per
model of the app and picks it by a request's `model` (serve_app.ingress).
"""
from __future__ import annotations

import asyncio

from engine.tokenization import render_chat
from engine.tools import Tool
from serve_app.api.wire import APIError
from serve_app.batch_tokenizer import BatchTokenizer
from serve_app.config import EngineReplicaConfig
from serve_app.messages import ModelInfo
from serve_app.replicas import Replicas

Adapter = tuple[str | None, str | None]  # a request's LoRA adapter and its run-time path, or (None, None)


class ServedModel:
    def __init__(self, config: EngineReplicaConfig, replicas: Replicas):
        self.config, self.replicas = config, replicas
        self.name = config.model_name
        self.lora = config.engine_config.lora  # the served adapters: the config's, then those loaded
        self.adapters: dict[str, str] = self.lora.modules  # LoRA adapter name -> path
        self._loaded_at_run_time: set[str] = set()
        self._info: ModelInfo | None = None
        self._tokens: BatchTokenizer | None = None
        self._info_lock = asyncio.Lock()

    @property
    def info(self) -> ModelInfo:
        """The model's info, once `load_info` has fetched it."""
        assert self._info is not None, "load_info() first"
        return self._info

    @property
    def has_info(self) -> bool:
        return self._info is not None

    async def load_info(self) -> ModelInfo:
        """The engine's model info, fetched once. Its tokenizer comes over pickled, and unpickling
        it imports transformers (~0.4 s of this process's loop): `/health` and Serve's health
        check load it once an engine replica is ready, so no request waits for it."""
        async with self._info_lock:
            if self._info is None:
                info = await self.replicas.model_info()
                self._tokens = BatchTokenizer(info.tokenizer)
                self._info = info
        return self._info

    async def encode(self, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        """A text's token ids (the model's info already here), tokenized off the event loop."""
        assert self._tokens is not None
        return await self._tokens.encode(text, add_special_tokens, param)

    async def prompt_ids(self, prompt: str | list[int], param: str = "prompt", add_special_tokens: bool = True
                         ) -> list[int]:
        return await self.encode(prompt, add_special_tokens, param) if isinstance(prompt, str) else prompt

    async def chat_prompt(self, messages: list[dict], tools: list[Tool], add_generation_prompt: bool = True,
                          template_kwargs: dict | None = None, continue_final_message: bool = False
                          ) -> tuple[str, list[int]]:
        """engine.tokenization.encode_chat's text and ids for OpenAI-format `messages`: the
        template applied here, its text (every special token written out, none to add)
        tokenized off the event loop."""
        text = render_chat(self.info.tokenizer, messages, add_generation_prompt, tools, template_kwargs,
                           continue_final_message)
        return text, await self.encode(text, add_special_tokens=False, param="messages")

    def may_serve_adapter(self, name: str) -> bool:
        """Whether `name` may be one of this model's adapters: one it holds, or (unknown until an
        engine looks) one its adapter_dirs may hold."""
        return self.lora.enable_lora and bool(name) and (name in self.adapters or bool(self.lora.adapter_dirs))

    def adapter(self, name: str) -> Adapter:
        return name, self.adapters[name] if name in self._loaded_at_run_time else None

    def load_adapter(self, name: str, path: str) -> None:
        """/v1/load_lora_adapter: `name` serves the adapter at `path` from now on (the engine's
        rule, LoraConfig.with_adapter)."""
        if name == self.name:
            raise APIError(400, f"An adapter cannot take the base model's name '{name}'.", param="lora_name")
        lora = self.lora.with_adapter(name, path)
        if lora != self.lora:
            self.lora, self.adapters = lora, lora.modules
            self._loaded_at_run_time.add(name)

    def unload_adapter(self, name: str) -> None:
        self.lora = self.lora.without_adapter(name)
        self.adapters = self.lora.modules
        self._loaded_at_run_time.discard(name)
