"""The four admission scenarios, written once and run against two stacks: the in-process one
behind uvicorn (test_router.py) and real Ray Serve (test_admission_e2e.py), both on fake engines
that run one request at a time.

Steps wait on observed state, not on sleeps, so a loaded machine only makes them slower: a
scenario first occupies every replica (a stream it holds open, plus one request waiting behind
it; max_waiting_per_replica=1 then leaves no headroom), sends the contending requests, waits
until the router holds exactly those admissions, and only then closes the streams. Order is read
from completion times at the client; the request after each checked boundary runs for at least
0.5 s, more than delivery jitter.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
from conftest import greedy_text, sse_events
from fake_engine import FakeTokenizer

ENGINE = dict(step_delay_s=0.05, max_num_seqs=1, max_model_len=4096, num_blocks=4096)


@dataclass
class Stack:
    """What a scenario needs to see of a running app: its URL and the router's and replicas'
    state (async, as reading it may take Ray calls)."""

    url: str
    replica_stats: Callable[[], Awaitable[list[Any]]]  # each replica's engine stats
    routing_counters: Callable[[], Awaitable[list[dict]]]  # each replica's {"received", "misrouted"}
    num_queued: Callable[[], Awaitable[int]]  # admissions the router holds


@dataclass(frozen=True)
class Scenario:
    config: dict  # AppConfig overrides
    run: Callable[[Stack], Awaitable[None]]


def _config(policy: str, aging_rate: float = 0.0, num_replicas: int = 1, **router) -> dict:
    return {"engine": {"num_replicas": num_replicas},
            "router": {"policy": policy, "aging_rate": aging_rate, "max_waiting_per_replica": 1, **router}}


async def _completion(client: httpx.AsyncClient, prompt: str, max_tokens: int, priority: int = 0) -> float:
    """Posts a greedy completion, checks it came back whole; returns when it finished."""
    r = await client.post("/v1/completions", json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "priority": priority})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == greedy_text(FakeTokenizer().encode(prompt), max_tokens)
    return time.monotonic()


def _spawn(client: httpx.AsyncClient, prompt: str, max_tokens: int, priority: int = 0):
    return asyncio.ensure_future(_completion(client, prompt, max_tokens, priority))


def _client(stack: Stack) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=stack.url, timeout=60, limits=httpx.Limits(max_connections=200))


async def _until(check: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def _queued(stack: Stack, n: int) -> None:
    async def holds_n() -> bool:  # three equal readings in a row: load reports pass through in ms
        for _ in range(3):
            if await stack.num_queued() != n:
                return False
        return True

    await _until(holds_n, f"{n} requests in the admission queue")


async def _occupy(client: httpx.AsyncClient, stack: Stack, num_replicas: int):
    """Every replica runs a stream that lasts until closed, with a 1-token request waiting
    behind it; returns (streams, waiting requests). Whatever comes next queues in the router."""
    streams = []
    for i in range(num_replicas):  # one at a time: each goes to an idle replica
        request = client.build_request("POST", "/v1/completions", json={
            "prompt": f"hold{i}", "max_tokens": 2000, "stream": True})
        streams.append(await client.send(request, stream=True))  # returns at the first token
        assert streams[-1].status_code == 200
    waiting = [_spawn(client, f"wait{i}", 1) for i in range(num_replicas)]

    async def occupied() -> bool:
        return all(s.num_running == 1 and s.num_waiting == 1 for s in await stack.replica_stats())

    await _until(occupied, "every replica to run one request with one waiting")
    return streams, waiting


async def _release(streams: list[httpx.Response]) -> None:
    for s in streams:
        await s.aclose()  # the engine aborts it


async def _received(stack: Stack) -> int:
    return sum(c["received"] for c in await stack.routing_counters())


async def queue_full(stack: Stack) -> None:
    """1. one occupied replica, router queue bound 3; a burst of 12 requests, half streamed.
    2. exactly 3 are queued; the other 9 get 429 with Retry-After at once, before any stream
       starts, while the queue is full.
    3. once the replica frees up, the 3 queued requests complete in full; only they (and the
       occupying ones) reached the engine, which ends idle; the next request is served."""
    before = await _received(stack)
    async with _client(stack) as client:
        streams, waiting = await _occupy(client, stack, 1)
        burst = [asyncio.ensure_future(client.post("/v1/completions", json={
            "prompt": f"p{i}", "max_tokens": 10, "temperature": 0, "stream": i % 2 == 1})) for i in range(12)]

        async def refused_9() -> bool:
            return sum(f.done() for f in burst) == 9

        await _until(refused_9, "9 refusals")
        await _queued(stack, 3)
        refused = {i: f.result() for i, f in enumerate(burst) if f.done()}
        await _release(streams)
        await asyncio.gather(*waiting)
        results = dict(enumerate(await asyncio.gather(*burst)))
        for r in refused.values():
            assert r.status_code == 429, r.text
            assert int(r.headers["Retry-After"]) >= 1
            error = r.json()["error"]
            assert error["type"] == "rate_limit_exceeded" and "queue full" in error["message"]
        for i in (i for i in results if i not in refused):
            assert results[i].status_code == 200, results[i].text
            want = greedy_text(FakeTokenizer().encode(f"p{i}"), 10)
            if i % 2:
                events = sse_events(results[i].text)
                assert events[-1] == "[DONE]"
                assert "".join(e["choices"][0]["text"] for e in events[:-1]) == want
            else:
                assert results[i].json()["choices"][0]["text"] == want
        assert await _received(stack) - before == 2 + 3  # the two occupying ones and the three admitted

        async def idle() -> bool:
            return all(s.num_running == 0 and s.num_waiting == 0 for s in await stack.replica_stats())

        await _until(idle, "the engine to end idle", 5)
        assert (await client.post("/v1/completions", json={"prompt": "again", "max_tokens": 2})).status_code == 200


async def priority_classes(stack: Stack) -> None:
    """1. two occupied replicas; 6 low-priority (5) requests queue in the router, then 6
       high-priority (0) ones.
    2. the replicas free up: every high request completes before any low one, and both
       replicas served the queued requests.
    The replicas need not run in step, so a low request takes 0.8 s and a high one 0.1 s: the
    last high is dispatched before the first low and finishes at most two high service times
    later, well before any low can finish."""
    before = [c["received"] for c in await stack.routing_counters()]
    async with _client(stack) as client:
        streams, waiting = await _occupy(client, stack, 2)
        low = [_spawn(client, f"low{i}", 16, priority=5) for i in range(6)]
        await _queued(stack, 6)
        high = [_spawn(client, f"high{i}", 2, priority=0) for i in range(6)]
        await _queued(stack, 12)
        await _release(streams)
        await asyncio.gather(*waiting)
        low_done, high_done = await asyncio.gather(*low), await asyncio.gather(*high)
    assert max(high_done) < min(low_done)
    counters = await stack.routing_counters()
    assert len(counters) == 2
    served = [c["received"] - b for c, b in zip(counters, before)]
    assert sum(served) == 4 + 12  # 2 occupying requests per replica + the queued ones
    assert all(s > 2 for s in served) and all(c["misrouted"] == 0 for c in counters), counters


async def sjf(stack: Stack) -> None:
    """1. one occupied replica; three 15-token requests queue in the router, then a 2-token one.
    2. the replica frees up: the short request completes before every long one."""
    async with _client(stack) as client:
        streams, waiting = await _occupy(client, stack, 1)
        longs = [_spawn(client, f"long{i}", 15) for i in range(3)]
        await _queued(stack, 3)
        short = _spawn(client, "short", 2)
        await _queued(stack, 4)
        await _release(streams)
        await asyncio.gather(*waiting)
        short_done, long_done = await short, await asyncio.gather(*longs)
    assert short_done < min(long_done)


AGING_RATE, STARVED_PRIORITY = 5.0, 15


async def aging(stack: Stack) -> None:
    """Priority policy, aging 5 classes/s: a priority-15 request ranks like a priority-0 one that
    arrived 3 s after it (its bound).
    1. one occupied replica; the starved request queues, then 3 priority-0 requests within 3 s
       of it (checked), then, more than 3 s after it was queued, 3 more.
    2. the replica frees up: the first 3 complete before it (they outrank it: without aging it
       would wait behind every priority-0 request), the last 3 after it. The starved and the
       last 3 requests take 0.5 s each, so completions on either side are 0.5 s apart."""
    bound_s = STARVED_PRIORITY / AGING_RATE
    async with _client(stack) as client:
        streams, waiting = await _occupy(client, stack, 1)
        sent = time.monotonic()
        starved = _spawn(client, "starved", 10, priority=STARVED_PRIORITY)
        await _queued(stack, 1)
        queued = time.monotonic()
        early = [_spawn(client, f"early{i}", 2) for i in range(3)]
        await _queued(stack, 4)
        assert time.monotonic() - sent < bound_s, "too slow to queue within the bound"
        await asyncio.sleep(queued + bound_s + 0.1 - time.monotonic())
        late = [_spawn(client, f"late{i}", 10) for i in range(3)]
        await _queued(stack, 7)
        await _release(streams)
        await asyncio.gather(*waiting)
        early_done, starved_done, late_done = (await asyncio.gather(*early), await starved,
                                               await asyncio.gather(*late))
    assert max(early_done) < starved_done < min(late_done)


async def clients_leave_while_queued(stack: Stack) -> None:
    """1. one occupied replica; three requests queue at the router.
    2. the clients of two of them leave before their answer (they close their connections): the
       router's queue holds only the third.
    3. once the replica frees up, the third completes in full; of the three only it reached the
       engine, which ends idle.
    Needs a front door that cancels a request whose client left before its response began
    (Serve's): the in-process stack's uvicorn does not, so this runs through Serve only."""
    before = await _received(stack)
    async with _client(stack) as client:
        streams, waiting = await _occupy(client, stack, 1)
        queued = [_spawn(client, f"q{i}", 3) for i in range(3)]
        await _queued(stack, 3)
        for leaving in queued[:2]:
            leaving.cancel()
        await asyncio.gather(*queued[:2], return_exceptions=True)
        await _queued(stack, 1)
        await _release(streams)
        await asyncio.gather(*waiting, queued[2])
        assert await _received(stack) - before == 2 + 1  # the two occupying ones and the one left

        async def idle() -> bool:
            return all(s.num_running == 0 and s.num_waiting == 0 for s in await stack.replica_stats())

        await _until(idle, "the engine to end idle", 5)


SCENARIOS = {
    "queue_full_429": Scenario(_config("fcfs", max_queued_requests=3), queue_full),
    "priority_classes": Scenario(_config("priority", num_replicas=2), priority_classes),
    "sjf": Scenario(_config("sjf"), sjf),
    "aging": Scenario(_config("priority", aging_rate=AGING_RATE, priority_range=[0, STARVED_PRIORITY]), aging),
}
LEAVING = Scenario(_config("fcfs"), clients_leave_while_queued)  # through Serve only (its docstring)
