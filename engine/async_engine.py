"""The engine for servers: the step loop runs off the event loop (a background thread, or with
`engine_process=True` a child process, see engine/engine_core.py); callers await per-request
streams of output deltas. Implements engine.client.EngineClient.

Callers send commands (AddRequest, AbortRequest) to the loop and receive each step's outputs in
one batch, handed to the per-request asyncio queues with one event-loop wake-up per step, so the
event loop is never blocked by a forward pass. The loop validates a request when it adds it: bad
input raises InvalidRequestError on the stream's first iteration, before any output.

The engine heals: if the step-loop process dies, its live streams raise EngineDeadError and a
new process is started at once; requests that arrive meanwhile wait for it. Only if it keeps
dying (more than `max_restarts_per_minute`) or cannot start does the engine stay dead, and
`check_health` says so, so that the server replaces it.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from engine.beam_search import BeamSearchParams
from engine.chat_output import ChatOutputFormat
from engine.client import EngineClient
from engine.config import EngineConfig, LoraConfig
from engine.drafts import DraftTransportFactory
from engine.engine_core import AbortRequest, AddRequest, CoreOutputs, ProcessCore, RegisterAdapter, ThreadCore
from engine.errors import EngineDeadError, InvalidRequestError
from engine.metrics import EngineStats, ModelReport
from engine.outputs import RequestError, RequestOutput
from engine.sampling_params import PoolingParams, SamplingParams

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # RequestOutput deltas, or an Exception that ends the stream


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput | Exception]]) -> None:
    for q, item in items:
        q.put_nowait(item)


class AsyncEngine(EngineClient):
    # Invariant (under _lock): a stream is registered only while a live core is installed, and a
    # core's exit fails every stream registered before it; so no stream waits on a dead core.
    def __init__(self, config: EngineConfig, engine_process: bool = False, max_restarts_per_minute: int = 3,
                 draft_transport: DraftTransportFactory | None = None, output_interval_s: float = 0.0):
        self.config = config
        self.output_interval_s = output_interval_s  # see engine_core.StepLoop
        self.draft_transport = draft_transport
        self.engine_process = engine_process
        self.max_restarts_per_minute = max_restarts_per_minute
        self.num_restarts = 0
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._stopped = False
        self._dead: EngineDeadError | None = None
        self._exits: deque[float] = deque()
        self._restart: concurrent.futures.Future | None = None
        self._core: ProcessCore | ThreadCore | None = self._start_core()
        self._info = self._core.info
        self._num_sent = 0  # AddRequests sent to the live core
        self._snapshot: tuple[EngineStats, int] = (self._info.stats, 0)  # the core's stats, AddRequests it applied

    @classmethod
    def from_config(cls, config: EngineConfig, engine_process: bool = False,
                    draft_transport: DraftTransportFactory | None = None, output_interval_s: float = 0.0
                    ) -> AsyncEngine:
        return cls(config, engine_process, draft_transport=draft_transport, output_interval_s=output_interval_s)

    @classmethod
    def from_engine_args(cls, model: str | None = None, engine_process: bool = False,
                         **engine_args) -> AsyncEngine:
        return cls(EngineConfig.from_kwargs(model=model, **engine_args), engine_process)

    def _start_core(self) -> ProcessCore | ThreadCore:
        if self.engine_process:
            return ProcessCore(self.config, self._on_outputs, self._on_core_exit, self.draft_transport,
                               self.output_interval_s)
        return ThreadCore(self.config, self._on_outputs, self.draft_transport, self.output_interval_s)

    @property
    def tokenizer(self):
        return self._info.tokenizer

    @property
    def chat_format(self) -> ChatOutputFormat:
        return self._info.chat_format

    @property
    def hidden_size(self) -> int:
        return self._info.hidden_size

    @property
    def max_model_len(self) -> int:
        return self._info.max_model_len

    @property
    def vocab_size(self) -> int:
        return self._info.vocab_size

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._info.eos_token_ids

    @property
    def model_report(self) -> ModelReport:
        return self._info.model_report

    @property
    def block_size(self) -> int:
        return self.config.cache.block_size

    @property
    def is_ready(self) -> bool:
        return self._core is not None and self._dead is None and not self._stopped

    def stats(self) -> EngineStats:
        """The snapshot taken after the latest step, with requests sent since counted as waiting."""
        stats, num_applied = self._snapshot
        in_flight = self._num_sent - num_applied
        return replace(stats, num_waiting=stats.num_waiting + in_flight) if in_flight > 0 else stats

    def has_request(self, request_id: str) -> bool:
        return request_id in self._streams

    def check_health(self) -> None:
        if self._stopped:
            raise EngineDeadError("engine is shut down")
        if self._dead is not None:
            raise self._dead

    def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                 priority: int = 0, waited_s: float = 0.0, lora: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yields deltas until the request finishes; the last has `finished=True`. Leaving the
        iteration early (cancel, disconnect, break) aborts the request and frees its blocks."""
        return self._stream(prompt, params, request_id, priority, waited_s, lora)

    def beam_search(self, prompt_token_ids: list[int], params: BeamSearchParams, request_id: str,
                    priority: int = 0, waited_s: float = 0.0, lora: str | None = None) -> AsyncIterator[RequestOutput]:
        """The search runs in the step loop (engine.beam_groups); one output when it is done.
        Leaving early aborts it."""
        return self._stream(prompt_token_ids, params, request_id, priority, waited_s, lora)

    async def embed(self, prompt_token_ids: list[int], params: PoolingParams, request_id: str, priority: int = 0,
                    waited_s: float = 0.0, lora: str | None = None) -> RequestOutput:
        """The prompt's embedding (`embedding` of the one output), computed in the step loop's
        steps beside generation. Cancelling the call aborts it."""
        async for output in self._stream(prompt_token_ids, params, request_id, priority, waited_s, lora):
            if output.finished:
                return output
        raise EngineDeadError("the embedding request ended without its output")

    def load_adapter(self, name: str, path: str) -> None:
        """Serves the LoRA adapter at `path` as `name` from now on, in this engine and any it restarts
        as (InvalidRequestError where LoRA is off, the name is taken or the path holds no adapter)."""
        lora = self.config.lora.with_adapter(name, path)
        if lora != self.config.lora:
            self._set_lora(lora)
            self._send(RegisterAdapter(name, path))

    def unload_adapter(self, name: str) -> None:
        """Stops serving adapter `name` (AdapterNotFoundError where it was not loaded)."""
        self._set_lora(self.config.lora.without_adapter(name))
        self._send(RegisterAdapter(name, None))

    def _set_lora(self, lora: LoraConfig) -> None:
        self.config = replace(self.config, lora=lora)  # a restarted core starts with its adapters

    def _send(self, command) -> None:
        with self._lock:
            if self._core is not None:
                self._core.send(command)

    async def _stream(self, prompt: str | list[int], params: SamplingParams | BeamSearchParams | PoolingParams,
                      request_id: str, priority: int, waited_s: float,
                      lora: str | None) -> AsyncIterator[RequestOutput]:
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        await self._register(request_id, stream, AddRequest(request_id, prompt, params, priority, waited_s, lora))
        finished, first = False, None
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                if first is None:
                    first = item
                else:  # the step loop sends the prompt with the first output only
                    item.prompt, item.prompt_token_ids = first.prompt, first.prompt_token_ids
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    async def _register(self, request_id: str, stream: _Stream, command: AddRequest) -> None:
        """Registers the stream and sends its request to the live core, waiting out a restart."""
        while True:
            with self._lock:
                self.check_health()
                if self._core is not None:
                    if request_id in self._streams:
                        raise InvalidRequestError(None, f"request_id {request_id!r} is already in use")
                    self._streams[request_id] = stream
                    self._num_sent += 1
                    self._core.send(command)
                    return
                restart = self._restart
            assert restart is not None  # no core and healthy: a restart is under way
            await asyncio.wrap_future(restart)

    def abort(self, request_id: str) -> None:
        """Stops the request at the next step boundary; its stream ends with finish_reason "abort"."""
        core = self._core
        if core is not None:
            core.send(AbortRequest(request_id))

    def shutdown(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            core, self._core = self._core, None
        if core is not None:
            core.shutdown()

    # ---- called on the loop's side (engine thread, or the process reader thread) ---------
    def _on_outputs(self, outputs: CoreOutputs) -> None:
        self._snapshot = (outputs.stats, outputs.num_added)
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for event in outputs.events:
            stream = self._streams.get(event.request_id)
            if stream is not None:
                item = event.error if isinstance(event, RequestError) else event
                by_loop.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _on_core_exit(self, error: Exception) -> None:
        """The child process died: fail its streams, then restart it (or give up)."""
        now = time.monotonic()
        with self._lock:
            self._core = None
            self._num_sent = 0  # the next core counts from zero
            failed = list(self._streams)
            self._exits.append(now)
            while self._exits and now - self._exits[0] > 60:
                self._exits.popleft()
            restart = not self._stopped and len(self._exits) <= self.max_restarts_per_minute
            if restart:
                self._restart = concurrent.futures.Future()
                threading.Thread(target=self._restart_core, args=(self._restart,), name="engine-restart",
                                 daemon=True).start()
            elif not self._stopped:
                self._dead = EngineDeadError(f"{error}; it died {len(self._exits)} times within a minute")
        logger.error("%s; %s", error, "restarting it" if restart else "not restarting it")
        self._on_outputs(CoreOutputs([RequestError(rid, EngineDeadError(str(error))) for rid in failed],
                                     self._snapshot[0], 0))

    def _restart_core(self, done: concurrent.futures.Future) -> None:
        t0 = time.monotonic()
        try:
            core = self._start_core()
        except Exception as e:
            with self._lock:
                self._dead = EngineDeadError(f"engine process could not be restarted: {e}")
            done.set_exception(self._dead)
            return
        with self._lock:
            stopped = self._stopped
            if not stopped:
                self._core = core
                self.num_restarts += 1
        if stopped:
            core.shutdown()
            done.set_exception(EngineDeadError("engine is shut down"))
            return
        logger.warning("engine process restarted in %.1f s", time.monotonic() - t0)
        done.set_result(core)
