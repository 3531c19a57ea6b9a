"""One HTTP port served by every ingress replica of a node (`make serve`'s front door): each binds
it with SO_REUSEPORT and the kernel spreads new connections over the replicas listening.

A burst's intake is the ingress's Python, about a millisecond of one process's CPU a request
(BENCHMARKS.md), so taking it in faster needs more ingress processes. Serve's direct ingress gives
each ingress replica a port of its own, which no client spreads over, and binds it without
SO_REUSEADDR (a restart then waits out the TIME_WAIT of the connections it closed); Serve's proxy
spreads requests over the replicas but puts a process of its own and a hop before each; Ray's
HAProxy front door has no setting for a deadline on request headers. Here the replicas take the
connections themselves, with the header deadline of serve_app.proxy (its protocol serves this
port) and keep-alive connections closed when idle, as Serve's own servers do. The listening
socket binds with SO_REUSEADDR, which the connections it accepts inherit, so a server started
right after a stop binds the port over them.

A replica listens once it is built and drains when Serve stops it (the app's lifespan): it closes
its socket first, so new connections go to the replicas still listening, and finishes the
requests it holds, which Serve does not count as its own. Port sharing is per node and per user:
on a cluster each node's ingress replicas share that node's port.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator

import uvicorn
from starlette.types import ASGIApp

from serve_app.config import SharedPortConfig
from serve_app.proxy import HeaderDeadlineProtocol

logger = logging.getLogger("cbserve.shared_port")


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
