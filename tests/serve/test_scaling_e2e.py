"""Real Ray Serve (slow), scaling: autoscaling under streaming load, the GPU config on a node
with logical GPUs, and engine replicas spread over two nodes, one of which is lost.

All on the session `serve_cluster`; a test that needs another node adds it and removes it before
it ends. Engines are the fake engine, so no model compute is needed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
from conftest import fake_serve_app, greedy_text, merge
from fake_engine import FakeTokenizer

from serve_app.config import load_config

pytestmark = pytest.mark.slow

CONFIGS = Path(__file__).parents[2] / "configs"


def _wait_for(what: str, check: Callable[[], Any], timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def _replica_states(app: str) -> dict[str, int]:
    from ray import serve

    status = serve.status().applications.get(app)
    if status is None or "EngineReplica" not in status.deployments:
        return {}
    return {k: n for k, n in status.deployments["EngineReplica"].replica_states.items() if n}


def _running(app: str) -> int:
    return _replica_states(app).get("RUNNING", 0)


def _replica_actors(app: str) -> dict[str, Any]:
    """Serve replica id -> actor handle of each live EngineReplica actor of `app`."""
    import ray

    prefix = f"SERVE_REPLICA::{app}#EngineReplica#"
    return {a["name"][len(prefix):]: ray.get_actor(a["name"], namespace=a["namespace"])
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(prefix)}


def _placement(actor: Any) -> dict[str, Any]:
    """Node and GPUs of a replica actor, read inside its process (the state API would need the
    dashboard, which the test cluster does not run)."""
    import ray

    def where(_: Any) -> dict[str, Any]:
        import os

        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(),
                "gpu_ids": [str(i) for i in ray.get_gpu_ids()],
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}

    return ray.get(actor.__ray_call__.remote(where), timeout=30)


def _live_placements(app: str) -> list[str]:
    """Node ids of the app's replica actors that answer (a lost replica's name may linger)."""
    import ray

    nodes = []
    for actor in _replica_actors(app).values():
        try:
            nodes.append(_placement(actor)["node_id"])
        except ray.exceptions.RayError:
            continue
    return nodes


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


async def _stream(client: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> str:
    """Streams one completion; returns its text (raises on an error event or HTTP error)."""
    stream = await client.completions.create(model="fake", prompt=prompt, max_tokens=max_tokens,
                                             temperature=0, stream=True)
    return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])


def _greedy(prompt: str, n: int) -> str:
    return greedy_text(FakeTokenizer().encode(prompt), n)


def _pinned_on_each(handle: Any, num_replicas: int) -> bool:
    """Every replica received requests pinned to it, i.e. the router dispatched to each."""
    counters = handle.broadcast("routing_counters").results()
    return len(counters) == num_replicas and all(c["received"] > c["misrouted"] for c in counters)


async def _streams(url: str, prompts: list[str], max_tokens: int) -> list[str]:
    client = _client(url)
    return await asyncio.gather(*(_stream(client, p, max_tokens) for p in prompts))


def test_autoscaling_adds_a_replica_under_load_and_removes_it_after(serve_cluster):
    """1. min 1 / max 2 replicas, target 2 ongoing requests each; one replica at rest.
    2. 16 clients stream without pause: one replica holds 6 (4 engine slots + 2 the router lets
       wait), the rest queue at the router -> Serve starts a second replica; the router learns of
       it from its load reports and dispatches to it.
    3. clients stop -> back to one replica; concurrent requests right after (the router may still
       list the removed replica) are served.
    No request fails at any point and every stream has the full greedy text."""
    from ray import serve

    cfg = {"engine": {"autoscaling": {
        "min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2, "upscale_delay_s": 0.5,
        "downscale_delay_s": 2.0, "look_back_period_s": 1.0, "metrics_interval_s": 0.25}},
        "router": {"max_waiting_per_replica": 2}}
    with fake_serve_app(serve_cluster, "autoscale", cfg, step_delay_s=0.02,
                        max_num_seqs=4) as url:
        assert _replica_states("autoscale") == {"RUNNING": 1}
        handle = serve.get_deployment_handle("EngineReplica", app_name="autoscale")

        async def load() -> list[tuple[str, str]]:
            client = _client(url)
            stop = asyncio.Event()
            done: list[tuple[str, str]] = []  # (prompt, streamed text)

            async def user(i: int) -> None:
                while not stop.is_set():
                    prompt = f"user {i} {len(done)}"
                    done.append((prompt, await _stream(client, prompt, 10)))

            users = [asyncio.create_task(user(i)) for i in range(16)]
            try:
                await asyncio.to_thread(_wait_for, "a second replica the router dispatches to",
                                        lambda: _running("autoscale") == 2
                                        and _pinned_on_each(handle, 2), 45)
            finally:
                stop.set()
                await asyncio.gather(*users)  # re-raises the first failed request
            return done

        done = asyncio.run(load())
        assert done and all(text == _greedy(prompt, 10) for prompt, text in done)
        _wait_for("scale down to one replica",
                  lambda: _replica_states("autoscale") == {"RUNNING": 1}, 40)
        prompts = [f"after {i}" for i in range(8)]
        assert asyncio.run(_streams(url, prompts, 3)) == [_greedy(p, 3) for p in prompts]


def test_gpu_config_gives_each_replica_its_own_gpu(serve_cluster):
    """configs/serve-gpu.yaml on a node with 2 logical GPUs, with only what cannot run here
    replaced (the fake engine for the model, device cpu) and min_replicas raised to 2:
    each replica actor holds one GPU, a different one, and sees only it in CUDA_VISIBLE_DEVICES."""
    cluster = serve_cluster["cluster"]
    file_cfg = load_config(CONFIGS / "serve-gpu.yaml")
    assert file_cfg.engine.num_gpus == 1 and file_cfg.engine.autoscaling is not None
    cfg = merge(file_cfg.model_dump(), {"engine": {
        "served_model_name": "fake", "engine_args": {"device": "cpu"},
        "autoscaling": {"min_replicas": 2}}})
    gpu_node = cluster.add_node(num_cpus=2 * file_cfg.engine.num_cpus + 1, num_gpus=2)
    try:
        with fake_serve_app(serve_cluster, "gpu", cfg, max_model_len=8192,
                            num_blocks=4096) as url:
            placements = [_placement(a) for a in _replica_actors("gpu").values()]
            assert len(placements) == 2
            assert {p["node_id"] for p in placements} == {gpu_node.node_id}
            assert all(len(p["gpu_ids"]) == 1 for p in placements), placements
            assert {p["gpu_ids"][0] for p in placements} == {"0", "1"}, placements
            assert all(p["cuda_visible_devices"] == p["gpu_ids"][0] for p in placements)
            assert asyncio.run(_streams(url, ["gpu"], 4)) == [_greedy("gpu", 4)]
    finally:
        cluster.remove_node(gpu_node)


def test_replicas_spread_over_nodes_and_survive_losing_one(serve_cluster):
    """1. a worker node without CPUs joins (router and ingress, 0.1 CPU each, stay on the head);
       two 0-CPU replicas with max_replicas_per_node 1 land one on each node, and concurrent
       requests are pinned to both.
    2. two long streams, one running on each node; the worker node is killed: its stream ends
       with an error event (no hang), the head's stream finishes in full, and new requests are
       served by the head's replica."""
    import ray
    from ray import serve

    cluster = serve_cluster["cluster"]
    cfg = {"engine": {"num_cpus": 0, "num_replicas": 2, "max_replicas_per_node": 1}}
    worker = cluster.add_node(num_cpus=0)
    try:
        with fake_serve_app(serve_cluster, "spread", cfg, step_delay_s=0.01, max_model_len=8192,
                            num_blocks=4096) as url:
            nodes = {rid: _placement(a)["node_id"] for rid, a in _replica_actors("spread").items()}
            head_id = ray.get_runtime_context().get_node_id()
            assert sorted(nodes.values()) == sorted([head_id, worker.node_id])
            on_worker = next(rid for rid, node in nodes.items() if node == worker.node_id)
            handle = serve.get_deployment_handle("EngineReplica", app_name="spread")
            prompts = [f"warm {i}" for i in range(8)]
            _wait_for("requests pinned to both replicas", lambda: asyncio.run(
                _streams(url, prompts, 20)) and _pinned_on_each(handle, 2), 30)

            def running() -> dict[str, int]:
                return {s.replica_id: s.num_running for s in handle.broadcast("stats").results()}

            async def lose_worker_midstream() -> dict[str, tuple[str, Any]]:
                """Replica id -> (prompt, what its long stream returned: text or exception)."""
                client = _client(url)
                streams: dict[str, tuple[str, asyncio.Task]] = {}
                for prompt in ("long one", "long two"):
                    task = asyncio.create_task(_stream(client, prompt, 400))
                    busy = await asyncio.to_thread(_wait_for, f"{prompt} running", lambda: [
                        rid for rid, n in running().items() if n and rid not in streams], 10)
                    streams[busy[0]] = (prompt, task)
                assert set(streams) == set(nodes)  # one stream on each node
                await asyncio.to_thread(cluster.remove_node, worker, False)
                await asyncio.gather(*(task for _, task in streams.values()),
                                     return_exceptions=True)
                return {rid: (prompt, task.exception() or task.result())
                        for rid, (prompt, task) in streams.items()}

            outcomes = asyncio.run(lose_worker_midstream())
            lost = outcomes.pop(on_worker)[1]
            assert isinstance(lost, openai.APIError) and "replica failed" in str(lost), lost
            [(prompt, survived)] = outcomes.values()
            assert survived == _greedy(prompt, 400)
            after = [f"after {i}" for i in range(4)]
            assert asyncio.run(_streams(url, after, 3)) == [_greedy(p, 3) for p in after]
    finally:
        if worker in cluster.worker_nodes:
            cluster.remove_node(worker)


def test_engine_node_lost_and_rejoined_recovers(serve_cluster):
    """1. A worker node declaring the custom resource `engine_node` joins; the replica, which asks
       for it, lands there and serves.
    2. The node dies: while no replica exists, requests are refused (503) within 30 s, none hangs.
    3. A new such node joins: Serve starts the replica on it and requests succeed again. The
       recovery time (node joined -> first request served) is printed and must stay under 60 s."""
    import httpx

    cluster = serve_cluster["cluster"]
    cfg = {"engine": {"num_cpus": 1, "resources": {"engine_node": 1}, "num_replicas": 1},
           "router": {"no_replica_timeout_s": 2.0}}
    body = {"prompt": "hello", "max_tokens": 3, "temperature": 0}
    nodes = [cluster.add_node(num_cpus=2, resources={"engine_node": 1})]
    try:
        with fake_serve_app(serve_cluster, "rejoin", cfg, step_delay_s=0.01, max_model_len=8192,
                            num_blocks=4096) as url:
            assert _live_placements("rejoin") == [nodes[0].node_id]
            cluster.remove_node(nodes[0], allow_graceful=False)

            def refused() -> httpx.Response | None:
                t0 = time.monotonic()
                response = httpx.post(url + "/v1/completions", json=body, timeout=60)
                # answered, not hung: the router first waits out the lost replica's silence
                # (replica_stale_after_s) and then no_replica_timeout_s
                assert time.monotonic() - t0 < 30, "a request hung while no replica lived"
                return response if response.status_code == 503 else None

            assert _wait_for("requests refused while no replica lives", refused, 60).json()["error"]["message"]
            nodes.append(cluster.add_node(num_cpus=2, resources={"engine_node": 1}))
            joined = time.monotonic()

            def served() -> bool:
                return httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 200

            _wait_for("a request served after the node rejoined", served, 60)
            print(f"recovery after the engine node rejoined: {time.monotonic() - joined:.1f} s")
            assert nodes[1].node_id in _live_placements("rejoin")
    finally:
        for node in nodes:
            if node in cluster.worker_nodes:
                cluster.remove_node(node)
