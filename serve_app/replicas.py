"""The engine replicas, as the ingress sees them: one interface, in this process or deployments.

`Replicas.stream(replica_id, request)` is the request's coalesced chunks from the replica the
router named; closing the stream before its last chunk aborts the request there. `model_info()`
is the served model's, `check_health()` Serve's check of what is in this process.

`LocalReplicas` are EngineReplicas in this process (the colocated graph's one): a request is a call
of the replica's `stream`.

`ServeReplicas` is the EngineReplica deployment by handle, one way there and one way back: a
replica's requests go in batched `submit` calls (those that come while a call to it is on its way
go in the next: serve_app.batching), and every chunk comes back over the replica's channel
(EngineReplica.channel: one stream per ingress and replica, opened on first use and again when it
has ended), the chunks of many requests a message. A request is submitted naming the replica's
open channel (a channel opened for a replica this handle does not list reaches another, where
those requests then run); a batch the replica refuses (the channel ended idle as it came) goes
again. A channel that ends ends the streams of the requests it was running. A
replica that does not open its channel or acknowledge a submit within `accept_timeout_s`, or
whose call fails, fails its requests with ReplicaUnavailable (a 503; the
job tells the admission the replica is lost). A request whose stream is closed before its end is
aborted at the replica in batched `abort` calls once its submit was acknowledged (so the abort
cannot overtake it), or dropped if it was not sent yet.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any, Protocol

from serve_app.batching import KeyedBatchers
from serve_app.messages import EngineRequest, ModelInfo, StreamChunk
from serve_app.protocol import APIError
from serve_app.replica import EngineReplica
from serve_app.serve_internals import own_serve_request_id

logger = logging.getLogger("cbserve.ingress")
_UNREACHABLE = "the engine replica chosen for this request is unreachable; retry"
_RETRY_S = 0.02  # before a refused submit goes again


class ReplicaUnavailable(APIError):
    """A 503 for a request whose replica failed or did not answer: the router should stop sending there."""

    def __init__(self, replica_id: str, message: str):
        super().__init__(503, message, "service_unavailable")
        self.replica_id = replica_id


class Replicas(Protocol):
    def stream(self, replica_id: str, request: EngineRequest) -> AsyncIterator[StreamChunk]: ...

    async def model_info(self) -> ModelInfo: ...

    async def check_health(self) -> None: ...


class LocalReplicas:
    """EngineReplicas in this process, by replica id."""

    def __init__(self, replicas: list[EngineReplica]):
        self._by_id = {replica.replica_id: replica for replica in replicas}

    async def stream(self, replica_id: str, request: EngineRequest) -> AsyncIterator[StreamChunk]:
        async with contextlib.aclosing(self._by_id[replica_id].stream(request)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def model_info(self) -> ModelInfo:
        return next(iter(self._by_id.values())).model_info()

    async def check_health(self) -> None:
        for replica in self._by_id.values():
            await replica.check_health()


class _Submitted:
    """A request on its way to a replica, and then streaming from it."""
    __slots__ = ("request", "queue", "channel", "acknowledged", "closed")

    def __init__(self, request: EngineRequest) -> None:
        self.request = request
        self.queue: asyncio.Queue = asyncio.Queue()  # its chunks, or an APIError
        self.channel: _Channel | None = None  # the channel its chunks come on, once sent
        self.acknowledged = False  # the replica runs it: an abort now reaches it after it
        self.closed = False  # its stream was closed before its end


class _Channel:
    """The ingress's end of one replica's channel: each registered request's chunks onto its queue.
    Opened for the replica the router named, it is the channel of the replica it reached
    (`replica_id` once open): another where the handle does not list the one named."""
    _counter = itertools.count()

    def __init__(self, streams: Any, ingress_id: str, named: str):
        self.replica_id = named
        self.id = f"{ingress_id}-{named}-{next(self._counter)}"  # a new one each time it opens
        self.opened: asyncio.Future = asyncio.get_running_loop().create_future()  # True once open
        self.ended = False
        self._entries: dict[str, _Submitted] = {}
        self._reader = asyncio.ensure_future(self._read(streams))

    @property
    def is_open(self) -> bool:
        return self.opened.done() and not self.ended

    def register(self, entry: _Submitted) -> None:
        entry.channel = self
        self._entries[entry.request.request_id] = entry

    def unregister(self, entry: _Submitted) -> None:
        if self._entries.get(entry.request.request_id) is entry:
            del self._entries[entry.request.request_id]

    async def _read(self, streams: Any) -> None:
        own_serve_request_id()  # not the id of the request being served when the channel opened
        stream = streams.channel.remote(self.id, replica_hint=self.replica_id)
        failure: Exception | None = None
        try:
            self.replica_id = await stream.__anext__()  # the replica it is open at
            self.opened.set_result(True)
            async for batch in stream:
                for request_id, chunk in batch:
                    entry = self._entries.get(request_id)
                    if entry is not None:
                        entry.queue.put_nowait(chunk)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.warning("the stream channel to replica %s failed: %r", self.replica_id, e)
            failure = e
        finally:
            self.ended = True
            if not self.opened.done():
                self.opened.set_exception(failure or RuntimeError("the channel ended before it opened"))
                self.opened.exception()  # retrieved: whoever waits gets it, and none may
            # A channel ends idle only with no request running on it, so the requests left are those
            # whose submit is on its way (refused, they go again on a new channel); any it was
            # running are lost with it, and their streams must end.
            reason = f"engine replica failed: {type(failure).__name__}" if failure else "the stream channel ended"
            for entry in self._entries.values():
                if failure is not None or entry.acknowledged:
                    entry.queue.put_nowait(ReplicaUnavailable(self.replica_id, reason))
            self._entries.clear()
            _cancel(stream)

    def close(self) -> None:
        self._reader.cancel()


class ServeReplicas:
    """The EngineReplica deployment by handle (with the request path's transport options)."""

    def __init__(self, replicas: Any, accept_timeout_s: float):
        self._replicas, self._streams = replicas, replicas.options(stream=True)
        self._accept_timeout_s = accept_timeout_s
        self._id = uuid.uuid4().hex
        self._channels: dict[str, _Channel] = {}  # by the replica each is open at
        self._submits: KeyedBatchers[_Submitted] = KeyedBatchers(self._send_submits)
        self._aborts: KeyedBatchers[str] = KeyedBatchers(self._send_aborts)

    async def stream(self, replica_id: str, request: EngineRequest) -> AsyncIterator[StreamChunk]:
        entry = _Submitted(request)
        self._submits.add(replica_id, entry)
        finished = False
        try:
            while not finished:
                item = await entry.queue.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
        finally:
            if entry.channel is not None:
                entry.channel.unregister(entry)
            if not finished and not self._submits.discard(replica_id, entry):
                entry.closed = True
                if entry.acknowledged:
                    self._aborts.add(entry.channel.replica_id, request.request_id)

    async def model_info(self) -> ModelInfo:
        return await self._replicas.model_info.remote()

    async def check_health(self) -> None:
        """Nothing of the replicas' is here: the EngineReplica deployment has its own health check."""

    async def _channel(self, replica_id: str, timeout_s: float) -> _Channel:
        """An open channel to the replica named, opened first if it has none (or its last one
        ended). One that opens at another replica (this handle does not list the one named: not
        yet, or no longer) is that replica's channel, and the requests run there, as Serve's
        handle would have sent them; the router learns where from the replicas' reports."""
        channel = self._channels.get(replica_id)
        if channel is not None and not channel.ended:
            return channel
        channel = self._channels[replica_id] = _Channel(self._streams, self._id, replica_id)
        try:
            await asyncio.wait_for(asyncio.shield(channel.opened), timeout_s)
        except Exception as e:
            channel.close()
            raise ReplicaUnavailable(replica_id, _UNREACHABLE) from e
        finally:
            if self._channels.get(replica_id) is channel and not channel.is_open:
                del self._channels[replica_id]
        if channel.replica_id != replica_id:
            del self._channels[replica_id]
            other = self._channels.get(channel.replica_id)
            if other is not None and other.is_open:
                channel.close()
                return other
            self._channels[channel.replica_id] = channel
        return channel

    async def _send_submits(self, replica_id: str, entries: list[_Submitted]) -> None:
        """One batch to the replica named, on its open channel. A submit the replica refuses (the
        channel ended there as it came) goes again, on a new channel once the old one has ended,
        until `accept_timeout_s`; its requests fail if the replica is unreachable."""
        own_serve_request_id()  # not the id of the request being served when the batch began
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._accept_timeout_s
        while True:
            try:
                channel = await self._channel(replica_id, max(0.0, deadline - loop.time()))
            except ReplicaUnavailable as e:
                self._fail(entries, e)
                return
            for entry in entries:
                channel.register(entry)
            target = channel.replica_id
            try:
                accepted = await asyncio.wait_for(
                    self._replicas.submit.remote([e.request for e in entries], channel.id, replica_hint=target),
                    max(0.0, deadline - loop.time()))
            except TimeoutError:
                logger.warning("replica %s did not acknowledge %d requests within %.1f s", target, len(entries),
                               self._accept_timeout_s)
                self._fail(entries, ReplicaUnavailable(target, _UNREACHABLE))
                return
            except Exception as e:
                logger.warning("submitting %d requests to replica %s failed: %r", len(entries), target, e)
                self._fail(entries, ReplicaUnavailable(target, f"engine replica failed: {type(e).__name__}"))
                return
            if accepted:
                for entry in entries:
                    entry.acknowledged = True
                    if entry.closed:
                        self._aborts.add(target, entry.request.request_id)
                return
            for entry in entries:
                channel.unregister(entry)
            if loop.time() >= deadline:
                self._fail(entries, ReplicaUnavailable(target, _UNREACHABLE))
                return
            await asyncio.sleep(_RETRY_S)

    @staticmethod
    def _fail(entries: list[_Submitted], error: APIError) -> None:
        for entry in entries:
            if entry.channel is not None:
                entry.channel.unregister(entry)
            entry.queue.put_nowait(error)

    async def _send_aborts(self, replica_id: str, request_ids: list[str]) -> None:
        own_serve_request_id()
        try:
            await self._replicas.abort.remote(request_ids, replica_hint=replica_id)
        except Exception:
            logger.warning("aborting %d requests at replica %s failed", len(request_ids), replica_id, exc_info=True)


def _cancel(stream: Any) -> None:
    cancel = getattr(stream, "cancel", None)
    if cancel is not None:
        cancel()
