"""Real Ray Serve, real engine (tiny random Llama, word tokenizer), through HTTP (slow): one
regression test per failure of the hardening report. The app has API keys ("ops": the whole
priority range; "batch": [5, 10]), a 1 s body deadline, and a replica running 4 sequences with
its step loop in a child process. The session cluster's proxy has the header deadline
(serve_app.front_door, 2 s) and a 3 s keep-alive timeout (conftest.serve_cluster)."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from urllib.parse import urlparse

import httpx
import psutil
import pytest
from conftest import (
    HEADER_TIMEOUT_S,
    KEEP_ALIVE_TIMEOUT_S,
    STARTUP_BOUND_S,
    run_app,
    seconds_until_closed,
    sse_events,
    wait_healthy,
)

pytestmark = pytest.mark.slow

OPS = {"Authorization": "Bearer ops"}
BATCH = {"Authorization": "Bearer batch"}
ERROR_KEYS = {"message", "type", "param", "code"}
APP = "hard"


@pytest.fixture(scope="module")
def hard_app(serve_cluster, tiny_llama_words):
    from ray import serve

    from serve_app.config import AppConfig

    cfg = AppConfig.model_validate({
        "engine": {"model": tiny_llama_words, "served_model_name": "tiny", "num_replicas": 1,
                   "num_cpus": 0.5, "stream_flush_interval_s": 0.0,
                   "engine_args": {"max_num_seqs": 4, "seed": 0}},
        "router": {"max_waiting_per_replica": 2, "max_queued_tokens": 20_000},
        "ingress": {"api_keys": ["ops", {"key": "batch", "priority_range": [5, 10]}],
                    "body_timeout_s": 1.0},
    })
    url = run_app(cfg, APP)
    wait_healthy(url, STARTUP_BOUND_S)
    yield url
    serve.delete(APP)


def _post(url: str, body: dict, headers: dict = OPS, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(url + path, json=body, headers=headers, timeout=60)


def _error(r: httpx.Response, status: int, needle: str = "") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == ERROR_KEYS and needle in err["message"], err
    return err


def _greedy(url: str, prompt: str, n: int = 8) -> str:
    r = _post(url, {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_1_9_priority_out_of_range_is_400_and_the_server_keeps_serving(hard_app):
    for priority in (10**400, -10**18, 11):
        _error(_post(hard_app, {"prompt": "hi", "max_tokens": 2, "priority": priority}), 400, "priority")
        assert _post(hard_app, {"prompt": "hi", "max_tokens": 2}).status_code == 200
        assert _post(hard_app, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                     path="/v1/chat/completions").status_code == 200
    _error(_post(hard_app, {"prompt": "hi", "max_tokens": 1, "priority": 0}, BATCH), 400, "[5, 10]")
    assert _post(hard_app, {"prompt": "hi", "max_tokens": 1, "priority": 0}, OPS).status_code == 200


def test_2_multi_prompt_requests_finish_and_do_not_stall_others(hard_app):
    """8 prompts on a replica that runs 4 and queues 2 (more than it admits at once) finish; a
    second client's request during it is served."""
    async def go():
        async with httpx.AsyncClient(timeout=60, headers=OPS) as client:
            async def big(n):
                t0 = time.monotonic()
                r = await client.post(hard_app + "/v1/completions", json={
                    "prompt": [f"the cat {i}" for i in range(n)], "max_tokens": 16, "ignore_eos": True})
                return r, time.monotonic() - t0

            async def small():
                await asyncio.sleep(0.2)
                return await client.post(hard_app + "/v1/completions", json={"prompt": "dogs", "max_tokens": 4})

            (r4, _), (r8, s8), rs = await asyncio.gather(big(4), big(8), small())
            assert r4.status_code == 200 and len(r4.json()["choices"]) == 4
            assert r8.status_code == 200 and [c["index"] for c in r8.json()["choices"]] == list(range(8))
            assert all(c["finish_reason"] == "length" for c in r8.json()["choices"])
            assert rs.status_code == 200
            assert s8 < 30, s8

    asyncio.run(go())


def test_3_bad_sampling_values_are_400_and_batch_mates_are_unchanged(hard_app):
    """Three greedy streams alone, then again with out-of-range top_k/seed requests sent while
    they run: identical text."""
    prompts = ["the cat sat", "dogs ran", "old ships sang"]

    async def run(with_bad: bool):
        async with httpx.AsyncClient(timeout=60, headers=OPS) as client:
            async def good(p):
                r = await client.post(hard_app + "/v1/completions", json={
                    "prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]

            async def bad(body):
                await asyncio.sleep(0.05)
                return await client.post(hard_app + "/v1/completions", json={"prompt": "hi", **body})

            bodies = [{"top_k": 2**63}, {"seed": 2**64}, {"temperature": "hot"}] if with_bad else []
            results = await asyncio.gather(*(good(p) for p in prompts), *(bad(b) for b in bodies))
            for r in results[len(prompts):]:
                _error(r, 400)
            return results[:len(prompts)]

    alone = asyncio.run(run(False))
    assert asyncio.run(run(True)) == alone


def _engine_child(app: str) -> psutil.Process:
    """The step-loop process: the one child of the app's engine actor (Ray titles an actor's
    process ray::<class name>; with one engine replica, the front end and the router run in it: IngressRouterEngine)."""
    title = f"ServeReplica:{app}:IngressRouterEngine"
    replicas = [p for p in psutil.process_iter(["cmdline"]) if title in " ".join(p.info["cmdline"] or [])
                and not p.info["cmdline"][0].endswith("python")]
    assert len(replicas) == 1, replicas
    children = replicas[0].children()
    assert len(children) == 1, children
    return children[0]


def test_4_killed_step_loop_errors_in_flight_streams_and_the_replica_heals(hard_app):
    """Kill the step-loop process under load: each in-flight stream ends with an error event and
    [DONE]; /health and new requests succeed again within a bound (printed)."""
    async def go():
        async with httpx.AsyncClient(timeout=120, headers=OPS) as client:
            streaming = [asyncio.Event() for _ in range(4)]

            async def stream(i):
                async with client.stream("POST", hard_app + "/v1/completions", json={
                        "prompt": f"long story {i}", "max_tokens": 500, "ignore_eos": True,
                        "stream": True}) as r:
                    assert r.status_code == 200
                    parts = []
                    async for part in r.aiter_text():
                        parts.append(part)
                        streaming[i].set()
                    return sse_events("".join(parts))

            tasks = [asyncio.ensure_future(stream(i)) for i in range(4)]
            for event in streaming:
                await event.wait()
            victim = _engine_child(APP)
            victim.kill()
            t_kill = time.monotonic()
            results = await asyncio.gather(*tasks)
            return results, t_kill, victim.pid

    results, t_kill, old_pid = asyncio.run(go())
    for events in results:
        assert events[-1] == "[DONE]"
        assert "error" in events[-2], events[-2]
    deadline = t_kill + 60
    while True:
        r = _post(hard_app, {"prompt": "back again", "max_tokens": 3})
        if r.status_code == 200:
            break
        _error(r, 503)
        assert time.monotonic() < deadline, "not recovered within 60 s"
        time.sleep(0.2)
    recovered = time.monotonic() - t_kill
    print(f"recovery after step-loop kill: {recovered:.1f} s")
    assert _engine_child(APP).pid != old_pid
    assert httpx.get(hard_app + "/health", timeout=5).status_code == 200


def test_5_requests_that_can_never_fit_are_refused_at_once(hard_app):
    t0 = time.monotonic()
    err = _error(_post(hard_app, {"prompt": ["hi"] * 300, "max_tokens": 1}), 400, "at most 64 prompts")
    assert err["code"] == "too_many_prompts"
    err = _error(_post(hard_app, {"prompt": ["hi"] * 60, "max_tokens": 400, "n": 2}), 413, "holds at most 20000")
    assert err["code"] == "request_too_large"
    assert time.monotonic() - t0 < 5


def test_6_bodies_python_cannot_take_are_400(hard_app):
    deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for path, body in [("/v1/completions", deep),
                       ("/v1/completions", b'{"prompt": "abc\\ud800def"}'),
                       ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}')]:
        r = httpx.post(hard_app + path, content=body, timeout=30,
                       headers={**OPS, "content-type": "application/json"})
        _error(r, 400)
    assert _post(hard_app, {"prompt": "hi", "max_tokens": 1}).status_code == 200


def test_7_a_tiny_temperature_is_greedy(hard_app):
    greedy = _greedy(hard_app, "the cat sat")
    r = _post(hard_app, {"prompt": "the cat sat", "max_tokens": 8, "temperature": 1e-300, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy and greedy.strip()


def test_8_loose_types_and_non_openai_shapes(hard_app):
    for body in [{"prompt": "x", "stream": "yes"}, {"prompt": "x", "stream": 1},
                 {"prompt": "x", "max_tokens": True}, {"prompt": "x", "max_tokens": "5"},
                 {"prompt": "x", "max_tokens": 2.0}, {"prompt": [True, False]}, {"prompt": [1.0, 2.0]}]:
        _error(_post(hard_app, body), 400)
    _error(httpx.get(hard_app + "/v1/nothing", headers=OPS), 404)
    _error(httpx.get(hard_app + "/v1/completions", headers=OPS), 405)
    _error(httpx.post(hard_app + "/v1/completions", content=b'{"prompt": "x"}',
                      headers={**OPS, "content-type": "text/plain"}), 415)


def _socket(url: str) -> socket.socket:
    u = urlparse(url)
    return socket.create_connection((u.hostname, u.port), timeout=30)


def test_10_slow_headers_idle_keep_alive_and_unfinished_bodies_are_closed(hard_app):
    path = urlparse(hard_app).path
    # headers trickling in, one line per 0.5 s, never finished: closed at the header deadline
    slow = _socket(hard_app)
    slow.sendall(f"POST {path}/v1/completions HTTP/1.1\r\nHost: x\r\n".encode())
    t0 = time.monotonic()
    closed = False
    for i in range(int(4 * HEADER_TIMEOUT_S / 0.5)):
        time.sleep(0.5)
        try:
            slow.sendall(f"X-Slow-{i}: y\r\n".encode())
        except OSError:
            closed = True
            break
    if not closed:
        seconds_until_closed(slow, 1)
    assert time.monotonic() - t0 < HEADER_TIMEOUT_S + 2.5
    # a finished request, then idle: closed within the keep-alive timeout
    idle = _socket(hard_app)
    idle.sendall(f"GET {path}/health HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    assert seconds_until_closed(idle, KEEP_ALIVE_TIMEOUT_S + 5) < KEEP_ALIVE_TIMEOUT_S + 2
    # a body that never finishes: 408 after the ingress's body deadline
    body = _socket(hard_app)
    body.sendall(f"POST {path}/v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ops\r\n"
                 f"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"prompt\": ".encode())
    body.settimeout(15)
    response = b""
    while b"}}" not in response:
        part = body.recv(65536)
        assert part, response
        response += part
    head, payload = response.decode().split("\r\n\r\n", 1)
    assert head.startswith("HTTP/1.1 408"), head
    assert json.loads(payload)["error"]["code"] == "request_timeout"
    assert _post(hard_app, {"prompt": "hi", "max_tokens": 1}).status_code == 200


def test_11_keys_guard_every_route(hard_app):
    _error(httpx.get(hard_app + "/openapi.json"), 401)
    _error(httpx.get(hard_app + "/openapi.json", headers={"Authorization": "Bearer opz"}), 401)
    assert "CompletionRequest" in httpx.get(hard_app + "/openapi.json", headers=OPS).json()["components"]["schemas"]
    _error(_post(hard_app, {"prompt": "x"}, headers={}), 401)
