"""`ReplicaChannels`: the ingress's end of one stream per engine replica that carries every
request's chunks (EngineReplica.channel).

Each Serve message costs both processes ~0.1 ms of CPU whatever it holds (BENCHMARKS.md), and
the engine's steps make the chunks of many requests ready at once. Over a channel they travel
as one message, where each request's own call would carry one each. The requests go to the
replica in batched calls (serve_app.submissions) that acknowledge them and end with them.

Owns: opening a replica's channel on first use (in the background: requests sent before it is
open stream on their batch's call), handing each chunk to its request's queue, and failing the
requests on a channel that ends (a replica that died, or a call that broke) with a 503 on their
queue. Does not own: the jobs' flow (jobs.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from serve_app.call_ids import own_serve_request_id
from serve_app.protocol import APIError

logger = logging.getLogger("cbserve.ingress")
RETRY_S = 1.0  # a replica whose channel could not open is not asked again sooner


class Channel:
    """One replica's channel: `register` a request before submitting it naming this channel's
    id; its chunks, or an APIError if the channel ends first, arrive on the queue."""

    def __init__(self, owner: ReplicaChannels, replica_id: str):
        self.owner, self.replica_id = owner, replica_id
        self.is_open = False
        self._queues: dict[str, asyncio.Queue] = {}
        self._reader = asyncio.ensure_future(self._read())

    @property
    def id(self) -> str:
        """Unique to this ingress and replica: a call that lands on another replica than the one
        named finds no channel of that id there and streams on its own."""
        return f"{self.owner.id}-{self.replica_id}"

    def register(self, request_id: str) -> asyncio.Queue:
        queue = self._queues[request_id] = asyncio.Queue()
        return queue

    def unregister(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    async def _read(self) -> None:
        own_serve_request_id()  # not the id of the request being served when the channel opened
        reason = "the engine replica's stream channel ended"
        stream = self.owner.replica_streams.channel.remote(self.id, replica_hint=self.replica_id)
        try:
            reached = await asyncio.wait_for(stream.__anext__(), self.owner.open_timeout_s)
            if reached != self.replica_id:  # the handle does not see that replica (yet)
                return
            self.is_open = True
            async for batch in stream:
                for request_id, chunk in batch:
                    queue = self._queues.get(request_id)
                    if queue is not None:
                        queue.put_nowait(chunk)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.warning("the stream channel to replica %s failed: %r", self.replica_id, e)
            reason = f"engine replica failed: {type(e).__name__}"
        finally:
            self.owner.closed(self)
            self.is_open = False
            error = APIError(503, reason, "service_unavailable")
            for queue in self._queues.values():
                queue.put_nowait(error)
            self._queues.clear()
            cancel = getattr(stream, "cancel", None)
            if cancel is not None:
                cancel()


class ReplicaChannels:
    """This ingress's channels, by replica id. `replica_streams`: the replicas' handle with
    streaming on (or serve_app.local's shim); `open_timeout_s`: a channel whose replica has not
    answered within this is given up (and tried again later)."""

    def __init__(self, replica_streams: Any, open_timeout_s: float):
        self.replica_streams, self.open_timeout_s = replica_streams, open_timeout_s
        self.id = uuid.uuid4().hex
        self._channels: dict[str, Channel] = {}
        self._retry_at: dict[str, float] = {}

    def get(self, replica_id: str) -> Channel | None:
        """The replica's open channel; None while it opens (this starts it) or could not."""
        channel = self._channels.get(replica_id)
        if channel is None and time.monotonic() >= self._retry_at.get(replica_id, 0.0):
            channel = self._channels[replica_id] = Channel(self, replica_id)
        return channel if channel is not None and channel.is_open else None

    def closed(self, channel: Channel) -> None:
        """A channel ended: the next request to its replica opens another, at once if this one
        had opened (it ended idle, or its replica died), else after RETRY_S."""
        if self._channels.get(channel.replica_id) is channel:
            del self._channels[channel.replica_id]
        if channel.is_open:
            self._retry_at.pop(channel.replica_id, None)
        else:
            self._retry_at[channel.replica_id] = time.monotonic() + RETRY_S
