"""In-process stand-ins for DeploymentHandles, so the same ingress/router/replica code runs
without Ray (unit tests, quick local runs), and an ingress calls the replica in its own actor
(serve_app.engine_ingress).

Owns: `LocalHandle` (one object: `h.method.remote(...)` -> awaitable, `h.options(stream=True)
.method.remote(...)` -> async iterator with `cancel()`), `LocalReplicaSet` (pins calls to the
replica named by `replica_hint`, like serve_app.pinning does in Serve), and `build_local_app`.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator
from typing import Any

from engine.client import EngineClient
from serve_app.config import AppConfig
from serve_app.ingress import Ingress
from serve_app.replica import EngineReplica
from serve_app.router import Router


class _LocalStream:
    def __init__(self, agen: AsyncIterator):
        self._agen = agen

    def __aiter__(self) -> _LocalStream:
        return self

    async def __anext__(self) -> Any:
        return await self._agen.__anext__()

    def cancel(self) -> None:
        async def _close() -> None:
            try:
                await self._agen.aclose()
            except RuntimeError:
                pass  # still running: the cancelled consumer closes it

        asyncio.ensure_future(_close())


class _LocalMethod:
    def __init__(self, fn: Any, stream: bool):
        self._fn, self._stream = fn, stream

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        if self._stream:
            return _LocalStream(self._fn(*args, **kwargs))
        result = self._fn(*args, **kwargs)
        if inspect.isawaitable(result):
            return asyncio.ensure_future(result)
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(result)
        return fut


class LocalHandle:
    def __init__(self, target: Any, stream: bool = False):
        self._target, self._stream = target, stream

    def options(self, stream: bool = False, **_: Any) -> LocalHandle:
        return type(self)(self._target, stream)

    def __getattr__(self, name: str) -> _LocalMethod:
        return _LocalMethod(getattr(self._target, name), self._stream)


class LocalReplicaSet(LocalHandle):
    """Routes to the replica named by the `replica_hint` kwarg; else the first one."""

    def __getattr__(self, name: str) -> _LocalMethod:
        replicas: list[EngineReplica] = self._target

        def call(*args: Any, replica_hint: str | None = None, **kwargs: Any) -> Any:
            chosen = next((r for r in replicas if r.replica_id == replica_hint), replicas[0])
            if replica_hint is not None:
                kwargs["replica_hint"] = replica_hint
            return getattr(chosen, name)(*args, **kwargs)

        return _LocalMethod(call, self._stream)


def build_local_app(
    config: AppConfig,
    num_replicas: int | None = None,
    engine_cls: type[EngineClient] | None = None,
) -> tuple[Any, Router, list[EngineReplica]]:
    """The whole graph in this process; returns (fastapi_app, router, replicas).

    Replicas start reporting load once an event loop runs (first request or `check_health`).
    """
    router = Router(config.router)
    router_handle = LocalHandle(router)
    replicas = [
        EngineReplica(config.engine, router_handle, engine_cls, replica_id=f"r{i}", slo=config.slo)
        for i in range(num_replicas or config.engine.num_replicas)
    ]
    ingress = Ingress(config, router_handle, LocalReplicaSet(replicas))
    return ingress.build_asgi_app(), router, replicas
