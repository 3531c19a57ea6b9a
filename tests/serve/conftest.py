"""Serve test helpers: an in-process stack (ingress + router + replicas on fake engines), and
helpers for apps on the Ray cluster with Serve that every real-Ray test shares (`serve_cluster`,
in tests/conftest.py, where tests/gpu finds it too).

Tests that start a real Ray Serve cluster are marked `slow` (marker registered in pyproject.toml);
deselect them with `-m "not slow"`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from fake_engine import FakeAsyncEngine  # noqa: E402

from benchmarks.serve_bench import wait_healthy  # noqa: E402
from serve_app.admission import LocalAdmission  # noqa: E402
from serve_app.app import build_app  # noqa: E402
from serve_app.config import AppConfig  # noqa: E402
from serve_app.ingress import FrontEnd  # noqa: E402
from serve_app.replica import EngineReplica  # noqa: E402
from serve_app.replicas import LocalReplicas  # noqa: E402
from serve_app.router import Router  # noqa: E402
from tests.conftest import (  # noqa: E402, F401
    HEADER_TIMEOUT_S,
    KEEP_ALIVE_TIMEOUT_S,
    free_port,
    run_app,
    seconds_until_closed,
    serving,
)

# How long a test waits for an app to answer: a bound that catches a hang, not a speed. Beside two
# processes spinning on both cores, `make serve` (Ray, Serve, the replica) takes minutes to start.
STARTUP_BOUND_S = 600


def merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for k, v in override.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def build_local_app(config: AppConfig, num_replicas: int | None = None, engine_cls: type | None = None
                    ) -> tuple[Any, Router, list[EngineReplica]]:
    """The whole graph in this process, of the app's own parts (the router-in-ingress graph's shape
    with the replicas in-process too): (the ingress's ASGI app, router, replicas, every model's in
    the config's order). `num_replicas`: each model's, else its config's. Replicas start reporting
    load once an event loop runs (first request or `check_health`)."""
    router = Router(config.router)
    by_model = {model.model_name: [EngineReplica(model, router, engine_cls, replica_id=f"r{i}" if k == 0 else
                                                 f"{model.model_name}-r{i}", slo=config.slo)
                                   for i in range(num_replicas or model.num_replicas)]
                for k, model in enumerate(config.served_models)}
    ingress = FrontEnd(config, LocalAdmission(router), {name: LocalReplicas(rs) for name, rs in by_model.items()})
    return ingress.build_asgi_app(), router, [r for rs in by_model.values() for r in rs]


@contextlib.asynccontextmanager
async def local_app(
    num_replicas: int = 1, engine_cls: type = FakeAsyncEngine, **config: Any
) -> AsyncIterator[tuple[Any, Any, list]]:
    """(the ingress's ASGI app, router, replicas) with every replica already known to the router."""
    base = {"engine": {"served_model_name": "fake", "stream_flush_interval_s": 0.0,
                       "stats_report_interval_s": 0.05},
            "router": {"no_replica_timeout_s": 0.5}}
    cfg = AppConfig.model_validate(merge(base, config))
    app, router, replicas = build_local_app(cfg, num_replicas, engine_cls)
    for r in replicas:
        await r.check_health()
    for _ in range(200):
        if sum(len(lane.pool.views) for lane in router.lanes.values()) == len(replicas):
            break
        await asyncio.sleep(0.01)
    try:
        yield app, router, replicas
    finally:
        for r in replicas:
            r.shutdown()
        if router._tick_task is not None:
            router._tick_task.cancel()


@contextlib.asynccontextmanager
async def local_stack(
    num_replicas: int = 1, engine_cls: type = FakeAsyncEngine, **config: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, Any, list]]:
    """local_app's stack with an HTTP client on its app: (client, router, replicas)."""
    async with local_app(num_replicas, engine_cls, **config) as (app, router, replicas):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=30) as client:
            yield client, router, replicas


@contextlib.contextmanager
def served_local_stack(config: dict, num_replicas: int | None = None,
                       engine_cls: type | None = FakeAsyncEngine) -> Iterator[tuple[str, Any, list]]:
    """The in-process stack behind a real HTTP server (uvicorn on its own thread and loop), for
    clients that need real connections (streams held open, schemathesis). Yields (url, router,
    replicas), every replica already reporting to the router. engine_cls None: the real engine."""
    cfg = AppConfig.model_validate(config)
    app, router, replicas = build_local_app(cfg, num_replicas, engine_cls)
    with serving(app) as (url, loop):
        try:
            for r in replicas:  # what Serve's health check does first: the replica starts reporting load
                asyncio.run_coroutine_threadsafe(r.check_health(), loop).result(STARTUP_BOUND_S)
            wait_healthy(url, STARTUP_BOUND_S)
            yield url, router, replicas
        finally:
            for r in replicas:
                r.shutdown()


@contextlib.contextmanager
def served_real_engine(model: str | None, max_model_len: int, name: str = "tiny", **config: Any) -> Iterator[str]:
    """served_local_stack on the real engine (model None: the embedded one) with one replica,
    8 sequences, seed 0 and unheld streams; `config` merged over that. Yields the URL."""
    base = {"engine": {"model": model, "served_model_name": name, "stream_flush_interval_s": 0.0,
                       "engine_args": {"max_model_len": max_model_len, "max_num_seqs": 8, "seed": 0}}}
    with served_local_stack(merge(base, config), 1, engine_cls=None) as (url, _, _):
        yield url


def one_lane(router: Router) -> Any:
    """The router's admission of its one model (a test's app serves one)."""
    (lane,) = router.lanes.values()
    return lane


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def admit_alone(router: Any, request: Any) -> Any:
    """One request's admission asked of a Router as a batch of its own: its AdmitResult."""
    async with contextlib.aclosing(router.admit_many([request])) as batches:
        async for answers in batches:
            if answers:
                return answers[0][1]
    raise AssertionError(f"the router never answered {request.request_id}")


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


@contextlib.contextmanager
def fake_serve_app(serve_cluster: dict, name: str, config: dict,
                   **engine_options: Any) -> Iterator[str]:
    """build_app on the fake engine (class attributes `engine_options`) as Serve app `name` at
    /name (at the root of the ingress replicas' shared port where `config` gives one); yields its
    URL and deletes the app on exit. One completion goes through first, so tests start with the
    ingress holding the model info and one request counted per app. The graph is the split one
    (an Ingress holding the router, and EngineReplica deployments), whose replicas these tests
    reach by handle, unless `config` says otherwise; the real-engine apps run colocated."""
    from ray import serve

    base = {"engine": {"served_model_name": "fake", "num_cpus": 0.1}, "ingress": {"colocated": False}}
    cfg = AppConfig.model_validate(merge(base, config))
    engine_cls = FakeAsyncEngine.with_options(**engine_options)
    if cfg.ingress.shared_port is None:
        url = run_app(cfg, name, engine_cls)
    else:  # the config's own port
        serve.run(build_app(cfg, engine_cls), name=name, route_prefix=f"/{name}")
        url = f"http://{cfg.ingress.shared_port.host}:{cfg.ingress.shared_port.port}"
    try:
        warm = httpx.post(url + "/v1/completions", json={"prompt": "warm", "max_tokens": 1},
                          timeout=60)
        assert warm.status_code == 200, warm.text
        yield url
    finally:
        serve.delete(name)


def metrics_of_every_node() -> str:
    """Each Ray node exports the metrics of the actors it hosts; the app's actors may sit on
    any node of the session cluster (other tests add and remove nodes)."""
    import ray

    texts = []
    for node in ray.nodes():
        if node["Alive"]:
            try:
                texts.append(httpx.get(f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics",
                                       timeout=5).text)
            except httpx.HTTPError:
                pass
    return "\n".join(texts)
