"""Where the step loop runs: a thread of the caller's process, or a process of its own.

`StepLoop` drives an LLMEngine: it applies queued commands (AddRequest, AbortRequest), steps while
there is work, and hands each iteration's events and stats snapshot to `emit` as one CoreOutputs.
`ThreadCore` runs it on a background thread. `ProcessCore` runs it in a child process
(`run_child`) talking over a socket pair: a server process's own threads (event loop, RPC,
serialization) then share neither the GIL nor the forward pass's cores' time slices with the
step loop, which is what lets a multi-threaded forward keep its speed inside a busy server. The
parent receives the tokenizer and limits once, at start-up (CoreReady). Every message that
crosses either boundary is one of the dataclasses below.
"""
from __future__ import annotations

import concurrent.futures
import importlib
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from engine.beam_search import BeamSearchParams
from engine.chat_output import ChatOutputFormat
from engine.config import EngineConfig
from engine.drafts import DraftTransportFactory
from engine.metrics import EngineStats, ModelReport
from engine.outputs import RequestError
from engine.sampling_params import PoolingParams, SamplingParams

if TYPE_CHECKING:  # built only where the loop runs: a ProcessCore's parent spawns the child without torch
    from engine.llm_engine import Event, LLMEngine

logger = logging.getLogger(__name__)
IDLE_WAIT_S = 0.5


@dataclass(frozen=True, slots=True)
class AddRequest:
    request_id: str
    prompt: str | list[int]  # text (the engine tokenizes it) or token ids
    params: SamplingParams | BeamSearchParams | PoolingParams  # a beam search's: the loop runs the search
    priority: int = 0
    waited_s: float = 0.0  # already spent waiting upstream: aging goes on from there
    lora: str | None = None  # the LoRA adapter it runs with


@dataclass(frozen=True, slots=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True, slots=True)
class RegisterAdapter:
    """A LoRA adapter served from now on (`path`), or no longer (None); checked by the sender."""
    name: str
    path: str | None


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


Command = AddRequest | AbortRequest | RegisterAdapter


@dataclass(frozen=True, slots=True)
class CoreOutputs:
    """One loop iteration's events (deltas and errors, in order) and the stats after it."""
    events: list[Event]
    stats: EngineStats
    num_added: int  # AddRequests this loop has applied so far, refused ones included


TOKENIZER_MODULE = "transformers.tokenization_utils_tokenizers"  # the base class of every fast tokenizer


@dataclass(frozen=True, slots=True)
class CoreInfo:
    """What the caller's side needs of the engine, sent once when it is ready."""
    tokenizer: Any
    chat_format: ChatOutputFormat
    max_model_len: int
    vocab_size: int
    hidden_size: int
    eos_token_ids: frozenset[int]
    model_report: ModelReport
    stats: EngineStats


@dataclass(frozen=True, slots=True)
class CoreFailed:
    error: Exception


Emit = Callable[[CoreOutputs], None]


def _info(engine: LLMEngine) -> CoreInfo:
    return CoreInfo(engine.tokenizer, engine.chat_format, engine.max_model_len, engine.vocab_size, engine.hidden_size,
                    engine.eos_token_ids, engine.model_report, engine.get_stats())


class StepLoop:
    """Applies commands, steps while there is work, emits events in batches.

    With `output_interval_s` > 0 the steps' deltas are held in the engine and emitted together at
    most once per interval: every emit wakes the receiving server's threads, which on a small
    machine take their time slices from the forward's cores, and every request's delta in it
    costs the server a wake-up of that request's stream. A request's first tokens, its end and an
    error are emitted at once, with that request's held deltas alone, so TTFT and the last token
    never wait and the other streams still get one delta per interval.
    """

    def __init__(self, engine: LLMEngine, emit: Emit, output_interval_s: float = 0.0):
        self.engine, self.emit, self.output_interval_s = engine, emit, output_interval_s
        engine.output_processor.prompt_once = True  # the client (AsyncEngine) keeps it from the first output
        self.num_added = 0

    def run(self, receive: Callable[[float], list[Command] | None]) -> None:
        """`receive(timeout)`: the commands that arrived within `timeout` s, or None to stop."""
        last_emit = -float("inf")
        while True:
            busy = self.engine.has_unfinished_requests()
            commands = receive(0.0 if busy else IDLE_WAIT_S)
            if commands is None:
                return
            events: list[Event] = []
            for command in commands:
                events += self._apply(command)
            now = time.monotonic()
            due = now - last_emit >= self.output_interval_s
            if self.engine.has_unfinished_requests():
                try:
                    events += self.engine.step(hold_deltas=not due)
                except Exception as e:  # not attributable to one request: fail them all, go on
                    logger.exception("engine step failed")
                    events += self.engine.fail_all(e)
            if events or (commands and due):
                self.emit(CoreOutputs(events, self.engine.get_stats(), self.num_added))
                if due:
                    last_emit = now

    def _apply(self, command: Command) -> list[Event]:
        match command:
            case AddRequest(request_id, prompt, params, priority, waited_s, lora):
                self.num_added += 1
                try:
                    self.engine.add_request(request_id, prompt, params, priority, waited_s, lora)
                except ValueError as e:
                    return [RequestError(request_id, e)]
                return []
            case RegisterAdapter(name, path):
                adapters = self.engine.adapters
                if adapters is None:  # the engine's config said LoRA is off, and refused the load
                    raise RuntimeError(f"adapter {name!r} registered with LoRA off")
                if path is None:
                    adapters.unregister(name)
                else:
                    adapters.register(name, path)
                return []
            case AbortRequest(request_id):
                output = self.engine.abort_request(request_id)
                return [output] if output is not None else []
        raise TypeError(f"unknown command {command!r}")


class ThreadCore:
    """The step loop on a daemon thread of this process, which builds the engine too: libgomp gives
    each thread that starts parallel regions a pool of its own, and once a process holds more pool
    threads than CPUs it stops spinning at barriers (each wait a futex sleep and wake). Built on
    the caller's thread and stepped on this one, the decode stack's ~240 barriers a step made a
    single stream's decode 2.5x slower."""

    def __init__(self, config: EngineConfig, emit: Emit, draft_transport: DraftTransportFactory | None = None,
                 output_interval_s: float = 0.0):
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stopped = False
        ready: concurrent.futures.Future[CoreInfo] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, name="engine-step-loop", daemon=True,
                                        args=(config, emit, draft_transport, output_interval_s, ready))
        self._thread.start()
        self.info = ready.result()  # or the engine's construction error, raised here

    def _run(self, config: EngineConfig, emit: Emit, draft_transport: DraftTransportFactory | None,
             output_interval_s: float, ready: concurrent.futures.Future[CoreInfo]) -> None:
        from engine.llm_engine import LLMEngine

        try:
            engine = LLMEngine(config, draft_transport=draft_transport)
        except BaseException as e:
            ready.set_exception(e)
            return
        ready.set_result(_info(engine))
        StepLoop(engine, emit, output_interval_s).run(self._receive)

    def send(self, command: Command) -> None:
        self._commands.put(command)
        self._wakeup.set()

    def _receive(self, timeout: float) -> list[Command] | None:
        if timeout > 0 and self._commands.empty():
            self._wakeup.wait(timeout)
        self._wakeup.clear()
        if self._stopped:
            return None
        commands = []
        while not self._commands.empty():
            commands.append(self._commands.get_nowait())
        return commands

    def shutdown(self) -> None:
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout=30)


class ProcessCore:
    """The step loop in a child process; a reader thread here emits what it sends back.

    `on_exit(error)` is called if the child dies while in use (its requests must fail)."""

    def __init__(self, config: EngineConfig, emit: Emit, on_exit: Callable[[Exception], None],
                 draft_transport: DraftTransportFactory | None = None, output_interval_s: float = 0.0):
        parent_sock, child_sock = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        entry = "import sys; from engine.engine_core import run_child; run_child(int(sys.argv[1]))"
        self._proc = subprocess.Popen([sys.executable, "-c", entry, str(child_sock.fileno())],
                                      pass_fds=[child_sock.fileno()], env=env)
        child_sock.close()
        # the child's reply carries its tokenizer, whose unpickling here imports transformers: done
        # meanwhile, it is off the start-up's path (0.5 s of every `make serve`, BENCHMARKS.md)
        threading.Thread(target=importlib.import_module, args=(TOKENIZER_MODULE,), name="tokenizer-import",
                         daemon=True).start()
        self._conn = Connection(parent_sock.detach())
        self._send_lock = threading.Lock()
        self._stopped = False
        try:
            self._conn.send((config, draft_transport, output_interval_s))
            reply = self._conn.recv()
        except (EOFError, OSError) as e:
            self._proc.kill()
            raise RuntimeError(f"engine process exited during start-up (code {self._proc.wait()})") from e
        if isinstance(reply, CoreFailed):
            self._proc.wait()
            raise reply.error
        self.info: CoreInfo = reply
        self._reader = threading.Thread(target=self._read, args=(emit, on_exit), name="engine-core-reader",
                                        daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def send(self, command: Command | Shutdown) -> None:
        """Sends a command; if the child is gone it is dropped (the reader fails its request)."""
        with self._send_lock:
            try:
                self._conn.send(command)
            except OSError:
                pass

    def _read(self, emit: Emit, on_exit: Callable[[Exception], None]) -> None:
        while True:
            try:
                outputs = self._conn.recv()
            except (EOFError, OSError):
                if not self._stopped:
                    code = self._proc.wait()
                    on_exit(RuntimeError(f"engine process exited with code {code}"))
                return
            emit(outputs)

    def shutdown(self) -> None:
        self._stopped = True
        try:
            self.send(Shutdown())
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._conn.close()


def run_child(fd: int) -> None:
    """The child process's main: build the engine, report ready, run the loop until told to stop
    or the parent is gone."""
    conn = Connection(fd)
    config, draft_transport, output_interval_s = conn.recv()
    try:
        from engine.llm_engine import LLMEngine

        engine = LLMEngine(config, draft_transport=draft_transport)
    except Exception as e:
        conn.send(CoreFailed(e))
        return
    conn.send(_info(engine))

    def receive(timeout: float) -> list[Command] | None:
        commands: list[Command] = []
        try:
            ready = conn.poll(timeout)
            while ready:
                command = conn.recv()
                if isinstance(command, Shutdown):
                    return None
                commands.append(command)
                ready = conn.poll(0)
        except (EOFError, OSError):  # the parent is gone
            return None
        return commands

    def send(outputs: CoreOutputs) -> None:
        try:
            conn.send(outputs)
        except OSError:  # the parent is gone
            raise SystemExit(0) from None

    StepLoop(engine, send, output_interval_s).run(receive)
