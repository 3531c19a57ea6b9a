"""The engine for servers: the step loop runs off the event loop (a background thread, or with
`engine_process=True` a child process, see engine/engine_core.py); callers await per-request
streams of output deltas.

Callers send commands (add, abort) to the loop and receive each step's outputs in one batch,
handed to the per-request asyncio queues with one event-loop wake-up per step, so the event loop
is never blocked by a forward pass. The loop validates a request when it adds it: bad input
raises ValueError on the stream's first iteration, before any output, and changes nothing.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.engine_core import Event, ProcessCore, RequestError, ThreadCore
from engine.llm_engine import encode_chat
from engine.metrics import EngineStats
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # RequestOutput deltas, or an Exception that ends the stream


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput | Exception]]) -> None:
    for q, item in items:
        q.put_nowait(item)


class AsyncEngine:
    def __init__(self, config: EngineConfig, engine_process: bool = False):
        self.config = config
        self._streams: dict[str, _Stream] = {}
        self._stopped = False
        if engine_process:
            self._core = ProcessCore(config, self._on_events, self._on_core_exit)
        else:
            self._core = ThreadCore(config, self._on_events)
        self._stats: EngineStats = self._core.initial_stats

    @classmethod
    def from_engine_args(cls, model: str | None = None, engine_process: bool = False,
                         **engine_args) -> AsyncEngine:
        return cls(EngineConfig.from_kwargs(model=model, **engine_args), engine_process)

    @property
    def tokenizer(self):
        return self._core.tokenizer

    @property
    def max_model_len(self) -> int:
        return self._core.max_model_len

    @property
    def block_size(self) -> int:
        return self.config.cache.block_size

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return encode_chat(self.tokenizer, messages)

    def stats(self) -> EngineStats:
        """The snapshot taken after the latest step."""
        return self._stats

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yields deltas until the request finishes; the last has `finished=True`. Leaving the
        iteration early (cancel, disconnect, break) aborts the request and frees its blocks."""
        if self._stopped:
            raise RuntimeError("engine is shut down")
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        self._core.send(("add", request_id, prompt, params, priority))
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._core.send(("abort", request_id))

    def abort(self, request_id: str) -> None:
        """Stops the request at the next step boundary; its stream ends with finish_reason "abort"."""
        self._core.send(("abort", request_id))

    def shutdown(self) -> None:
        if not self._stopped:
            self._stopped = True
            self._core.shutdown()

    # ---- called on the loop's side (engine thread, or the process reader thread) ---------
    def _on_events(self, events: list[Event], stats: EngineStats) -> None:
        self._stats = stats
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for event in events:
            stream = self._streams.get(event.request_id)
            if stream is not None:
                item = event.error if isinstance(event, RequestError) else event
                by_loop.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _on_core_exit(self, error: Exception) -> None:
        self._stopped = True
        self._on_events([RequestError(rid, error) for rid in list(self._streams)], self._stats)
