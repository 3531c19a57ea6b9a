"""The engine for servers: a background thread runs the step loop; callers await per-request
streams of output deltas.

The LLMEngine is touched only by the loop thread: callers send commands (add, abort) through a
thread-safe queue and receive outputs through per-request asyncio queues, so the event loop is
never blocked by a forward pass. Validation runs in the caller, so bad input raises ValueError
before anything is queued.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.metrics import EngineStats
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
_IDLE_WAIT_S = 0.5


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # RequestOutput deltas, or an Exception that ends the stream

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    def __init__(self, config: EngineConfig):
        self.engine = LLMEngine(config)
        self.config = config
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._wakeup = threading.Event()
        self._stopped = False
        self._stats = self.engine.get_stats()
        self._thread = threading.Thread(target=self._run, name="engine-step-loop", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, model: str | None = None, **engine_args) -> AsyncEngine:
        return cls(EngineConfig.from_kwargs(model=model, **engine_args))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def block_size(self) -> int:
        return self.config.cache.block_size

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return self.engine.encode_chat(messages)

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
        token_ids = self.engine.validate(prompt, params)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        self._send(("add", request_id, prompt if isinstance(prompt, str) else token_ids, params, priority))
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
                self._send(("abort", request_id))

    def abort(self, request_id: str) -> None:
        """Stops the request at the next step boundary; its stream ends with finish_reason "abort"."""
        self._send(("abort", request_id))

    def shutdown(self) -> None:
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout=30)

    # ---- loop thread ---------------------------------------------------------------------
    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wakeup.set()

    def _run(self) -> None:
        while not self._stopped:
            if self._drain_commands():
                self._stats = self.engine.get_stats()
            if not self.engine.has_unfinished_requests():
                self._wakeup.wait(_IDLE_WAIT_S)
                self._wakeup.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # a failed step fails its requests, not the engine
                logger.exception("engine step failed")
                self._fail_all(e)
                continue
            self._stats = self.engine.get_stats()
            for output in outputs:
                self._deliver(output)

    def _drain_commands(self) -> bool:
        """Applies queued adds and aborts; True if there were any."""
        drained = False
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return drained
            drained = True
            if command[0] == "add":
                _, request_id, prompt, params, priority = command
                try:
                    self.engine.add_request(request_id, prompt, params, priority)
                except ValueError as e:
                    self._deliver_error(request_id, e)
            else:
                output = self.engine.abort_request(command[1])
                if output is not None:
                    self._deliver(output)

    def _deliver(self, output: RequestOutput) -> None:
        stream = self._streams.get(output.request_id)
        if stream is not None:
            stream.put(output)

    def _deliver_error(self, request_id: str, error: Exception) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put(error)

    def _fail_all(self, error: Exception) -> None:
        for request_id in list(self.engine.output_processor.states):
            self.engine.abort_request(request_id)
            self._deliver_error(request_id, RuntimeError(f"engine step failed: {error}"))
