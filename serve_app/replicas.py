"""The engine replicas, as the ingress sees them: one interface, in this process or deployments.

`Replicas.stream(replica_id, request)` is the request's coalesced chunks from the replica the
router named; closing the stream before its last chunk aborts the request there. `model_info()`
is the served model's, `check_health()` Serve's check of what is in this process.

`LocalReplicas` are EngineReplicas in this process (the colocated graph's one): a request is a call
of the replica's `stream`.

`ServeReplicas` (serve_app.transport) is the EngineReplica deployment by handle.
"""
from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator
from typing import Protocol

from serve_app.messages import EngineRequest, ModelInfo, StreamChunk
from serve_app.replica import EngineReplica


class Replicas(Protocol):
    def stream(self, replica_id: str, request: EngineRequest) -> AsyncGenerator[StreamChunk, None]: ...

    async def model_info(self) -> ModelInfo: ...

    async def check_health(self) -> None: ...


class LocalReplicas:
    """EngineReplicas in this process, by replica id."""

    def __init__(self, replicas: list[EngineReplica]):
        self._by_id = {replica.replica_id: replica for replica in replicas}

    async def stream(self, replica_id: str, request: EngineRequest) -> AsyncGenerator[StreamChunk, None]:
        async with contextlib.aclosing(self._by_id[replica_id].stream(request)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def model_info(self) -> ModelInfo:
        return next(iter(self._by_id.values())).model_info()

    async def check_health(self) -> None:
        for replica in self._by_id.values():
            await replica.check_health()
