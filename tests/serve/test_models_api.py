"""Several models in one app, on the in-process stack (fake engines): a request's `model` picks the
model and only its replicas run it, `/v1/models` lists each, an unknown model is a 404, each model
has its own queue bound (its 429 names it; another model's requests go on), `/health` waits for
every model. The two real models through Ray Serve and the openai client: test_serve_e2e.py."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
from conftest import build_local_app, run, serving
from fake_engine import FakeAsyncEngine

from benchmarks.serve_bench import wait_healthy
from serve_app.config import AppConfig

QUICK = FakeAsyncEngine.with_options(step_delay_s=0.01, max_num_seqs=1)
SLOW = FakeAsyncEngine.with_options(step_delay_s=0.2, max_num_seqs=1)  # a 200-token stream holds its slot 40 s


def _model(name: str) -> dict:
    return {"served_model_name": name, "stream_flush_interval_s": 0.0, "stats_report_interval_s": 0.05}


@contextlib.contextmanager
def two_models(engine_cls: type = QUICK, **router):
    """The two-model app behind a real HTTP server (streams need real connections): (URL, each
    model's replica by name, the router)."""
    cfg = AppConfig.model_validate({"models": [_model("alpha"), _model("beta")],
                                    "router": {"max_waiting_per_replica": 1, **router}})
    app, router_, replicas = build_local_app(cfg, 1, engine_cls)
    with serving(app) as (url, loop):
        try:
            for r in replicas:  # what Serve's health check does first: the replica starts reporting load
                asyncio.run_coroutine_threadsafe(r.check_health(), loop).result(60)
            wait_healthy(url, 60)
            yield url, {r.config.model_name: r for r in replicas}, router_
        finally:
            for r in replicas:
                r.shutdown()


def _client(url: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, timeout=120)


def test_a_requests_model_picks_the_model_and_only_its_replicas_run_it():
    with two_models() as (url, replicas, _):
        run(_routed(url, replicas))


async def _routed(url: str, replicas: dict) -> None:
    async with _client(url) as client:
        health = (await client.get("/health")).json()
        assert health["models"] == {"alpha": 1, "beta": 1}
        cards = (await client.get("/v1/models")).json()["data"]
        assert [c["id"] for c in cards] == ["alpha", "beta"]
        for name, other in (("alpha", "beta"), ("beta", "alpha")):
            before = {n: r.routing_counters()["received"] for n, r in replicas.items()}
            r = await client.post("/v1/completions", json={"model": name, "prompt": "t5 t6", "max_tokens": 3})
            assert r.status_code == 200 and r.json()["model"] == name
            assert replicas[name].routing_counters()["received"] == before[name] + 1
            assert replicas[other].routing_counters()["received"] == before[other]
        default = await client.post("/v1/completions", json={"prompt": "t5", "max_tokens": 2})
        assert default.json()["model"] == "alpha"  # the first model serves requests that name none
        missing = await client.post("/v1/chat/completions", json={
            "model": "gamma", "messages": [{"role": "user", "content": "hi"}]})
        error = missing.json()["error"]
        assert missing.status_code == 404 and error["code"] == "model_not_found"
        assert "'alpha'" in error["message"] and "'beta'" in error["message"]
        assert (await client.get("/v1/models/beta")).json()["id"] == "beta"
        assert (await client.get("/v1/models/gamma")).status_code == 404


def test_a_full_model_gets_its_own_429_and_the_other_model_is_served():
    """alpha: one stream running, one request waiting at its replica, one in its router queue
    (bound 1): the next alpha request is a 429 naming alpha; beta's requests run to their end."""
    with two_models(SLOW, max_queued_requests=1) as (url, replicas, router):
        run(_alpha_full(url, replicas, router))


async def _alpha_full(url: str, replicas: dict, router) -> None:
    async with _client(url) as client:
        hold = await client.send(client.build_request("POST", "/v1/completions", json={
            "model": "alpha", "prompt": "hold", "max_tokens": 200, "stream": True}), stream=True)
        assert hold.status_code == 200
        behind = [asyncio.ensure_future(client.post("/v1/completions", json={
            "model": "alpha", "prompt": f"wait{i}", "max_tokens": 1})) for i in range(2)]
        for _ in range(3000):  # one at alpha's replica, one in alpha's queue
            if replicas["alpha"].engine.stats().num_waiting == 1 and len(router.lanes["alpha"].queue) == 1:
                break
            await asyncio.sleep(0.01)
        refused = await client.post("/v1/completions", json={"model": "alpha", "prompt": "more", "max_tokens": 1})
        assert refused.status_code == 429 and "model 'alpha'" in refused.json()["error"]["message"]
        assert int(refused.headers["Retry-After"]) >= 1
        served = await asyncio.gather(*(client.post("/v1/completions", json={
            "model": "beta", "prompt": f"b{i}", "max_tokens": 4}) for i in range(3)))
        assert [r.status_code for r in served] == [200, 200, 200]
        assert all(not f.done() for f in behind)  # alpha's still wait for alpha's replica
        await hold.aclose()
        assert [(await f).status_code for f in behind] == [200, 200]
