"""The request path between the ingress and an engine replica deployment: both ends of one protocol.

One streamed Serve call per request costs the GPU config's graph a tenth of its burst and twice
its serving CPU (BENCHMARKS.md, "Serving over HTTP"), so chunks travel over a channel: one
streamed call per ingress and replica carrying every request's chunks that are ready at one
moment as one message. Every call names its replica (`Pinned.replica_id`, read by
serve_app.pinning). The messages (serve_app.messages): `Open` (the channel; its first item is the
id of the replica it reached), `Submit` (requests, batched: those that come while one is on its
way go in the next) and `Abort` (batched too).

A channel, at the ingress (`_Channel`):

    OPENING --first item--> OPEN --its stream ends or fails--> ENDED
    OPENING --accept timeout or failure--> ENDED  (its requests fail with ReplicaUnavailable: 503)
    OPEN --a Submit refused--> ENDED  (closed here at once; the next Submit opens another)

A request, at the ingress (`_Sent`):

    QUEUED --its batch goes--> SENT --Submit answers True--> RUNNING --finished chunk--> DONE
    SENT --Submit answers False--> QUEUED again, on a new channel, until the accept timeout
    QUEUED/SENT --accept timeout, call failed--> DONE with ReplicaUnavailable
    RUNNING --its channel ended--> DONE with ReplicaUnavailable
    closed by its consumer: QUEUED: withdrawn, never sent; SENT: aborted once acknowledged (an
    Abort may not overtake its Submit); RUNNING: aborted.

At the replica (`ReplicaChannels`), a channel is open from `Open` until the ingress closes it, or
until it has carried no request for CHANNEL_IDLE_S (Serve's drain of a replica waits for open
calls). A Submit naming a channel not open there runs nothing and answers False: it ended idle
as the Submit came, or the Submit reached another replica than the channel's.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import uuid
from collections.abc import AsyncGenerator, Callable

from serve_app.api.wire import APIError
from serve_app.batching import KeyedBatchers
from serve_app.calls import ReplicaHandle, ReplicaStreams
from serve_app.messages import Abort, Batch, EngineRequest, ModelInfo, Open, StreamChunk, Submit
from serve_app.serve_internals import own_serve_request_id

logger = logging.getLogger("cbserve.transport")
CHANNEL_IDLE_S = 2.0
_UNREACHABLE = "the engine replica chosen for this request is unreachable; retry"


class ReplicaUnavailable(APIError):
    """A 503 for a request whose replica failed or did not answer: the router should stop sending there."""

    def __init__(self, replica_id: str, message: str):
        super().__init__(503, message, "service_unavailable")
        self.replica_id = replica_id


# ---------------------------------------------------------------- the ingress's end

class _Sent:
    __slots__ = ("request", "queue", "channel", "acknowledged", "closed")

    def __init__(self, request: EngineRequest) -> None:
        self.request = request
        self.queue: asyncio.Queue[StreamChunk | APIError] = asyncio.Queue()
        self.channel: _Channel | None = None  # the channel its chunks come on, once sent
        self.acknowledged = False  # RUNNING
        self.closed = False  # closed by its consumer while SENT


class _Channel:
    _counter = itertools.count()

    def __init__(self, streams: ReplicaStreams, ingress_id: str, named: str):
        self.replica_id = named  # once OPEN: the replica it reached
        self.id = f"{ingress_id}-{named}-{next(self._counter)}"
        self.opened: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.ended = False
        self.requests: dict[str, _Sent] = {}
        self._reader = asyncio.ensure_future(self._read(streams))

    async def _read(self, streams: ReplicaStreams) -> None:
        own_serve_request_id()
        stream = streams.channel.remote(Open(self.id, self.replica_id))
        failure: Exception | None = None
        try:
            first = await stream.__anext__()
            if not isinstance(first, str):
                raise RuntimeError("a channel opens with its replica's id")
            self.replica_id = first
            self.opened.set_result(None)
            async for batch in stream:
                if isinstance(batch, str):
                    raise RuntimeError("a channel names its replica once")
                for request_id, chunk in batch:
                    if (sent := self.requests.get(request_id)) is not None:
                        sent.queue.put_nowait(chunk)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.warning("the channel to replica %s failed: %r", self.replica_id, e)
            failure = e
        finally:
            self.ended = True
            if not self.opened.done():
                self.opened.set_exception(failure or RuntimeError("the channel ended before it opened"))
                self.opened.exception()  # retrieved: whoever waits gets it, and none may
            reason = f"engine replica failed: {type(failure).__name__}" if failure else "the channel ended"
            for sent in self.requests.values():  # RUNNING ones are lost; SENT ones are refused, or fail
                if failure is not None or sent.acknowledged:
                    sent.queue.put_nowait(ReplicaUnavailable(self.replica_id, reason))
            self.requests.clear()
            stream.cancel()

    def close(self) -> None:
        self.ended = True
        self._reader.cancel()


class ServeReplicas:
    """The EngineReplica deployment by handle (with the request path's transport options)."""

    def __init__(self, replicas: ReplicaHandle, accept_timeout_s: float):
        self._replicas, self._streams = replicas, replicas.options(stream=True)
        self._accept_timeout_s = accept_timeout_s
        self._id = uuid.uuid4().hex
        self._channels: dict[str, _Channel] = {}  # by the replica each reached
        self._submits: KeyedBatchers[_Sent] = KeyedBatchers(self._send_submits)
        self._aborts: KeyedBatchers[str] = KeyedBatchers(self._send_aborts)

    async def stream(self, replica_id: str, request: EngineRequest) -> AsyncGenerator[StreamChunk, None]:
        sent = _Sent(request)
        self._submits.add(replica_id, sent)
        finished = False
        try:
            while not finished:
                item = await sent.queue.get()
                if isinstance(item, APIError):
                    raise item
                finished = item.finished
                yield item
        finally:
            channel = sent.channel
            if channel is not None:
                channel.requests.pop(request.request_id, None)
            if not finished and not self._submits.discard(replica_id, sent):
                sent.closed = True
                if sent.acknowledged and channel is not None:
                    self._aborts.add(channel.replica_id, request.request_id)

    async def model_info(self) -> ModelInfo:
        return await self._replicas.model_info.remote()

    async def check_health(self) -> None:
        """Nothing of the replicas' is here: the EngineReplica deployment has its own health check."""

    async def _channel(self, replica_id: str, timeout_s: float) -> _Channel:
        """The OPEN channel to the replica named, opened first if it has none. One that reaches
        another replica is that replica's channel, and its requests run there."""
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
            if self._channels.get(replica_id) is channel and channel.ended:
                del self._channels[replica_id]
        if channel.replica_id != replica_id:
            del self._channels[replica_id]
            other = self._channels.get(channel.replica_id)
            if other is not None and not other.ended:
                channel.close()
                return other
            self._channels[channel.replica_id] = channel
        return channel

    async def _send_submits(self, replica_id: str, batch: list[_Sent]) -> None:
        own_serve_request_id()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._accept_timeout_s
        try:
            while True:
                channel = await self._channel(replica_id, max(0.0, deadline - loop.time()))
                for sent in batch:
                    sent.channel = channel
                    channel.requests[sent.request.request_id] = sent
                if await self._submit(channel, batch, max(0.0, deadline - loop.time())):
                    return
                channel.close()  # not open at the replica: the batch goes again on a new one
                for sent in batch:
                    channel.requests.pop(sent.request.request_id, None)
                if loop.time() >= deadline:
                    raise ReplicaUnavailable(channel.replica_id, _UNREACHABLE)
        except ReplicaUnavailable as e:
            for sent in batch:
                if sent.channel is not None:
                    sent.channel.requests.pop(sent.request.request_id, None)
                sent.queue.put_nowait(e)

    async def _submit(self, channel: _Channel, batch: list[_Sent], timeout_s: float) -> bool:
        """Whether the replica runs the batch; it is then RUNNING, and those closed meanwhile are aborted."""
        submit = Submit(channel.id, channel.replica_id, [s.request for s in batch])
        try:
            accepted = await asyncio.wait_for(self._replicas.submit.remote(submit), timeout_s)
        except TimeoutError:
            raise ReplicaUnavailable(channel.replica_id, _UNREACHABLE) from None
        except Exception as e:
            logger.warning("submitting %d requests to replica %s failed: %r", len(batch), channel.replica_id, e)
            raise ReplicaUnavailable(channel.replica_id, f"engine replica failed: {type(e).__name__}") from e
        if accepted:
            for sent in batch:
                sent.acknowledged = True
                if sent.closed:
                    self._aborts.add(channel.replica_id, sent.request.request_id)
        return accepted

    async def _send_aborts(self, replica_id: str, request_ids: list[str]) -> None:
        own_serve_request_id()
        try:
            await self._replicas.abort.remote(Abort(replica_id, request_ids))
        except Exception:
            logger.warning("aborting %d requests at replica %s failed", len(request_ids), replica_id, exc_info=True)


# ---------------------------------------------------------------- the replica's end

class _Outbox:
    """A channel's chunks not yet sent, and how many requests send through it."""

    def __init__(self) -> None:
        self.items: Batch = []
        self.ready = asyncio.Event()
        self.num_live = 0

    def put(self, request_id: str, chunk: StreamChunk) -> None:
        self.items.append((request_id, chunk))
        self.ready.set()


class ReplicaChannels:
    """The channels open at one replica and the submitted requests running on them, each a task
    iterating `run(request)` (closing it aborts the request); `ended(request_id)` once its task
    is done, even one cancelled before it ran."""

    def __init__(self, replica_id: str, run: Callable[[EngineRequest], AsyncGenerator[StreamChunk, None]],
                 ended: Callable[[str], None]):
        self.replica_id, self._run, self._on_end = replica_id, run, ended
        self.outboxes: dict[str, _Outbox] = {}  # by channel id
        self.tasks: dict[str, asyncio.Task[None]] = {}  # by request id

    async def open(self, message: Open) -> AsyncGenerator[str | Batch, None]:
        outbox = self.outboxes[message.channel_id] = _Outbox()
        try:
            yield self.replica_id
            while True:
                try:
                    await asyncio.wait_for(outbox.ready.wait(), CHANNEL_IDLE_S)
                except TimeoutError:
                    if outbox.num_live == 0:
                        return
                    continue
                await asyncio.sleep(0)  # the other streams woken by the same engine output put theirs
                outbox.ready.clear()
                batch, outbox.items = outbox.items, []
                if batch:
                    yield batch
        finally:
            if self.outboxes.get(message.channel_id) is outbox:
                del self.outboxes[message.channel_id]

    def submit(self, message: Submit) -> bool:
        outbox = self.outboxes.get(message.channel_id)
        if outbox is None:
            return False
        for request in message.requests:
            outbox.num_live += 1
            task = self.tasks[request.request_id] = asyncio.ensure_future(self._send(request, outbox))
            task.add_done_callback(functools.partial(self._ended, request.request_id, outbox))
        return True

    def abort(self, message: Abort) -> None:
        """Ids not running here (ended already, or never sent here) are ignored."""
        for request_id in message.request_ids:
            if (task := self.tasks.get(request_id)) is not None:
                task.cancel()

    async def _send(self, request: EngineRequest, outbox: _Outbox) -> None:
        async with contextlib.aclosing(self._run(request)) as chunks:
            async for chunk in chunks:
                outbox.put(request.request_id, chunk)

    def _ended(self, request_id: str, outbox: _Outbox, _: asyncio.Task[None]) -> None:
        self.tasks.pop(request_id, None)
        self._on_end(request_id)
        outbox.num_live -= 1
        outbox.ready.set()
