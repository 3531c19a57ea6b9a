"""The front doors' HTTP: one port served by every ingress replica of a node (`make serve`'s
front door: each binds it with SO_REUSEPORT and the kernel spreads new connections over the
replicas listening), a deadline on request headers (on that port and in Serve's HTTP proxy), and
requests cancelled when their client leaves (CancelOnDisconnect, on either door).

A burst's intake is the ingress's Python, about a millisecond of one process's CPU a request
(BENCHMARKS.md), so taking it in faster needs more ingress processes. Serve's direct ingress gives
each ingress replica a port of its own, which no client spreads over, and binds it without
SO_REUSEADDR (a restart then waits out the TIME_WAIT of the connections it closed); Serve's proxy
spreads requests over the replicas but puts a process of its own and a hop before each; Ray's
HAProxy front door has no setting for a deadline on request headers. Here the replicas take the
connections themselves, with the header deadline below and keep-alive connections closed when
idle, as Serve's own servers do. The listening socket binds with SO_REUSEADDR, which the
connections it accepts inherit, so a server started right after a stop binds the port over them.

A replica listens once it is built and drains when Serve stops it (the app's lifespan): it closes
its socket first, so new connections go to the replicas still listening, and finishes the
requests it holds, which Serve does not count as its own. Port sharing is per node and per user:
on a cluster each node's ingress replicas share that node's port.

Serve's proxy runs uvicorn, which closes idle keep-alive connections after a response
(`http_options.keep_alive_timeout_s` in the serve YAML) but never a connection whose request
headers do not complete: a client sending them slowly holds the connection forever. Ray calls
the function named by RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH in the proxy process before its
server starts; `install` (this module's) registers, as uvicorn's "auto" HTTP protocol (the one
Serve uses), the same protocol with a deadline: a connection whose next request's headers are
not complete within CBSERVE_HEADER_TIMEOUT_S seconds (default 10) of opening or of the previous
response is closed. Slow bodies are the ingress's (408 after ingress.body_timeout_s).

The ingress replicas' own port serves with the same protocol, so the deadline holds whichever
front door takes the connection. `make serve` (serve_app/launch.py) sets the variable; a Ray
cluster started without it serves the proxy without the header deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Iterator

import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn import config as uvicorn_config
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from serve_app.config import SharedPortConfig

logger = logging.getLogger("cbserve.front_door")
HEADER_TIMEOUT_ENV = "CBSERVE_HEADER_TIMEOUT_S"
DEFAULT_HEADER_TIMEOUT_S = 10.0


def header_timeout_s() -> float:
    return float(os.environ.get(HEADER_TIMEOUT_ENV, DEFAULT_HEADER_TIMEOUT_S))


class HeaderDeadlineProtocol(AutoHTTPProtocol):  # type: ignore[valid-type, misc]
    """uvicorn's HTTP protocol; a request that has not started (headers complete) by its
    deadline closes the connection. uvicorn starts a new request cycle object when headers
    complete, so "no new cycle since the deadline was armed" means the headers never came."""

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._arm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_deadline()

    def _arm_header_deadline(self) -> None:
        self.loop.call_later(header_timeout_s(), self._header_deadline, self.cycle)

    def _header_deadline(self, cycle_when_armed: object) -> None:
        if self.cycle is cycle_when_armed and not self.transport.is_closing():
            self.transport.close()


def install() -> list:
    """The proxy callback: registers the protocol; returns no middlewares."""
    uvicorn_config.HTTP_PROTOCOLS["auto"] = f"{__name__}:HeaderDeadlineProtocol"
    logger.info("HTTP header deadline %.1f s", header_timeout_s())
    return []


class CancelOnDisconnect:
    """A request whose client leaves is cancelled wherever it is (queued for admission, waiting for
    its first token, streaming): its jobs withdraw their admissions and the engine aborts them. A
    server tells the app only when it next reads the request: here a listener reads it for the
    app, passing its messages on through a queue. The front end installs it (serve_app.ingress),
    so it holds on every front door."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = asyncio.current_task()
        if scope["type"] != "http" or handler is None:
            await self.app(scope, receive, send)
            return
        messages: asyncio.Queue[Message] = asyncio.Queue()
        answered = False

        async def listen() -> bool:
            """Whether the client left before its answer (and the handler was cancelled)."""
            while True:
                message = await receive()
                messages.put_nowait(message)
                if message["type"] == "http.disconnect":  # left, or the answer is complete
                    if not answered:
                        handler.cancel()
                    return not answered

        async def answer(message: Message) -> None:
            nonlocal answered
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                answered = True
            await send(message)

        listener = asyncio.ensure_future(listen())
        try:
            await self.app(scope, messages.get, answer)
        except asyncio.CancelledError:
            left = listener.done() and not listener.cancelled() and listener.result()
            if not left or handler.uncancel() > 0:  # not (only) the client's leaving
                raise
        finally:
            listener.cancel()


def shared_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) that other processes of this user may bind too."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server, leaving the process's signal handlers to Ray: a replica ends as Serve
    ends it, not on a signal this server would take for itself."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class SharedPortServer:
    """`app` served on `config`'s shared address from the running event loop, until `drain`."""

    def __init__(self, app: ASGIApp, config: SharedPortConfig):
        self.socket = shared_socket(config.host, config.port)
        self.server = _Server(uvicorn.Config(
            app, http=HeaderDeadlineProtocol, loop="none", lifespan="off", access_log=False,
            log_config=None,
            timeout_keep_alive=config.keep_alive_timeout_s))  # type: ignore[arg-type]  # uvicorn takes float seconds
        self.task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[self.socket]))
        self.task.add_done_callback(self._ended)
        logger.info("serving HTTP on %s:%d, shared with the node's other ingress replicas", config.host, config.port)

    async def drain(self) -> None:
        """Closes the socket and the idle keep-alive connections, and returns once the requests in
        flight are done (uvicorn's shutdown; Serve's graceful shutdown timeout bounds it)."""
        self.server.should_exit = True
        await asyncio.shield(self.task)

    @staticmethod
    def _ended(task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.error("the shared port's server failed", exc_info=task.exception())
