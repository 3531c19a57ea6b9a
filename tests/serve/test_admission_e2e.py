"""The admission scenarios (admission_scenarios.py) through real Ray Serve (slow), in each graph
that holds the admission queue somewhere else: the Router deployment, the router inside the
ingress replica (IngressRouter), and for the one-replica scenarios the router inside the engine
replica's actor (IngressRouterEngine); with the pinning request router and HTTP through Serve, on fake
engines that run one request at a time. Each scenario deploys its own app and deletes it."""

from __future__ import annotations

import asyncio

import pytest
from admission_scenarios import ENGINE, LEAVING, SCENARIOS, Scenario, Stack
from conftest import fake_serve_app, merge

pytestmark = pytest.mark.slow


# where the queue lives: the split graph's Router deployment, its ingress, or (one engine replica,
# the only case it is deployed for) the actor holding front end, router and engine
GRAPHS = {"router": {"ingress": {"colocated": False}, "router": {"in_ingress": False}},
          "ingress": {"ingress": {"colocated": False}, "router": {"in_ingress": True}},
          "colocated": {"ingress": {"colocated": True}}}
CASES = [(name, graph) for graph in GRAPHS for name, scenario in SCENARIOS.items()
         if graph != "colocated" or scenario.config["engine"]["num_replicas"] == 1]


def _through_serve(serve_cluster: dict, scenario: Scenario, app: str, graph: str) -> None:
    from ray import serve

    with fake_serve_app(serve_cluster, app, merge(scenario.config, GRAPHS[graph]), **ENGINE) as url:
        if graph == "colocated":
            engine = serve.get_deployment_handle("IngressRouterEngine", app_name=app)

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

            queue = serve.get_deployment_handle("IngressRouter" if graph == "ingress" else "Router", app_name=app)

            async def num_queued():
                return await queue.num_queued_admissions.remote()

        asyncio.run(scenario.run(Stack(url, replica_stats, routing_counters, num_queued)))


@pytest.mark.parametrize("name,graph", CASES)
def test_admission_scenario_through_serve(serve_cluster, name, graph):
    _through_serve(serve_cluster, SCENARIOS[name], f"adm-{name.replace('_', '-')}-{graph}", graph)


@pytest.mark.parametrize("graph", ["router", "ingress"])
def test_clients_that_leave_while_queued_at_the_router_are_withdrawn(serve_cluster, graph):
    """admission_scenarios.clients_leave_while_queued: the ingress withdraws their admissions from
    the Router deployment by a release after their batch reached it, or from the router in its
    own process."""
    _through_serve(serve_cluster, LEAVING, f"adm-leaving-{graph}", graph)
