"""Where the step loop runs: a thread of the caller's process, or a process of its own.

`StepLoop` drives an LLMEngine: it applies queued commands (add, abort), steps while there is work,
and hands each iteration's outputs, errors and stats snapshot to `emit` in one batch.
`ThreadCore` runs it on a background thread. `ProcessCore` runs it in a child process
(`run_child`) talking over a socket pair: a server process's own threads
(event loop, RPC, serialization) then share neither the GIL nor the forward pass's cores'
time slices with the step loop, which is what lets a multi-threaded forward keep its speed
inside a busy server. The parent receives the tokenizer and limits once, at start-up.
"""
from __future__ import annotations

import logging
import os
import queue
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.metrics import EngineStats
from engine.outputs import RequestOutput

logger = logging.getLogger(__name__)
IDLE_WAIT_S = 0.5


@dataclass(slots=True)
class RequestError:
    """A request that failed (bad input at add, or a failed step): its stream raises `error`."""

    request_id: str
    error: Exception


Event = RequestOutput | RequestError
Emit = Callable[[list[Event], EngineStats], None]


class StepLoop:
    """Applies commands, steps while there is work, emits each iteration's events in one batch."""

    def __init__(self, engine: LLMEngine, emit: Emit):
        self.engine, self.emit = engine, emit

    def run(self, receive: Callable[[float], list[tuple] | None]) -> None:
        """`receive(timeout)`: the commands that arrived within `timeout` s, or None to stop."""
        while True:
            busy = self.engine.has_unfinished_requests()
            commands = receive(0.0 if busy else IDLE_WAIT_S)
            if commands is None:
                return
            events: list[Event] = []
            for command in commands:
                events += self._apply(command)
            if self.engine.has_unfinished_requests():
                try:
                    events += self.engine.step()
                except Exception as e:  # a failed step fails its requests, not the engine
                    logger.exception("engine step failed")
                    events += self._fail_all(e)
            if events or commands:
                self.emit(events, self.engine.get_stats())

    def _apply(self, command: tuple) -> list[Event]:
        if command[0] == "add":
            _, request_id, prompt, params, priority = command
            try:
                self.engine.add_request(request_id, prompt, params, priority)
            except ValueError as e:
                return [RequestError(request_id, e)]
            return []
        output = self.engine.abort_request(command[1])
        return [output] if output is not None else []

    def _fail_all(self, error: Exception) -> list[Event]:
        failed = list(self.engine.output_processor.states)
        for request_id in failed:
            self.engine.abort_request(request_id)
        return [RequestError(rid, RuntimeError(f"engine step failed: {error}")) for rid in failed]


class ThreadCore:
    """The step loop on a daemon thread of this process."""

    def __init__(self, config: EngineConfig, emit: Emit):
        engine = LLMEngine(config)
        self.tokenizer, self.max_model_len = engine.tokenizer, engine.max_model_len
        self.initial_stats = engine.get_stats()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stopped = False
        loop = StepLoop(engine, emit)
        self._thread = threading.Thread(target=loop.run, args=(self._receive,), name="engine-step-loop",
                                        daemon=True)
        self._thread.start()

    def send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wakeup.set()

    def _receive(self, timeout: float) -> list[tuple] | None:
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

    def __init__(self, config: EngineConfig, emit: Emit, on_exit: Callable[[Exception], None]):
        parent_sock, child_sock = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        entry = "import sys; from engine.engine_core import run_child; run_child(int(sys.argv[1]))"
        self._proc = subprocess.Popen([sys.executable, "-c", entry, str(child_sock.fileno())],
                                      pass_fds=[child_sock.fileno()], env=env)
        child_sock.close()
        self._conn = Connection(parent_sock.detach())
        self._send_lock = threading.Lock()
        self._stopped = False
        try:
            self._conn.send(config)
            status, info = self._conn.recv()
        except (EOFError, OSError) as e:
            self._proc.kill()
            raise RuntimeError(f"engine process exited during start-up (code {self._proc.wait()})") from e
        if status != "ready":
            self._proc.wait()
            raise info
        self.tokenizer, self.max_model_len = info["tokenizer"], info["max_model_len"]
        self.initial_stats: EngineStats = info["stats"]
        self._reader = threading.Thread(target=self._read, args=(emit, on_exit), name="engine-core-reader",
                                        daemon=True)
        self._reader.start()

    def send(self, command: tuple) -> None:
        with self._send_lock:
            self._conn.send(command)

    def _read(self, emit: Emit, on_exit: Callable[[Exception], None]) -> None:
        while True:
            try:
                events, stats = self._conn.recv()
            except (EOFError, OSError):
                if not self._stopped:
                    code = self._proc.wait()
                    on_exit(RuntimeError(f"engine process exited with code {code}"))
                return
            emit(events, stats)

    def shutdown(self) -> None:
        self._stopped = True
        try:
            self.send(("shutdown",))
            self._proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self._proc.kill()
            self._proc.wait()
        self._conn.close()


def run_child(fd: int) -> None:
    """The child process's main: build the engine, report ready, run the loop until told to stop
    or the parent is gone."""
    conn = Connection(fd)
    config: EngineConfig = conn.recv()
    try:
        engine = LLMEngine(config)
    except Exception as e:
        conn.send(("failed", e))
        return
    conn.send(("ready", {"tokenizer": engine.tokenizer, "max_model_len": engine.max_model_len,
                         "stats": engine.get_stats()}))

    def receive(timeout: float) -> list[tuple] | None:
        commands: list[tuple] = []
        try:
            ready = conn.poll(timeout)
            while ready:
                command = conn.recv()
                if command[0] == "shutdown":
                    return None
                commands.append(command)
                ready = conn.poll(0)
        except (EOFError, OSError):  # the parent is gone
            return None
        return commands

    def send(events: list[Event], stats: EngineStats) -> None:
        try:
            conn.send((events, stats))
        except OSError:  # the parent is gone
            raise SystemExit(0) from None

    StepLoop(engine, send).run(receive)

