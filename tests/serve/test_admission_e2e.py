"""Admission through real Ray Serve (slow): the Router deployment, the pinning request router and
HTTP through the Serve proxy, on fake engines that run one request at a time. Each test deploys
its own app and deletes it.

Steps wait on observed state, not on sleeps, so a loaded machine only makes them slower: a test
first occupies every replica (a stream it holds open, plus one request waiting behind it;
max_waiting_per_replica=1 then leaves no headroom), sends the contending requests, waits until
the Router actor holds exactly those admit() calls, and only then closes the streams. Order is
read from completion times at the client; the request after each checked boundary runs for at
least 0.5 s, more than delivery jitter.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx
import pytest
from conftest import fake_serve_app, greedy_text, sse_events
from fake_engine import FakeTokenizer

pytestmark = pytest.mark.slow

ENGINE = dict(step_delay_s=0.05, max_num_seqs=1, max_model_len=4096, num_blocks=4096)


def _config(policy: str, aging_rate: float = 0.0, num_replicas: int = 1, **router) -> dict:
    return {"engine": {"num_replicas": num_replicas},
            "router": {"policy": policy, "aging_rate": aging_rate, "max_waiting_per_replica": 1,
                       **router}}


async def _completion(client: httpx.AsyncClient, prompt: str, max_tokens: int,
                      priority: int = 0) -> float:
    """Posts a greedy completion, checks it came back whole; returns when it finished."""
    r = await client.post("/v1/completions", json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "priority": priority})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == greedy_text(FakeTokenizer().encode(prompt), max_tokens)
    return time.monotonic()


def _spawn(client: httpx.AsyncClient, prompt: str, max_tokens: int, priority: int = 0):
    return asyncio.ensure_future(_completion(client, prompt, max_tokens, priority))


def _client(url: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=200))


async def _until(check: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    """Polls `check` (it may block on Ray calls, so it runs off the event loop)."""
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(check):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def _replica_handle(app: str):
    from ray import serve

    return serve.get_deployment_handle("EngineReplica", app_name=app)


async def _occupy(client: httpx.AsyncClient, app: str, num_replicas: int):
    """Every replica runs a stream that lasts until closed, with a 1-token request waiting
    behind it; returns (streams, waiting requests). Whatever comes next queues in the router."""
    streams = []
    for i in range(num_replicas):  # one at a time: each goes to an idle replica
        request = client.build_request("POST", "/v1/completions", json={
            "prompt": f"hold{i}", "max_tokens": 2000, "stream": True})
        streams.append(await client.send(request, stream=True))  # returns at the first token
        assert streams[-1].status_code == 200
    waiting = [_spawn(client, f"wait{i}", 1) for i in range(num_replicas)]
    handle = _replica_handle(app)
    await _until(lambda: all(s.num_running == 1 and s.num_waiting == 1
                             for s in handle.broadcast("stats").results()),
                 "every replica to run one request with one waiting")
    return streams, waiting


async def _release(streams: list[httpx.Response]) -> None:
    for s in streams:
        await s.aclose()  # the engine aborts it


async def _queued(app: str, n: int) -> None:
    """Waits until the app's Router actor has exactly `n` calls in progress. With every replica
    occupied those are admit() calls waiting in the admission queue; load reports pass through
    in milliseconds, and three equal readings in a row rule them out."""
    import ray

    names = [a for a in ray.util.list_named_actors(all_namespaces=True)
             if f"{app}#Router#" in a["name"]]
    assert len(names) == 1, names
    router = ray.get_actor(names[0]["name"], namespace=names[0]["namespace"])

    def holds_n() -> bool:
        return all(ray.get(router.get_num_ongoing_requests.remote()) == n for _ in range(3))

    await _until(holds_n, f"{n} requests in the admission queue")


def test_queue_full_429_retry_after_and_admitted_complete(serve_cluster):
    """1. one occupied replica, router queue bound 3; a burst of 12 requests, half streamed.
    2. exactly 3 are queued; the other 9 get 429 with Retry-After at once, before any stream
       starts, while the queue is full.
    3. once the replica frees up, the 3 queued requests complete in full; only they (and the
       occupying ones) reached the engine, which ends idle; the next request is served."""
    with fake_serve_app(serve_cluster, "adm-full", _config("fcfs", max_queued_requests=3),
                        **ENGINE) as url:
        async def go():
            async with _client(url) as client:
                streams, waiting = await _occupy(client, "adm-full", 1)
                burst = [asyncio.ensure_future(client.post("/v1/completions", json={
                    "prompt": f"p{i}", "max_tokens": 10, "temperature": 0,
                    "stream": i % 2 == 1})) for i in range(12)]
                await _until(lambda: sum(f.done() for f in burst) == 9, "9 refusals")
                await _queued("adm-full", 3)
                refused = {i: f.result() for i, f in enumerate(burst) if f.done()}
                await _release(streams)
                await asyncio.gather(*waiting)
                return refused, dict(enumerate(await asyncio.gather(*burst)))

        refused, results = asyncio.run(go())
        for r in refused.values():
            assert r.status_code == 429, r.text
            assert int(r.headers["Retry-After"]) >= 1
            error = r.json()["error"]
            assert error["type"] == "rate_limit_exceeded" and "queue full" in error["message"]
        admitted = [i for i in results if i not in refused]
        for i in admitted:
            assert results[i].status_code == 200, results[i].text
            want = greedy_text(FakeTokenizer().encode(f"p{i}"), 10)
            if i % 2:
                events = sse_events(results[i].text)
                assert events[-1] == "[DONE]"
                assert "".join(e["choices"][0]["text"] for e in events[:-1]) == want
            else:
                assert results[i].json()["choices"][0]["text"] == want
        handle = _replica_handle("adm-full")
        # the warm-up request, the two occupying ones and the three admitted
        assert handle.routing_counters.remote().result()["received"] == 1 + 2 + 3
        stats = handle.stats.remote().result()
        assert stats.num_running == 0 and stats.num_waiting == 0
        assert httpx.post(url + "/v1/completions", json={"prompt": "again", "max_tokens": 2},
                          timeout=60).status_code == 200


def test_priority_classes_at_overload_high_first_across_two_replicas(serve_cluster):
    """1. two occupied replicas; 6 low-priority (5) requests queue in the router, then 6
       high-priority (0) ones.
    2. the replicas free up: every high request completes before any low one, and both
       replicas served the queued requests.
    The replicas need not run in step, so a low request takes 0.8 s and a high one 0.1 s: the
    last high is dispatched before the first low and finishes at most two high service times
    later, well before any low can finish."""
    app = "adm-priority"
    with fake_serve_app(serve_cluster, app, _config("priority", num_replicas=2), **ENGINE) as url:
        async def go():
            async with _client(url) as client:
                streams, waiting = await _occupy(client, app, 2)
                low = [_spawn(client, f"low{i}", 16, priority=5) for i in range(6)]
                await _queued(app, 6)
                high = [_spawn(client, f"high{i}", 2, priority=0) for i in range(6)]
                await _queued(app, 12)
                await _release(streams)
                await asyncio.gather(*waiting)
                return await asyncio.gather(*low), await asyncio.gather(*high)

        low_done, high_done = asyncio.run(go())
        assert max(high_done) < min(low_done)
        counters = _replica_handle(app).broadcast("routing_counters").results()
        assert len(counters) == 2
        # 2 occupying requests each (one replica also got the warm-up) + the queued ones
        assert sum(c["received"] for c in counters) == 1 + 4 + 12
        assert all(c["received"] > 3 and c["misrouted"] == 0 for c in counters), counters


def test_sjf_short_request_overtakes_long_ones(serve_cluster):
    """1. one occupied replica; three 15-token requests queue in the router, then a 2-token one.
    2. the replica frees up: the short request completes before every long one."""
    app = "adm-sjf"
    with fake_serve_app(serve_cluster, app, _config("sjf"), **ENGINE) as url:
        async def go():
            async with _client(url) as client:
                streams, waiting = await _occupy(client, app, 1)
                longs = [_spawn(client, f"long{i}", 15) for i in range(3)]
                await _queued(app, 3)
                short = _spawn(client, "short", 2)
                await _queued(app, 4)
                await _release(streams)
                await asyncio.gather(*waiting)
                return await short, await asyncio.gather(*longs)

        short_done, long_done = asyncio.run(go())
        assert short_done < min(long_done)


def test_aging_serves_starved_request_within_bound(serve_cluster):
    """Priority policy, aging 5 classes/s: a priority-15 request ranks like a priority-0 one that
    arrived 3 s after it (its bound).
    1. one occupied replica; the starved request queues, then 3 priority-0 requests within 3 s
       of it (checked), then, more than 3 s after it was queued, 3 more.
    2. the replica frees up: the first 3 complete before it (they outrank it: without aging it
       would wait behind every priority-0 request), the last 3 after it. The starved and the
       last 3 requests take 0.5 s each, so completions on either side are 0.5 s apart."""
    app, bound_s = "adm-aging", 15 / 5.0
    with fake_serve_app(serve_cluster, app, _config("priority", aging_rate=5.0, priority_range=[0, 15]),
                        **ENGINE) as url:
        async def go():
            async with _client(url) as client:
                streams, waiting = await _occupy(client, app, 1)
                sent = time.monotonic()
                starved = _spawn(client, "starved", 10, priority=15)
                await _queued(app, 1)
                queued = time.monotonic()
                early = [_spawn(client, f"early{i}", 2) for i in range(3)]
                await _queued(app, 4)
                assert time.monotonic() - sent < bound_s, "too slow to queue within the bound"
                await asyncio.sleep(queued + bound_s + 0.1 - time.monotonic())
                late = [_spawn(client, f"late{i}", 10) for i in range(3)]
                await _queued(app, 7)
                await _release(streams)
                await asyncio.gather(*waiting)
                return (await asyncio.gather(*early), await starved,
                        await asyncio.gather(*late))

        early_done, starved_done, late_done = asyncio.run(go())
        assert max(early_done) < starved_done < min(late_done)
