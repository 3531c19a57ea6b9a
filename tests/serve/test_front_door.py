"""serve_app.front_door without Ray: two servers (as two ingress replicas would run them) on one
port, each answering with its own name, in an event loop of their own."""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from serve_app.config import SharedPortConfig
from serve_app.front_door import HEADER_TIMEOUT_ENV, CancelOnDisconnect, SharedPortServer, shared_socket
from tests.conftest import free_port, seconds_until_closed

HEADER_TIMEOUT_S = 0.5
KEEP_ALIVE_TIMEOUT_S = 0.5


def named_app(name: str) -> Starlette:
    async def who(_):
        return PlainTextResponse(name)

    async def slow(_):
        await asyncio.sleep(3.0)
        return PlainTextResponse(name)

    return Starlette(routes=[Route("/who", who), Route("/slow", slow)])


class Loop:
    """An event loop on a thread of its own; `call` runs a function on it and returns its result."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, fn, *args):
        async def run():
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(10)

    def start(self, coroutine) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def servers(monkeypatch) -> Iterator[tuple[int, Loop, dict[str, SharedPortServer]]]:
    monkeypatch.setenv(HEADER_TIMEOUT_ENV, str(HEADER_TIMEOUT_S))
    port, loop = free_port(), Loop()
    config = SharedPortConfig(port=port, keep_alive_timeout_s=KEEP_ALIVE_TIMEOUT_S)
    started = {name: loop.call(SharedPortServer, named_app(name), config) for name in ("a", "b")}
    for server in started.values():
        _wait(lambda s=server: s.server.started)
    try:
        yield port, loop, started
    finally:
        for server in started.values():
            loop.start(server.drain()).result(10)
        loop.close()


def _wait(done, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def _send(port: int, path: str = "/who") -> socket.socket:
    s = _connect(port)
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    return s


def _answer(s: socket.socket) -> str:
    """The body of the response on `s`: the name of the server that answered."""
    with s:
        response = b""
        while part := s.recv(65536):
            response += part
    head, body = response.decode().split("\r\n\r\n", 1)
    assert head.startswith("HTTP/1.1 200"), head
    return body


def _who(port: int) -> str:
    """The name of the server that answers a new connection."""
    return _answer(_send(port))


def test_the_kernel_spreads_connections_over_every_server_on_the_port(servers):
    port, _, _ = servers
    answered = Counter(_who(port) for _ in range(64))
    assert set(answered) == {"a", "b"}, answered  # each of 64 connections hashed to one: both ~1 - 2**-63


def test_a_draining_server_finishes_its_requests_and_leaves_new_connections_to_the_others(servers):
    """1. slow requests (3 s each) in flight on both servers; 2. "a" drains: its socket closes at
    once, so every new connection is "b"'s; 3. the slow requests are all answered, and the drain
    ends once "a"'s are."""
    port, loop, started = servers
    slow = [_send(port, "/slow") for _ in range(16)]
    time.sleep(0.2)  # accepted and in the handler
    drained = loop.start(started["a"].drain())
    _wait(lambda: started["a"].socket.fileno() == -1)  # uvicorn closes it at its next tick
    assert Counter(_who(port) for _ in range(32)) == {"b": 32}
    assert not drained.done()
    assert set(map(_answer, slow)) == {"a", "b"}  # each of 16 hashed to one: both ~1 - 2**-15
    drained.result(10)


def test_headers_not_finished_in_time_and_idle_keep_alive_are_closed(servers):
    port, _, _ = servers
    slow = _connect(port)
    slow.sendall(b"GET /who HTTP/1.1\r\nHost: x\r\n")  # the blank line that ends the headers never comes
    assert seconds_until_closed(slow, HEADER_TIMEOUT_S + 5) < HEADER_TIMEOUT_S + 1.5
    idle = _connect(port)
    idle.sendall(b"GET /who HTTP/1.1\r\nHost: x\r\n\r\n")
    assert seconds_until_closed(idle, KEEP_ALIVE_TIMEOUT_S + 5) < KEEP_ALIVE_TIMEOUT_S + 1.5


def test_a_port_held_by_a_listener_that_does_not_share_it_is_refused():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        with pytest.raises(OSError):
            shared_socket("127.0.0.1", held.getsockname()[1])


def _asgi_request(left: asyncio.Event):
    """A request's receive: its body, then (once `left` is set) the client's disconnect."""
    sent_body = False

    async def receive():
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": b"{}", "more_body": False}
        await left.wait()
        return {"type": "http.disconnect"}

    return receive


def test_a_request_whose_client_leaves_before_its_answer_is_cancelled_where_it_waits():
    """As Serve's front doors do: a request queued for admission, whose client has gone, is
    cancelled (its jobs then withdraw), and the server sees no error."""
    events = []

    async def waits_for_admission(scope, receive, send):
        assert (await receive())["type"] == "http.request"
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            events.append("cancelled")
            raise

    async def go():
        left = asyncio.Event()
        call = asyncio.ensure_future(CancelOnDisconnect(waits_for_admission)({"type": "http"}, _asgi_request(left),
                                                                              None))
        await asyncio.sleep(0.01)
        assert not call.done()
        left.set()
        await asyncio.wait_for(call, 5)  # returns: the client's leaving is no server error
        assert events == ["cancelled"] and not call.cancelled()

    asyncio.run(go())


def test_an_answered_request_is_not_cancelled_and_a_server_side_cancellation_still_propagates():
    sent = []

    async def answers(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok", "more_body": False})

    async def go():
        closed = asyncio.Event()  # as uvicorn's: the request reads as a disconnect once its answer is complete

        async def send(message):
            sent.append(message["type"])
            if message["type"] == "http.response.body" and not message.get("more_body"):
                closed.set()

        await CancelOnDisconnect(answers)({"type": "http"}, _asgi_request(closed), send)
        assert sent == ["http.response.start", "http.response.body"]

        async def waits(scope, receive, send):
            await asyncio.Event().wait()

        call = asyncio.ensure_future(CancelOnDisconnect(waits)({"type": "http"}, _asgi_request(asyncio.Event()),
                                                               send))
        await asyncio.sleep(0.01)
        call.cancel()  # the server stopping it: not the client's leaving
        with pytest.raises(asyncio.CancelledError):
            await call

    asyncio.run(go())
