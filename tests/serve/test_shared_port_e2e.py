"""Real Ray Serve (slow): two ingress replicas serving one port (ingress.shared_port, the front door
`make serve` picks for several ingress replicas) in front of the fake engine. The session
cluster's header deadline (conftest.HEADER_TIMEOUT_S) and keep-alive timeout hold there too."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import psutil
import pytest
from conftest import HEADER_TIMEOUT_S, fake_serve_app, free_port, greedy_text, seconds_until_closed, sse_events
from fake_engine import FakeTokenizer

pytestmark = pytest.mark.slow

APP = "sharedport"


@pytest.fixture(scope="module")
def shared_app(serve_cluster):
    port = free_port()
    config = {"ingress": {"num_replicas": 2, "shared_port": {"port": port, "keep_alive_timeout_s": 3.0}}}
    with fake_serve_app(serve_cluster, APP, config, step_delay_s=0.01) as url:
        yield url, port


def ingress_replicas() -> set[int]:
    return {p.pid for p in psutil.process_iter(["cmdline"])
            if f"ServeReplica:{APP}:Ingress" in " ".join(p.info["cmdline"] or [])}


def serving_pids(port: int) -> set[int]:
    """The processes holding connections accepted on `port`."""
    return {c.pid for c in psutil.net_connections("tcp")
            if c.laddr and c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED and c.pid}


def keep_alive_requests(port: int, n: int) -> list[socket.socket]:
    """`n` connections, each having had a /health answered and kept open."""
    held = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
        held.append(s)
    return held


def completions(url: str, n: int) -> list[str]:
    """`n` streamed completions at once, each on a connection of its own; their texts."""
    async def one(i: int) -> str:
        async with httpx.AsyncClient(timeout=60) as client:
            r = await client.post(url + "/v1/completions", json={
                "prompt": f"p{i}", "max_tokens": 6, "temperature": 0, "stream": True})
            assert r.status_code == 200, r.text
            events = sse_events(r.text)
            assert events[-1] == "[DONE]"
            return "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])

    async def every():
        return await asyncio.gather(*(one(i) for i in range(n)))

    return asyncio.run(every())


def test_both_ingress_replicas_take_connections_on_the_one_port(shared_app):
    url, port = shared_app
    expected = [greedy_text(FakeTokenizer().encode(f"p{i}"), 6) for i in range(16)]
    assert completions(url, 16) == expected
    replicas = ingress_replicas()
    assert len(replicas) == 2
    held = keep_alive_requests(port, 32)  # each hashed to one replica: both ~1 - 2**-31
    try:
        assert serving_pids(port) == replicas
    finally:
        for s in held:
            s.close()


def test_headers_not_finished_in_time_are_closed_on_the_shared_port(shared_app):
    _, port = shared_app
    slow = socket.create_connection(("127.0.0.1", port), timeout=30)
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # the headers never end
    assert seconds_until_closed(slow, HEADER_TIMEOUT_S + 10) < HEADER_TIMEOUT_S + 2.5


def test_a_killed_ingress_replica_leaves_the_port_to_the_other_and_comes_back(shared_app):
    """1. kill one ingress replica's process; 2. every request right after is answered (the kernel
    takes a dead listener out of the port's group); 3. Serve's new replica listens there again."""
    url, port = shared_app
    before = ingress_replicas()
    victim = psutil.Process(min(before))
    victim.kill()
    victim.wait(30)
    survivor = before - {victim.pid}
    for i in range(8):
        r = httpx.post(url + "/v1/completions", json={"prompt": f"q{i}", "max_tokens": 2, "temperature": 0},
                       timeout=30)
        assert r.status_code == 200, r.text
    deadline = time.monotonic() + 60
    while True:
        replicas = ingress_replicas()
        if len(replicas) == 2 and survivor < replicas:
            held = keep_alive_requests(port, 32)
            try:
                if serving_pids(port) == replicas:
                    break
            finally:
                for s in held:
                    s.close()
        assert time.monotonic() < deadline, f"no second ingress replica took the port: {replicas}"
        time.sleep(0.5)


def test_streams_in_flight_on_the_shared_port_finish_when_the_app_is_deleted(serve_cluster):
    """1. four streams of 800 tokens (~8 s each) start on the shared port; 2. the app is deleted
    (Serve stops every replica; it does not count these requests as the ingress's own); 3. each
    stream still ends with its 800 tokens and [DONE]."""
    from ray import serve

    name = "shareddrain"
    config = {"ingress": {"num_replicas": 2, "shared_port": {"port": free_port()}}}
    with fake_serve_app(serve_cluster, name, config, step_delay_s=0.01, max_model_len=4096) as url:
        async def stream(client: httpx.AsyncClient, i: int) -> str:
            r = await client.post(url + "/v1/completions", json={
                "prompt": f"d{i}", "max_tokens": 800, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}})
            assert r.status_code == 200, r.text
            return r.text

        async def go() -> list[str]:
            async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_keepalive_connections=0)) as client:
                streams = [asyncio.create_task(stream(client, i)) for i in range(4)]
                await asyncio.sleep(0.5)
                await asyncio.to_thread(serve.delete, name)
                return await asyncio.gather(*streams)

        bodies = asyncio.run(go())
    for body in bodies:
        events = sse_events(body)
        assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 800
