"""The admission scenarios (admission_scenarios.py) through real Ray Serve (slow): the Router
deployment, the pinning request router and HTTP through the Serve proxy, on fake engines that run
one request at a time; and the one-replica scenarios again with the router inside the engine
replica's actor (EngineIngress). Each scenario deploys its own app and deletes it."""

from __future__ import annotations

import asyncio

import pytest
from admission_scenarios import ENGINE, SCENARIOS, Stack
from conftest import fake_serve_app, merge

pytestmark = pytest.mark.slow


def _router_actor(app: str):
    import ray

    names = [a for a in ray.util.list_named_actors(all_namespaces=True) if f"{app}#Router#" in a["name"]]
    assert len(names) == 1, names
    return ray.get_actor(names[0]["name"], namespace=names[0]["namespace"])


# the split graph for every scenario; the colocated one (front end, router and engine in one
# actor) for those with one engine replica, the only case it is deployed for
GRAPHS = [(name, False) for name in SCENARIOS] + [
    (name, True) for name, scenario in SCENARIOS.items() if scenario.config["engine"]["num_replicas"] == 1]


@pytest.mark.parametrize("name,colocated", GRAPHS)
def test_admission_scenario_through_serve(serve_cluster, name, colocated):
    import ray
    from ray import serve

    scenario = SCENARIOS[name]
    app = f"adm-{name.replace('_', '-')}{'-colocated' if colocated else ''}"
    config = merge(scenario.config, {"ingress": {"colocated": colocated}})
    with fake_serve_app(serve_cluster, app, config, **ENGINE) as url:
        if colocated:
            engine = serve.get_deployment_handle("EngineIngress", app_name=app)

            async def replica_stats():
                return [await engine.stats.remote()]

            async def routing_counters():
                return [await engine.routing_counters.remote()]

            async def num_queued():
                return await engine.num_queued_admissions.remote()
        else:
            replicas = serve.get_deployment_handle("EngineReplica", app_name=app)
            router = _router_actor(app)

            async def replica_stats():
                return await asyncio.to_thread(lambda: replicas.broadcast("stats").results())

            async def routing_counters():
                return await asyncio.to_thread(lambda: replicas.broadcast("routing_counters").results())

            async def num_queued():
                # with every replica occupied, the calls the Router actor holds are queued admit()s
                return await asyncio.to_thread(ray.get, router.get_num_ongoing_requests.remote())

        asyncio.run(scenario.run(Stack(url, replica_stats, routing_counters, num_queued)))
