"""Admission, as the ingress sees it: one interface, the router in this process or a deployment.

`Admission` is what a job asks before it runs: `admit` (the replica to stream from, once one has
headroom, or a refusal: 429 when its model's queue is full, 503 with no replica of it), `release`
(the job ended), `replica_lost` (a replica's call failed: stop sending there), and readiness.

`LocalAdmission` holds the Router itself (one ingress replica: the graph's one queue lives in its
process, and each request's admission and release are calls in-process). `RouterClient` calls the
Router deployment of the split graph, its admissions and releases sent in batches (CallBatcher):
what arrives while a call is on its way goes in the next, the results that come at one moment
come back in one message (Router.admit_many streams them). A job whose wait is cancelled (its
client left) withdraws its admission: not yet sent, it is dropped; sent, it is released once the
router has acknowledged its batch, so the release cannot reach the router before the request.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from typing import Protocol

from serve_app.api.wire import APIError
from serve_app.batching import CallBatcher
from serve_app.calls import RouterHandle, Stream
from serve_app.messages import AdmitRequest, AdmitResult
from serve_app.router import Router
from serve_app.serve_internals import own_serve_request_id

logger = logging.getLogger("cbserve.ingress")


class Admission(Protocol):
    async def admit(self, request: AdmitRequest) -> AdmitResult: ...

    def release(self, request_id: str) -> None: ...

    def replica_lost(self, replica_id: str) -> None: ...

    async def ready_replicas(self) -> dict[str, int]: ...

    async def check_health(self) -> None: ...


class LocalAdmission:
    """The Router in this process."""

    def __init__(self, router: Router):
        self.router = router

    async def admit(self, request: AdmitRequest) -> AdmitResult:
        return await self.router.admit(request)

    def release(self, request_id: str) -> None:
        self.router.release_now([request_id])

    def replica_lost(self, replica_id: str) -> None:
        self.router.remove_replica_now(replica_id)

    async def ready_replicas(self) -> dict[str, int]:
        return await self.router.ready_replicas()

    async def check_health(self) -> None:
        await self.router.check_health()


class _Asked:
    """One admission sent (or to send) to the router, until its result or withdrawal."""
    __slots__ = ("request", "future", "acknowledged")

    def __init__(self, request: AdmitRequest) -> None:
        self.request = request
        self.future: asyncio.Future = asyncio.get_running_loop().create_future()
        self.acknowledged = False  # its batch is queued at the router: a release reaches it after


class RouterClient:
    """The Router deployment, by handle (with the request path's transport options)."""

    def __init__(self, router: RouterHandle):
        self._router, self._router_streams = router, router.options(stream=True)
        self._admits: CallBatcher[_Asked] = CallBatcher(self._send_admits)
        self._releases: CallBatcher[str] = CallBatcher(self._send_releases)
        self._withdrawn: dict[str, _Asked] = {}  # cancelled before their batch's acknowledgement
        self._background: set[asyncio.Task] = set()

    async def admit(self, request: AdmitRequest) -> AdmitResult:
        asked = _Asked(request)
        self._admits.add(asked)
        try:
            return await asyncio.shield(asked.future)
        except asyncio.CancelledError:
            if self._admits.discard(asked) or _refused(asked):
                pass  # never sent, or nothing of it at the router
            elif asked.acknowledged:
                self.release(request.request_id)
            else:
                self._withdrawn[request.request_id] = asked
            raise

    def release(self, request_id: str) -> None:
        self._releases.add(request_id)

    def replica_lost(self, replica_id: str) -> None:
        self._in_background(self._router.remove_replica.remote(replica_id))

    async def ready_replicas(self) -> dict[str, int]:
        return await self._router.ready_replicas.remote()

    async def check_health(self) -> None:
        """Nothing of the router's is here: the Router deployment has its own health check."""

    async def _send_admits(self, batch: list[_Asked]) -> None:
        """One admit_many call: returns once the router has queued the batch (its first message),
        the results read in the background as they come."""
        own_serve_request_id()  # not the id of the request being served when the batch began
        stream = self._router_streams.admit_many.remote([a.request for a in batch])
        try:
            first = await stream.__anext__()
        except Exception as e:
            logger.warning("admitting %d requests at the router failed: %r", len(batch), e)
            stream.cancel()
            for asked in batch:
                if not asked.future.done():
                    asked.future.set_exception(APIError(503, f"router unavailable: {type(e).__name__}",
                                                        "service_unavailable"))
            return
        by_id = {a.request.request_id: a for a in batch}
        self._resolve(by_id, first)
        for asked in batch:
            asked.acknowledged = True
            if self._withdrawn.pop(asked.request.request_id, None) is not None and not _refused(asked):
                self.release(asked.request.request_id)
        if any(not a.future.done() for a in batch):
            self._in_background(self._read_results(stream, by_id))
        else:
            stream.cancel()

    async def _read_results(self, stream: Stream[list[tuple[str, AdmitResult]]], by_id: dict[str, _Asked]) -> None:
        try:
            async for answers in stream:
                self._resolve(by_id, answers)
        except Exception as e:
            logger.warning("the router's admission results stopped: %r", e)
        finally:
            stream.cancel()
            for asked in by_id.values():  # no answer will come: a 503, not a hang
                if not asked.future.done():
                    asked.future.set_exception(APIError(503, "router unavailable", "service_unavailable"))

    @staticmethod
    def _resolve(by_id: dict[str, _Asked], answers: list[tuple[str, AdmitResult]]) -> None:
        for request_id, result in answers:
            asked = by_id.get(request_id)
            if asked is not None and not asked.future.done():
                asked.future.set_result(result)

    async def _send_releases(self, request_ids: list[str]) -> None:
        own_serve_request_id()
        await self._router.release.remote(request_ids)

    def _in_background(self, call: Awaitable[None]) -> None:
        async def run() -> None:
            with contextlib.suppress(Exception):
                await call

        task = asyncio.ensure_future(run())
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def _refused(asked: _Asked) -> bool:
    """Whether the router refused it (nothing of it is there to release)."""
    future = asked.future
    return future.done() and not future.cancelled() and (future.exception() is not None
                                                         or future.result().error is not None)
