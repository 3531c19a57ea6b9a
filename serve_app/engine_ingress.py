"""`EngineIngress`: the OpenAI front end, the router and the one engine replica in one actor.

On a small host every Serve actor is a process that wakes ~100 times a second even when idle,
and every hop serializes each stream message on both sides. With one engine replica there is
nothing for a separate ingress to spread and nothing for a separate router to choose between, so
the ingress calls the replica and the router in-process (serve_app.local, the shims the tests
use): two actors and the hops to them are gone. The router is the one a RouterIngress holds, so
priorities, aging, 429s with Retry-After and the load reports are unchanged.
"""

from __future__ import annotations

from typing import Any

from engine.client import EngineClient
from engine.metrics import EngineStats
from serve_app.config import AppConfig
from serve_app.local import LocalHandle, LocalReplicaSet
from serve_app.messages import ReplicaStats
from serve_app.replica import EngineReplica
from serve_app.router_ingress import RouterIngress


class EngineIngress(RouterIngress):
    """The ingress deployment's class when `AppConfig.colocated` (app.py deploys it)."""

    def __init__(self, config: AppConfig, engine_cls: type[EngineClient] | None = None, draft: Any = None):
        replicas: list[EngineReplica] = []
        super().__init__(config, LocalReplicaSet(replicas))
        self.submissions = None  # the replica is in-process: its calls cost no Serve messages
        self.replica = EngineReplica(config.engine, LocalHandle(self.admission), engine_cls, metrics_enabled=True,
                                     slo=config.slo, draft=draft)
        replicas.append(self.replica)

    async def check_health(self) -> None:
        await super().check_health()
        await self.replica.check_health()

    # What the split graph's EngineReplica deployment answers by handle.

    def stats(self) -> ReplicaStats:
        return self.replica.stats()

    def routing_counters(self) -> dict[str, int]:
        return self.replica.routing_counters()

    def engine_stats(self) -> EngineStats:
        return self.replica.engine_stats()

    def __del__(self) -> None:
        """Serve calls this when it stops the replica: the engine stops with it."""
        self.replica.__del__()
