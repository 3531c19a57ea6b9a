"""Serve test helpers: an in-process stack (ingress + router + replicas on fake engines).

Tests that start a real Ray Serve cluster are marked `slow` (marker registered in pyproject.toml);
deselect them with `-m "not slow"`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from pathlib import Path
from typing import Any, AsyncIterator

import httpx

sys.path.insert(0, str(Path(__file__).parent))

from fake_engine import FakeAsyncEngine, FakeSamplingParams, FakeTokenizer  # noqa: E402

from serve_app.config import AppConfig  # noqa: E402
from serve_app.local import build_local_app  # noqa: E402


def _merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for k, v in override.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@contextlib.asynccontextmanager
async def local_stack(
    num_replicas: int = 1, engine_cls: type = FakeAsyncEngine, **config: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, Any, list]]:
    """(client, router, replicas) with every replica already known to the router."""
    base = {"engine": {"served_model_name": "fake", "stream_flush_interval_s": 0.0,
                       "stats_report_interval_s": 0.05},
            "router": {"no_replica_timeout_s": 0.5}}
    cfg = AppConfig.model_validate(_merge(base, config))
    app, router, replicas = build_local_app(cfg, num_replicas, engine_cls, FakeSamplingParams,
                                            tokenizer=FakeTokenizer())
    for r in replicas:
        await r.check_health()
    for _ in range(200):
        if len(router.pool.views) == num_replicas:
            break
        await asyncio.sleep(0.01)
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://test",
                                     timeout=30) as client:
            yield client, router, replicas
    finally:
        for r in replicas:
            r.shutdown()
        if router._tick_task is not None:
            router._tick_task.cancel()


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def sse_events(body: str) -> list[Any]:
    """Parses an SSE body into JSON payloads (and the literal '[DONE]')."""
    events = []
    for block in body.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def greedy_tokens(prompt_ids: list[int], n: int) -> list[int]:
    """What the fake engine generates greedily."""
    return [10 + (sum(prompt_ids) + 7 * step) % 40 for step in range(n)]


def greedy_text(prompt_ids: list[int], n: int) -> str:
    return "".join(f" t{t}" for t in greedy_tokens(prompt_ids, n))
