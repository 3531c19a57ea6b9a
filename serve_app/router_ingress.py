"""`RouterIngress`: the OpenAI front end with the admission router in its own process.

With one ingress replica every request already passes through one process, so the fleet-wide
queue can live there: each request's admission and release become calls in-process instead of
two Serve hops to a router actor (each a serialized call through Serve's handle router), and the
router's actor, one more process that wakes when idle, is gone. Engine replicas send their load
reports here by handle (`report`), as they would to the Router deployment. The router is the same
class with the same queue, so priorities, aging, 429s with Retry-After and dispatch are unchanged.
Several ingress replicas keep the Router deployment (app.py), the one queue they share.
"""

from __future__ import annotations

from typing import Any

from serve_app.config import AppConfig
from serve_app.ingress import Ingress
from serve_app.local import LocalHandle
from serve_app.messages import ReplicaStats
from serve_app.router import Router


class RouterIngress(Ingress):
    """The ingress deployment's class when `AppConfig.router_in_ingress` (app.py deploys it)."""

    def __init__(self, config: AppConfig, replicas: Any):
        self.admission = Router(config.router, metrics_enabled=True)
        super().__init__(config, LocalHandle(self.admission), replicas)

    async def check_health(self) -> None:
        await self.admission.check_health()
        await super().check_health()

    # What the Router deployment answers by handle.

    async def report(self, stats: ReplicaStats) -> None:
        await self.admission.report(stats)

    def num_queued_admissions(self) -> int:
        return self.admission.num_queued_admissions()
