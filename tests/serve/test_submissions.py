"""An ingress's requests to a replica in batches (serve_app.submissions): those that come while a
call is on its way go together in the next, and a request whose job ends before it does is
aborted exactly when it can be, never before its replica has it."""

from __future__ import annotations

import asyncio

from conftest import run

from engine.sampling_params import SamplingParams
from serve_app.messages import EngineRequest
from serve_app.submissions import Submissions


def request(rid: str) -> EngineRequest:
    return EngineRequest(rid, [11, 12], SamplingParams(max_tokens=4, temperature=0))


class _Replicas:
    """Records each submit and abort call; the n-th submit call is acknowledged once `acks[n]`
    is set, then stays open."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[str]]] = []
        self.acks: list[asyncio.Event] = []

    @property
    def submit(self):
        return _Remote(self._submit)

    @property
    def abort(self):
        return _Remote(self._abort)

    async def _submit(self, requests, channel, replica_hint):
        assert channel == "c" and replica_hint == "r"
        self.calls.append(("submit", [r.request_id for r in requests]))
        ack = self.ack(len(self.calls) - 1)
        await ack.wait()
        yield True
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
        replicas, background, lost = _Replicas(), set(), []
        subs = Submissions(replicas, replicas, 5.0, lambda call: background.add(asyncio.ensure_future(call)),
                           lost.append)
        queue = asyncio.Queue()
        a = subs.submit("r", "c", request("a"), queue)
        await _passes()
        assert replicas.calls == [("submit", ["a"])]  # on its way, not acknowledged
        futures = {rid: subs.submit("r", "c", request(rid), asyncio.Queue()) for rid in "bcd"}
        subs.end("b", finished=False)  # its client left before it was sent: dropped
        replicas.ack(0).set()
        assert await a is queue  # on the channel: its chunks come on the channel's queue
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
        replicas, background, lost = _Fails(), set(), []
        subs = Submissions(replicas, replicas, 5.0, lambda call: background.add(asyncio.ensure_future(call)),
                           lost.append)
        futures = [subs.submit("r", "c", request(rid), asyncio.Queue()) for rid in "ab"]
        results = await asyncio.gather(*futures, return_exceptions=True)
        assert [(e.status, e.message) for e in results] == [(503, "engine replica failed: ConnectionError")] * 2
        assert replicas.calls == [("submit", ["a", "b"])] and lost == ["r"]
        for rid in "ab":
            subs.end(rid, finished=False)  # nothing reached the replica: no abort
        await _passes()
        assert len(replicas.calls) == 1

    run(go())
