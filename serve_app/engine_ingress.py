"""`EngineIngress`: the OpenAI front end and its one engine replica in one actor.

On a small host every Serve actor is a process that wakes ~100 times a second even when idle,
and every hop serializes each stream message on both sides. With one engine replica there is
nothing for a separate ingress to spread, so the ingress calls the replica in-process
(serve_app.local.LocalReplicaSet, the shim the tests use) and the hop and the actor are gone.
The router stays a deployment of its own: admission, priorities and 429s are unchanged.
"""

from __future__ import annotations

from typing import Any

from engine.client import EngineClient
from serve_app.config import AppConfig
from serve_app.ingress import Ingress
from serve_app.local import LocalReplicaSet
from serve_app.replica import EngineReplica


class EngineIngress(Ingress):
    """The ingress deployment's class when `AppConfig.colocated` (app.py deploys it)."""

    def __init__(self, config: AppConfig, router: Any, engine_cls: type[EngineClient] | None = None,
                 draft: Any = None):
        self.replica = EngineReplica(config.engine, router, engine_cls, metrics_enabled=True, slo=config.slo,
                                     draft=draft)
        super().__init__(config, router, LocalReplicaSet([self.replica]))

    async def check_health(self) -> None:
        await self.replica.check_health()

    def __del__(self) -> None:
        """Serve calls this when it stops the replica: the engine stops with it."""
        self.replica.__del__()
