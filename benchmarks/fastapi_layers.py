"""What FastAPI's own layers cost the ingress a request: a POST through a FastAPI app (its
middleware stack, routing, the endpoint's parameters and its OpenTelemetry check), the same with
FastAPI's telemetry turned off, and the same endpoint called directly with a Starlette `Request`.

N requests at once on uvloop, each reading a small body and answering a small response over a
send that returns at once; process CPU time a request, in microseconds, medians of `--repeats`,
the three alternated.

    python benchmarks/fastapi_layers.py [--requests 2000] [--repeats 7] [--json OUT]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

import uvloop
from fastapi import FastAPI, Request
from starlette.responses import Response

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.quantization import cpu_features  # noqa: E402

NO_TELEMETRY = {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}


async def endpoint(request: Request) -> Response:
    await request.body()
    return Response(b"{}", media_type="application/json")


def app(telemetry: dict | None) -> FastAPI:
    """The ingress's shape: its two hot routes first, then others."""
    fastapi = FastAPI(docs_url=None, redoc_url=None, openapi_url=None, telemetry=telemetry)
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        fastapi.add_api_route(path, endpoint, methods=["POST"])
    fastapi.add_api_route("/health", endpoint, methods=["GET"])
    return fastapi


async def direct(scope: dict, receive, send) -> None:
    response = await endpoint(Request(scope, receive, send))
    await response(scope, receive, send)


def _scope() -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
            "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000),
            "headers": [(b"host", b"localhost"), (b"content-type", b"application/json"), (b"content-length", b"2")]}


async def _receive() -> dict:
    return {"type": "http.request", "body": b"{}", "more_body": False}


async def _send(message: dict) -> None:
    pass


KINDS = {"FastAPI": app(None), "FastAPI, telemetry off": app(NO_TELEMETRY), "endpoint called directly": direct}


async def cpu_us_per_request(kind: str, requests: int) -> float:
    start = time.process_time()
    await asyncio.gather(*(KINDS[kind](_scope(), _receive, _send) for _ in range(requests)))
    return (time.process_time() - start) / requests * 1e6


async def main(args: argparse.Namespace) -> dict:
    for kind in KINDS:  # each app builds its middleware stack on its first request
        await cpu_us_per_request(kind, 100)
    runs: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for _ in range(args.repeats):
        for kind in KINDS:
            runs[kind].append(await cpu_us_per_request(kind, args.requests))
    return runs


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    runs = uvloop.run(main(args))
    print(cpu_features())
    print(f"{args.requests} requests at once, CPU us a request, medians of {args.repeats}")
    medians = {kind: statistics.median(values) for kind, values in runs.items()}
    for kind, median in medians.items():
        print(f"{kind:<28}{median:8.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_features(), "requests": args.requests, "repeats": args.repeats,
                       "medians_us": medians, "runs_us": runs}, f, indent=1)
