"""Stand-ins for Serve's DeploymentHandles, for tests of the parts that call deployments by handle
(serve_app.admission.RouterClient, serve_app.transport.ServeReplicas) without Ray: `h.method.remote(...)`
-> an awaitable, `h.options(stream=True).method.remote(...)` -> an async iterator with `cancel()`;
`ReplicaSetHandle` sends a call to the replica its message names, as serve_app.pinning does."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator
from typing import Any


class _Stream:
    def __init__(self, agen: AsyncIterator):
        self._agen = agen

    def __aiter__(self) -> _Stream:
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


class _Method:
    def __init__(self, fn: Any, stream: bool):
        self._fn, self._stream = fn, stream

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        if self._stream:
            return _Stream(self._fn(*args, **kwargs))
        result = self._fn(*args, **kwargs)
        if inspect.isawaitable(result):
            return asyncio.ensure_future(result)
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(result)
        return fut


class Handle:
    """`target`'s methods as a deployment handle's."""

    def __init__(self, target: Any, stream: bool = False):
        self._target, self._stream = target, stream

    def options(self, stream: bool = False, **_: Any) -> Handle:
        return type(self)(self._target, stream)

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self._target, name), self._stream)


class ReplicaSetHandle(Handle):
    """A list of replicas: each call to the one its message names (`replica_id` of its first
    argument), else the first."""

    def __getattr__(self, name: str) -> _Method:
        replicas = self._target

        def call(*args: Any, **kwargs: Any) -> Any:
            named = getattr(args[0], "replica_id", None) if args else None
            chosen = next((r for r in replicas if r.replica_id == named), replicas[0])
            return getattr(chosen, name)(*args, **kwargs)

        return _Method(call, self._stream)
