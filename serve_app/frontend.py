"""The deployments that take HTTP, one class per role (app.py deploys each under its own name and
applies serve.ingress): the OpenAI front end (serve_app.ingress.FrontEnd) over an admission and the
engine replicas, with what else runs in the same actor.

- `Ingress`: the front end alone, over the Router deployment (serve_app.admission.RouterClient)
  and the EngineReplica deployments (serve_app.transport.ServeReplicas): the split graph, several
  ingress replicas sharing one queue.
- `IngressRouter`: the front end and the router in one actor (LocalAdmission), over the
  EngineReplica deployments, whose load reports come here (`report`): one ingress replica, each
  request's admission and release calls in-process.
- `IngressRouterEngine`: the front end, the router and the one engine replica in one actor
  (LocalAdmission, LocalReplicas): no hop of the request path is a Serve message.
Each part is the same class in every graph, so priorities, aging, 429s with Retry-After and the
load reports behave alike.
"""
from __future__ import annotations

from fastapi import FastAPI

from engine.client import EngineClient
from engine.metrics import EngineStats
from serve_app.admission import Admission, LocalAdmission, RouterClient
from serve_app.calls import ReplicaHandle, RouterHandle
from serve_app.config import AppConfig
from serve_app.ingress import FrontEnd
from serve_app.messages import ReplicaStats
from serve_app.replica import EngineReplica
from serve_app.replicas import LocalReplicas, Replicas
from serve_app.router import Router
from serve_app.serve_internals import rpc_options
from serve_app.transport import ServeReplicas


class _Front:
    """What Serve asks of a deployment that takes HTTP."""

    def __init__(self, config: AppConfig, admission: Admission, replicas: dict[str, Replicas]):
        self.front_end = FrontEnd(config, admission, replicas)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self.front_end.build_asgi_app()

    async def check_health(self) -> None:
        await self.front_end.check_health()


def _deployed(config: AppConfig, replicas: dict[str, ReplicaHandle]) -> dict[str, Replicas]:
    rpc = rpc_options(config.ingress.grpc_transport)
    return {name: ServeReplicas(handle.options(**rpc), config.ingress.replica_accept_timeout_s)
            for name, handle in replicas.items()}


class Ingress(_Front):
    def __init__(self, config: AppConfig, router: RouterHandle, replicas: dict[str, ReplicaHandle]):
        """`router`: the Router deployment's handle; `replicas`: each model's EngineReplica
        deployment handle by its served name."""
        admission = RouterClient(router.options(**rpc_options(config.ingress.grpc_transport)))
        super().__init__(config, admission, _deployed(config, replicas))


class IngressRouter(_Front):
    def __init__(self, config: AppConfig, replicas: dict[str, ReplicaHandle]):
        self.router = Router(config.router, metrics_enabled=True)
        super().__init__(config, LocalAdmission(self.router), _deployed(config, replicas))

    async def report(self, stats: ReplicaStats) -> None:
        """An engine replica's load report (serve_app.replica.RouterByName names this deployment)."""
        await self.router.report(stats)

    def num_queued_admissions(self) -> int:
        return self.router.num_queued_admissions()


class IngressRouterEngine(_Front):
    def __init__(self, config: AppConfig, engine_cls: type[EngineClient] | None = None,
                 draft: object | None = None):
        """`engine_cls` and `draft`: the engine replica's (serve_app.replica.EngineReplica)."""
        self.router = Router(config.router, metrics_enabled=True)
        self.replica = EngineReplica(config.engine, self.router, engine_cls, metrics_enabled=True, slo=config.slo,
                                     draft=draft)
        super().__init__(config, LocalAdmission(self.router),
                         {config.engine.model_name: LocalReplicas([self.replica])})

    def num_queued_admissions(self) -> int:
        return self.router.num_queued_admissions()

    def stats(self) -> ReplicaStats:
        return self.replica.stats()

    def routing_counters(self) -> dict[str, int]:
        return self.replica.routing_counters()

    def engine_stats(self) -> EngineStats:
        return self.replica.engine_stats()

    def __del__(self) -> None:
        """Serve calls this when it stops the replica: the engine here stops with it."""
        self.replica.__del__()
