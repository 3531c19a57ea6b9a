"""`AdmissionBatches`: an ingress's admissions at the router, asked and released in batches
(Router.admit_many, Router.release).

Each call to the Router deployment costs the ingress and the router a Serve message each way,
and the router is one process for the whole fleet. A burst's requests arrive together and end
together: the ones that arrive while an admission call is on its way go together in the next,
the results that come at one moment come back in one message, and the requests that end while a
release call is on its way are released together in the next.

Owns: the admissions' and releases' calls, handing each result to the request that waits for it,
and withdrawing the admission of a request whose wait is cancelled (its client left). Not yet
sent, it is dropped; sent, it is released (Router.release takes it out of the queue, or frees its
admission) once the router has acknowledged its batch, so the release cannot reach the router
before the request does. Does not own: the router's queue.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from serve_app.call_ids import own_serve_request_id
from serve_app.messages import AdmitRequest, AdmitResult
from serve_app.protocol import APIError

logger = logging.getLogger("cbserve.ingress")


class _Batch:
    def __init__(self) -> None:
        self.acknowledged = False
        self.withdrawn: list[str] = []  # cancelled before the router acknowledged the batch


class _Waiter:
    __slots__ = ("future", "batch")

    def __init__(self, future: asyncio.Future) -> None:
        self.future = future
        self.batch: _Batch | None = None  # None until sent


class AdmissionBatches:
    """`router`: the router's handle (or serve_app.local's shim); `in_background`: runs a
    coroutine to its end whatever happens to the request that started it."""

    def __init__(self, router: Any, in_background: Callable[[Coroutine], None]):
        self._router, self._router_streams = router, router.options(stream=True)
        self._in_background = in_background
        self._unsent: dict[str, AdmitRequest] = {}
        self._waiters: dict[str, _Waiter] = {}
        self._sending = False
        self._ended: list[str] = []  # admitted requests that ended, not yet released at the router
        self._releasing = False

    async def admit(self, request: AdmitRequest) -> AdmitResult:
        """The router's answer: the replica to stream from, or a refusal."""
        request_id = request.request_id
        waiter = self._waiters[request_id] = _Waiter(asyncio.get_running_loop().create_future())
        self._unsent[request_id] = request
        if not self._sending:
            self._sending = True
            self._in_background(self._send())
        try:
            return await waiter.future
        except asyncio.CancelledError:
            self._withdraw(request_id, waiter)
            raise
        finally:
            del self._waiters[request_id]

    def release_later(self, request_id: str) -> None:
        """Releases an admission at the router: the requests that end while a release call is on
        its way go together in the next."""
        self._ended.append(request_id)
        if not self._releasing:
            self._releasing = True
            self._in_background(self._send_releases())

    async def _send_releases(self) -> None:
        try:
            while self._ended:
                request_ids, self._ended = self._ended, []
                try:
                    await self._router.release.remote(request_ids)
                except Exception:
                    logger.warning("router.release of %d requests failed", len(request_ids), exc_info=True)
        finally:
            self._releasing = False

    def _withdraw(self, request_id: str, waiter: _Waiter) -> None:
        if waiter.batch is None:
            del self._unsent[request_id]
        elif not waiter.batch.acknowledged:
            waiter.batch.withdrawn.append(request_id)
        elif waiter.future.cancelled() or waiter.future.result().replica_id is not None:
            self.release_later(request_id)  # queued at the router, or admitted as its client left

    async def _send(self) -> None:
        own_serve_request_id()  # not the id of the request being served when the batch began
        try:
            while self._unsent:
                batch, requests = _Batch(), list(self._unsent.values())
                self._unsent = {}
                for request in requests:
                    self._waiters[request.request_id].batch = batch
                request_ids = [request.request_id for request in requests]
                stream = self._router_streams.admit_many.remote(requests)
                try:
                    answers = await stream.__anext__()
                except Exception as e:
                    self._fail(request_ids, e)
                    continue
                batch.acknowledged = True
                answered = dict(answers)
                for request_id in batch.withdrawn:
                    result = answered.get(request_id)
                    if result is None or result.replica_id is not None:
                        self.release_later(request_id)
                self._deliver(answers)
                if len(answered) < len(requests):
                    self._in_background(self._read(stream, request_ids))
        finally:
            self._sending = False

    async def _read(self, stream: Any, request_ids: list[str]) -> None:
        """The batch's later answers, until the router has answered every request in it."""
        try:
            async for answers in stream:
                self._deliver(answers)
        except Exception as e:
            self._fail(request_ids, e)
        else:
            self._fail(request_ids, RuntimeError("the router ended the batch without answering"))

    def _deliver(self, answers: list[tuple[str, AdmitResult]]) -> None:
        for request_id, result in answers:
            waiter = self._waiters.get(request_id)
            if waiter is not None and not waiter.future.done():  # else withdrawn: released already
                waiter.future.set_result(result)

    def _fail(self, request_ids: list[str], error: Exception) -> None:
        """The batch's call failed (the router's actor died): its unanswered requests get a 503."""
        failed = [rid for rid in request_ids if rid in self._waiters and not self._waiters[rid].future.done()]
        if failed:
            logger.warning("admission of %d requests failed: %r", len(failed), error)
        for request_id in failed:
            self._waiters[request_id].future.set_exception(
                APIError(503, f"admission router failed: {type(error).__name__}", "service_unavailable"))
