"""The admission scenarios (admission_scenarios.py) through real Ray Serve (slow), in each graph
that holds the admission queue somewhere else: the Router deployment, the router inside the
ingress replica (RouterIngress), and for the one-replica scenarios the router inside the engine
replica's actor (EngineIngress); with the pinning request router and HTTP through Serve, on fake
engines that run one request at a time. Each scenario deploys its own app and deletes it."""

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


# where the queue lives: the split graph's Router deployment, its ingress, or (one engine replica,
# the only case it is deployed for) the actor holding front end, router and engine
GRAPHS = {"router": {"ingress": {"colocated": False}, "router": {"in_ingress": False}},
          "ingress": {"ingress": {"colocated": False}, "router": {"in_ingress": True}},
          "colocated": {"ingress": {"colocated": True}}}
CASES = [(name, graph) for graph in GRAPHS for name, scenario in SCENARIOS.items()
         if graph != "colocated" or scenario.config["engine"]["num_replicas"] == 1]


@pytest.mark.parametrize("name,graph", CASES)
def test_admission_scenario_through_serve(serve_cluster, name, graph):
    import ray
    from ray import serve

    scenario = SCENARIOS[name]
    app = f"adm-{name.replace('_', '-')}-{graph}"
    with fake_serve_app(serve_cluster, app, merge(scenario.config, GRAPHS[graph]), **ENGINE) as url:
        if graph == "colocated":
            engine = serve.get_deployment_handle("EngineIngress", app_name=app)

            async def replica_stats():
                return [await engine.stats.remote()]

            async def routing_counters():
                return [await engine.routing_counters.remote()]

            async def num_queued():
                return await engine.num_queued_admissions.remote()
        else:
            replicas = serve.get_deployment_handle("EngineReplica", app_name=app)

            async def replica_stats():
                return await asyncio.to_thread(lambda: replicas.broadcast("stats").results())

            async def routing_counters():
                return await asyncio.to_thread(lambda: replicas.broadcast("routing_counters").results())

            if graph == "ingress":
                ingress = serve.get_deployment_handle("Ingress", app_name=app)

                async def num_queued():
                    return await ingress.num_queued_admissions.remote()
            else:
                router = _router_actor(app)

                async def num_queued():
                    # with every replica occupied, the calls the Router actor holds are queued admit()s
                    return await asyncio.to_thread(ray.get, router.get_num_ongoing_requests.remote())

        asyncio.run(scenario.run(Stack(url, replica_stats, routing_counters, num_queued)))
