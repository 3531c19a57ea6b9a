"""The benchmark client's own cost in a burst: how long after the burst begins a server sees its
requests, and the client's CPU, for httpx and aiohttp, so that serve_bench's figures are the
server's and not the client's.

A server in a process of its own (uvicorn, uvloop and httptools, as the app's) answers each
streamed completion at once with one event, its usage and [DONE], and records when each request
reached it. Each client sends `--requests` at once on fresh connections, as serve_bench's burst
does: plain httpx and aiohttp loops that read the body's lines, and serve_bench's own
`stream_request` (aiohttp, every event parsed). Reported: ms from the burst's start to the server's
first, median and last arrival, and the client's CPU a request; medians of `--repeats`, the
clients alternated.

    python benchmarks/http_clients.py [--requests 256] [--repeats 5] [--json OUT]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import statistics
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import serve_bench  # noqa: E402
from benchmarks.quantization import cpu_features  # noqa: E402

EVENT = (b'data: {"choices":[{"index":0,"text":"x","finish_reason":"length"}],'
         b'"usage":{"prompt_tokens":150,"completion_tokens":1}}\n\ndata: [DONE]\n\n')
PROMPT = list(range(150))


def serve(port: int) -> None:
    """The server: POST answers one event and records its arrival; GET /arrivals hands them over."""
    import uvicorn

    arrivals: list[float] = []

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        more = True
        while more:
            more = (await receive()).get("more_body", False)
        if scope["method"] == "GET":
            body, media = json.dumps(arrivals).encode(), b"application/json"
            arrivals.clear()
        else:
            arrivals.append(time.time())
            body, media = EVENT, b"text/event-stream"
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", media)]})
        await send({"type": "http.response.body", "body": body})

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", loop="uvloop", http="httptools",
                lifespan="off")


def _arrivals(base: str) -> list[float]:
    with urllib.request.urlopen(base + "/arrivals") as r:
        return sorted(json.load(r))


async def _httpx(url: str, n: int) -> tuple[float, float]:
    import httpx

    body = {"prompt": PROMPT, "max_tokens": 1, "stream": True}
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)) as c:
        async def one() -> None:
            async with c.stream("POST", url, json=body) as r:
                async for _ in r.aiter_lines():
                    pass

        return await _timed(one, n)


async def _aiohttp(url: str, n: int) -> tuple[float, float]:
    import aiohttp

    body = {"prompt": PROMPT, "max_tokens": 1, "stream": True}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=n + 4)) as session:
        async def one() -> None:
            async with session.post(url, json=body) as r:
                async for _ in r.content:
                    pass

        return await _timed(one, n)


async def _serve_bench(url: str, n: int) -> tuple[float, float]:
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=n + 4)) as session:
        async def one() -> None:
            res = serve_bench.RequestResult(0, len(PROMPT), 1, 0.0)
            await serve_bench.stream_request(session, url, None, PROMPT, 1, res, time.perf_counter(), {})
            if not res.ok:
                raise RuntimeError(res.error)

        return await _timed(one, n)


CLIENTS = {"httpx": _httpx, "aiohttp": _aiohttp, "serve_bench (aiohttp)": _serve_bench}


async def _timed(one, n: int) -> tuple[float, float]:
    """`n` of `one` at once: when they began (wall clock, as the server's arrivals), and the CPU they took."""
    start, cpu = time.time(), time.process_time()
    await asyncio.gather(*(one() for _ in range(n)))
    return start, time.process_time() - cpu


def run_client(name: str, base: str, n: int) -> dict[str, float]:
    _arrivals(base)  # drops any earlier run's
    start, cpu = asyncio.run(CLIENTS[name](base + "/v1/completions", n))
    arrived = _arrivals(base)
    assert len(arrived) == n, f"{name}: {len(arrived)} of {n} requests arrived"
    ms = [1000 * (t - start) for t in arrived]
    return {"first_ms": ms[0], "median_ms": ms[n // 2], "last_ms": ms[-1], "client_cpu_ms_per_request": 1000 * cpu / n}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = multiprocessing.get_context("spawn").Process(target=serve, args=(port,), daemon=True)
    server.start()
    base = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            _arrivals(base)
            break
        except OSError:
            time.sleep(0.1)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in CLIENTS}
    try:
        for _ in range(args.repeats):
            for name in CLIENTS:
                runs[name].append(run_client(name, base, args.requests))
    finally:
        server.terminate()
    print(cpu_features())
    print(f"{args.requests} streamed requests at once, medians of {args.repeats}")
    print(f"{'client':<24}{'first ms':>10}{'median ms':>11}{'last ms':>9}{'CPU ms/request':>16}")
    medians = {}
    for name, rows in runs.items():
        medians[name] = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
        m = medians[name]
        print(f"{name:<24}{m['first_ms']:>10.1f}{m['median_ms']:>11.1f}{m['last_ms']:>9.1f}"
              f"{m['client_cpu_ms_per_request']:>16.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_features(), "requests": args.requests, "repeats": args.repeats,
                       "medians": medians, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
