"""`Frontend`: the ingress deployment, the OpenAI ingress over the admission and replicas app.py chose.

app.py picks the graph's shape by what it binds here (a plain class; it applies serve.ingress and
serve.deployment):
- split: the Router deployment's handle and the EngineReplica deployment's: admission by
  serve_app.admission.RouterClient, replicas by serve_app.transport.ServeReplicas;
- router in the ingress (one ingress replica): no router handle: the Router runs in this process
  (LocalAdmission), so each request's admission and release are calls in-process, and the
  engine replicas send their load reports here by name (`report`);
- colocated (one engine replica and one ingress replica): neither handle: the router and the
  engine replica both run in this process (LocalReplicas), so no hop is a Serve message.
Each part is the same class in every shape, so priorities, aging, 429s with Retry-After and the
load reports behave alike.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from engine.client import EngineClient
from engine.metrics import EngineStats
from serve_app.admission import Admission, LocalAdmission, RouterClient
from serve_app.config import AppConfig
from serve_app.ingress import Ingress
from serve_app.messages import ReplicaStats
from serve_app.replica import EngineReplica
from serve_app.replicas import LocalReplicas, Replicas
from serve_app.router import Router
from serve_app.serve_internals import rpc_options
from serve_app.transport import ServeReplicas


class Frontend:
    def __init__(self, config: AppConfig, router: Any = None, replicas: dict[str, Any] | None = None,
                 engine_cls: type[EngineClient] | None = None, draft: Any = None):
        """`router`: the Router deployment's handle, None for the router in this process; `replicas`:
        each model's EngineReplica deployment handle by its served name, None for the one engine
        replica in this process (colocated), whose `engine_cls` and `draft` these are."""
        if router is not None and replicas is None:
            raise ValueError("an engine replica in the ingress needs the router there too")
        rpc = rpc_options(config.ingress.grpc_transport)
        self.router: Router | None = None
        admission: Admission
        if router is None:
            self.router = Router(config.router, metrics_enabled=True)
            admission = LocalAdmission(self.router)
        else:
            admission = RouterClient(router.options(**rpc))
        self.replica: EngineReplica | None = None
        engines: dict[str, Replicas]
        if replicas is None:
            self.replica = EngineReplica(config.engine, self.router, engine_cls, metrics_enabled=True, slo=config.slo,
                                         draft=draft)
            engines = {config.engine.model_name: LocalReplicas([self.replica])}
        else:
            engines = {name: ServeReplicas(handle.options(**rpc), config.ingress.replica_accept_timeout_s)
                       for name, handle in replicas.items()}
        self.ingress = Ingress(config, admission, engines)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self.ingress.build_asgi_app()

    async def check_health(self) -> None:
        await self.ingress.check_health()

    # What the Router deployment answers by handle, where the router is here.

    async def report(self, stats: ReplicaStats) -> None:
        await self._router().report(stats)

    def num_queued_admissions(self) -> int:
        return self._router().num_queued_admissions()

    # What the EngineReplica deployment answers by handle, where the replica is here.

    def stats(self) -> ReplicaStats:
        return self._replica().stats()

    def routing_counters(self) -> dict[str, int]:
        return self._replica().routing_counters()

    def engine_stats(self) -> EngineStats:
        return self._replica().engine_stats()

    def _router(self) -> Router:
        if self.router is None:
            raise RuntimeError("the router runs in its own deployment in this graph")
        return self.router

    def _replica(self) -> EngineReplica:
        if self.replica is None:
            raise RuntimeError("the engine replicas run in their own deployment in this graph")
        return self.replica

    def __del__(self) -> None:
        """Serve calls this when it stops the replica: an engine here stops with it."""
        if self.replica is not None:
            self.replica.__del__()
