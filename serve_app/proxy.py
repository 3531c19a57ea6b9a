"""Connection hygiene: a deadline on request headers (in Serve's HTTP proxy and the own port), and
requests cancelled when their client leaves (CancelOnDisconnect).

Serve's proxy runs uvicorn, which closes idle keep-alive connections after a response
(`http_options.keep_alive_timeout_s` in the serve YAML) but never a connection whose request
headers do not complete: a client sending them slowly holds the connection forever. Ray calls
the function named by RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH in the proxy process before its
server starts; `install` (this module's) registers, as uvicorn's "auto" HTTP protocol (the one
Serve uses), the same protocol with a deadline: a connection whose next request's headers are
not complete within CBSERVE_HEADER_TIMEOUT_S seconds (default 10) of opening or of the previous
response is closed. Slow bodies are the ingress's (408 after ingress.body_timeout_s).

The ingress replicas' own port (serve_app.shared_port) serves with the same protocol, so the
deadline holds whichever front door takes the connection. `make serve` (serve_app/launch.py) sets
the variable; a Ray cluster started without it serves the proxy without the header deadline.
"""

from __future__ import annotations

import asyncio
import logging
import os

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn import config as uvicorn_config
from uvicorn.protocols.http.auto import AutoHTTPProtocol

logger = logging.getLogger("cbserve.proxy")
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
