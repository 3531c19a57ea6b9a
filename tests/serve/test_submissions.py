"""An ingress's requests to a replica in batches (serve_app.submissions): those that come while a
call is on its way go together in the next, their chunks over the replica's channel once it is
open and on their call before, and a request whose job ends before it does is aborted exactly
when it can be, never before its replica has it."""

from __future__ import annotations

import asyncio

from conftest import run

from engine.sampling_params import SamplingParams
from serve_app.messages import EngineRequest, StreamChunk
from serve_app.submissions import Submissions


def request(rid: str) -> EngineRequest:
    return EngineRequest(rid, [11, 12], SamplingParams(max_tokens=4, temperature=0))


class _Channel:
    """Replica r's channel, open unless told otherwise."""
    id = "c"

    def __init__(self) -> None:
        self.is_open = True
        self.queues: dict[str, asyncio.Queue] = {}

    def register(self, request_id: str) -> asyncio.Queue:
        queue = self.queues[request_id] = asyncio.Queue()
        return queue

    def unregister(self, request_id: str) -> None:
        self.queues.pop(request_id, None)


class _Channels:
    def __init__(self) -> None:
        self.channel = _Channel()

    def get(self, replica_id: str) -> _Channel | None:
        assert replica_id == "r"
        return self.channel if self.channel.is_open else None


class _Replicas:
    """Records each submit and abort call; the n-th submit call is acknowledged once `acks[n]`
    is set (on the channel it names: named none, its requests' chunks follow on it, one each
    and the call ends), then stays open."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[str]]] = []
        self.channels: list[str | None] = []  # each submit call's
        self.acks: list[asyncio.Event] = []

    @property
    def submit(self):
        return _Remote(self._submit)

    @property
    def abort(self):
        return _Remote(self._abort)

    async def _submit(self, requests, channel, replica_hint):
        assert replica_hint == "r"
        self.calls.append(("submit", [r.request_id for r in requests]))
        self.channels.append(channel)
        ack = self.ack(len(self.channels) - 1)
        await ack.wait()
        yield channel is not None
        if channel is None:
            yield [(r.request_id, StreamChunk(finished=True)) for r in requests]
            return
        await asyncio.Event().wait()

    async def _abort(self, request_ids, replica_hint):
        assert replica_hint == "r"
        self.calls.append(("abort", list(request_ids)))

    def ack(self, n: int) -> asyncio.Event:
        while len(self.acks) <= n:
            self.acks.append(asyncio.Event())
        return self.acks[n]


class _Remote:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args, **kwargs):
        result = self.fn(*args, **kwargs)
        return result if hasattr(result, "__anext__") else asyncio.ensure_future(result)


async def _passes(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def test_requests_that_come_while_a_call_is_on_its_way_go_together_and_ends_abort_only_what_the_replica_has():
    async def go():
        replicas, channels, background, lost = _Replicas(), _Channels(), set(), []
        subs = Submissions(replicas, replicas, channels, 5.0,
                           lambda call: background.add(asyncio.ensure_future(call)), lost.append)
        a = subs.submit("r", request("a"))
        await _passes()
        assert replicas.calls == [("submit", ["a"])]  # on its way, not acknowledged
        futures = {rid: subs.submit("r", request(rid)) for rid in "bcd"}
        subs.end("b", finished=False)  # its client left before it was sent: dropped
        replicas.ack(0).set()
        assert await a is channels.channel.queues["a"]  # on the channel: its chunks come on the channel's queue
        await _passes()
        assert replicas.calls[1:] == [("submit", ["c", "d"])]
        subs.end("c", finished=False)  # sent, not acknowledged: aborted once it is
        await _passes()
        assert len(replicas.calls) == 2
        replicas.ack(1).set()
        assert isinstance(await futures["d"], asyncio.Queue)
        await _passes()
        assert replicas.calls[2:] == [("abort", ["c"])]
        subs.end("a", finished=True)  # ended at the replica: nothing to abort
        subs.end("d", finished=False)  # acknowledged, its client left
        await _passes()
        assert replicas.calls[3:] == [("abort", ["d"])]
        assert replicas.channels == ["c", "c"] and channels.channel.queues == {}
        assert lost == [] and subs._submitted == {} and subs._unsent == {} and subs._aborts == {}
        for task in background:
            task.cancel()

    run(go())


def test_a_batch_whose_call_fails_before_its_acknowledgement_fails_each_request_once():
    class _Fails(_Replicas):
        async def _submit(self, requests, channel, replica_hint):
            self.calls.append(("submit", [r.request_id for r in requests]))
            raise ConnectionError("replica died")
            yield

    async def go():
        replicas, channels, background, lost = _Fails(), _Channels(), set(), []
        subs = Submissions(replicas, replicas, channels, 5.0,
                           lambda call: background.add(asyncio.ensure_future(call)), lost.append)
        futures = [subs.submit("r", request(rid)) for rid in "ab"]
        results = await asyncio.gather(*futures, return_exceptions=True)
        assert [(e.status, e.message) for e in results] == [(503, "engine replica failed: ConnectionError")] * 2
        assert replicas.calls == [("submit", ["a", "b"])] and lost == ["r"]
        for rid in "ab":
            subs.end(rid, finished=False)  # nothing reached the replica: no abort
        await _passes()
        assert len(replicas.calls) == 1 and channels.channel.queues == {}

    run(go())


def test_a_batch_sent_while_the_channel_opens_streams_on_its_call_and_the_next_one_over_the_channel():
    async def go():
        replicas, channels, background = _Replicas(), _Channels(), set()
        subs = Submissions(replicas, replicas, channels, 5.0,
                           lambda call: background.add(asyncio.ensure_future(call)), [].append)
        channels.channel.is_open = False  # opening
        firsts = [subs.submit("r", request(rid)) for rid in "ab"]
        await _passes()
        channels.channel.is_open = True  # opened while the batch was on its way
        later = subs.submit("r", request("c"))
        replicas.ack(0).set()
        for rid, future in zip("ab", firsts):
            queue = await future
            assert queue is not channels.channel.queues.get(rid)
            assert (await queue.get()).finished and await queue.get() is None  # the call's chunk, then its end
            subs.end(rid, finished=True)
        replicas.ack(1).set()
        assert await later is channels.channel.queues["c"]
        assert replicas.calls == [("submit", ["a", "b"]), ("submit", ["c"])]
        assert replicas.channels == [None, "c"]
        subs.end("c", finished=False)
        await _passes()
        assert replicas.calls[2:] == [("abort", ["c"])] and channels.channel.queues == {}
        for task in background:
            task.cancel()

    run(go())
