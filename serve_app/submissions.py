"""`Submissions`: an ingress's requests sent to each engine replica in batches
(EngineReplica.submit), and those whose clients left aborted in batches (EngineReplica.abort).

A request's own streaming call to its replica cost the ingress about a third of its Python in a
burst (Serve's routing, the gRPC send, reading the call's messages) and the replica a fifth
(BENCHMARKS.md), though with a stream channel open (serve_app.channels) the call carries only an
acknowledgement. The requests to one replica that come while a submit call to it is on its way
go together in the next; their chunks come over the replica's channel when it is open, else on
their batch's call (a burst's first requests, which come while the channel opens).

Owns: the submit calls per replica, registering a batch's requests on the replica's channel when
it is open, each request's acknowledgement (whether its chunks come over the channel, or on the
call: no channel was open, or the call reached another replica than the one named, or the
channel had just ended there), handing a call's own chunks to each request's queue, failing a
batch's requests with a 503 on their queue when its call fails (the replica died) or is not
acknowledged in time, and aborting a request whose job ends before the request does (its client
left): not yet sent, it is dropped; sent, it is aborted once its batch is acknowledged, so the
abort cannot reach the replica before the request. Does not own: opening and reading the
channels, the jobs' flow (jobs.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from serve_app.call_ids import own_serve_request_id
from serve_app.channels import Channel, ReplicaChannels
from serve_app.messages import EngineRequest
from serve_app.protocol import APIError

logger = logging.getLogger("cbserve.ingress")


class _Batch:
    def __init__(self, request_ids: list[str]) -> None:
        self.request_ids = request_ids
        self.acknowledged = False
        self.on_channel = False  # with `acknowledged`: its requests' chunks come over the channel
        self.withdrawn: list[str] = []  # ended before the replica acknowledged the batch


class _Submitted:
    __slots__ = ("replica_id", "request", "queue", "channel", "accepted", "batch")

    def __init__(self, replica_id: str, request: EngineRequest) -> None:
        self.replica_id, self.request = replica_id, request
        self.queue: asyncio.Queue | None = None  # its chunks', once sent
        self.channel: Channel | None = None  # the channel it is registered on
        self.accepted: asyncio.Future = asyncio.get_running_loop().create_future()
        self.batch: _Batch | None = None  # None until sent

    def leave_channel(self) -> None:
        if self.channel is not None:
            self.channel.unregister(self.request.request_id)
            self.channel = None


class Submissions:
    """`replicas`: the engine replicas' handle (or serve_app.local's shim), `replica_streams` the
    same with streaming on; `channels`: this ingress's channels to them; `accept_timeout_s`: a
    batch its replica has not acknowledged within this fails; `in_background`: runs a coroutine to
    its end whatever happens to the request that started it; `lost`: told the id of a replica
    whose call failed or went unanswered."""

    def __init__(self, replicas: Any, replica_streams: Any, channels: ReplicaChannels, accept_timeout_s: float,
                 in_background: Callable[[Coroutine], None], lost: Callable[[str], None]):
        self._replicas, self._streams, self._channels = replicas, replica_streams, channels
        self._accept_timeout_s = accept_timeout_s
        self._in_background, self._lost = in_background, lost
        self._submitted: dict[str, _Submitted] = {}  # by request id, until its job ends
        self._unsent: dict[str, dict[str, _Submitted]] = {}  # by replica id: its next batch
        self._aborts: dict[str, list[str]] = {}  # by replica id: requests to abort in its next call

    def submit(self, replica_id: str, request: EngineRequest) -> asyncio.Future:
        """Sends `request` to the replica in its next batch. The future, once the replica has it:
        the queue its chunks come on, the replica's channel's (chunks, then a 503 if the channel
        ends first) or, if they come on the call instead, a queue of the call's own (chunks, then
        None if the call ended without finishing it: a channel's end, which may come meanwhile,
        does not reach it); or a 503 (APIError). The queue also gets a 503 if the call fails
        before the request ends. Call `end` when the job is done with the request."""
        entry = self._submitted[request.request_id] = _Submitted(replica_id, request)
        unsent = self._unsent.get(replica_id)
        if unsent is None:
            unsent = self._unsent[replica_id] = {}
            self._in_background(self._send(replica_id, unsent))
        unsent[request.request_id] = entry
        return entry.accepted

    def end(self, request_id: str, finished: bool) -> None:
        """The job is done with the request; one that did not finish at the replica is aborted."""
        entry = self._submitted.pop(request_id, None)
        if entry is None:
            return
        entry.leave_channel()
        if finished:
            return
        if entry.batch is None:
            del self._unsent[entry.replica_id][request_id]
        elif entry.batch.acknowledged:
            self._abort_later(entry.replica_id, [request_id])
        else:
            entry.batch.withdrawn.append(request_id)

    async def _send(self, replica_id: str, unsent: dict[str, _Submitted]) -> None:
        """Sends the replica's batches, each with the requests that came while the one before was
        on its way, until none is left."""
        try:
            while unsent:
                own_serve_request_id()  # not the id of the request being served when the batch began
                entries = list(unsent.values())
                unsent.clear()
                batch = _Batch([entry.request.request_id for entry in entries])
                channel = self._channels.get(replica_id)  # None while it opens (this starts it)
                for entry in entries:
                    entry.batch = batch
                    if channel is not None:
                        entry.channel, entry.queue = channel, channel.register(entry.request.request_id)
                stream = self._streams.submit.remote([entry.request for entry in entries],
                                                     None if channel is None else channel.id, replica_hint=replica_id)
                try:
                    on_channel = await asyncio.wait_for(stream.__anext__(), self._accept_timeout_s)
                except Exception as e:
                    _cancel(stream)
                    self._fail_unaccepted(replica_id, batch, e)
                    continue
                batch.acknowledged, batch.on_channel = True, on_channel
                if batch.withdrawn:
                    self._abort_later(replica_id, batch.withdrawn)
                for entry in entries:
                    if not on_channel:
                        entry.leave_channel()
                        entry.queue = asyncio.Queue()
                    if not entry.accepted.done():
                        entry.accepted.set_result(entry.queue)
                self._in_background(self._read(replica_id, stream, batch))
        finally:
            if self._unsent.get(replica_id) is unsent:
                del self._unsent[replica_id]

    def _fail_unaccepted(self, replica_id: str, batch: _Batch, error: Exception) -> None:
        if isinstance(error, TimeoutError):
            logger.warning("replica %s did not accept %d requests within %.1f s", replica_id,
                           len(batch.request_ids), self._accept_timeout_s)
            failure = APIError(503, "the engine replica chosen for this request is unreachable; retry",
                               "service_unavailable")
        else:
            logger.warning("submitting %d requests to replica %s failed: %r", len(batch.request_ids), replica_id,
                           error)
            failure = APIError(503, f"engine replica failed: {type(error).__name__}", "service_unavailable")
        self._lost(replica_id)
        for request_id in batch.request_ids:
            entry = self._submitted.get(request_id)
            if entry is not None and not entry.accepted.done():
                entry.accepted.set_exception(failure)

    async def _read(self, replica_id: str, stream: Any, batch: _Batch) -> None:
        """The batch's call after its acknowledgement: chunks of requests that are not on the
        channel, then its end once every request in it has ended at the replica."""
        try:
            async for pairs in stream:
                for request_id, chunk in pairs:
                    entry = self._submitted.get(request_id)
                    if entry is not None:
                        entry.queue.put_nowait(chunk)
        except Exception as e:
            logger.warning("the submit call to replica %s failed: %r", replica_id, e)
            self._lost(replica_id)
            end: APIError | None = APIError(503, f"engine replica failed: {type(e).__name__}", "service_unavailable")
        else:
            end = None  # the call's own chunks all came: a request they did not finish gets None
        finally:
            _cancel(stream)
        for request_id in batch.request_ids:
            entry = self._submitted.get(request_id)
            if entry is not None and (end is not None or not batch.on_channel):
                entry.queue.put_nowait(end)

    def _abort_later(self, replica_id: str, request_ids: list[str]) -> None:
        """Aborts the requests at the replica: those that end while an abort call to it is on its
        way go together in the next."""
        aborts = self._aborts.get(replica_id)
        if aborts is None:
            aborts = self._aborts[replica_id] = []
            self._in_background(self._send_aborts(replica_id, aborts))
        aborts.extend(request_ids)

    async def _send_aborts(self, replica_id: str, aborts: list[str]) -> None:
        try:
            while aborts:
                own_serve_request_id()
                request_ids = aborts[:]
                aborts.clear()
                try:
                    await self._replicas.abort.remote(request_ids, replica_hint=replica_id)
                except Exception:
                    logger.warning("aborting %d requests at replica %s failed", len(request_ids), replica_id,
                                   exc_info=True)
        finally:
            if self._aborts.get(replica_id) is aborts:
                del self._aborts[replica_id]


def _cancel(stream: Any) -> None:
    cancel = getattr(stream, "cancel", None)
    if cancel is not None:
        cancel()
