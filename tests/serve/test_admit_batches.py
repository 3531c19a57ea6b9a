"""Admissions asked in batches: the ingress's AdmissionBatches against the real Router, in-process
(the Router deployment's calls through serve_app.local's shim; through Serve: test_admission_e2e)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from conftest import run

from serve_app.admit_batches import AdmissionBatches
from serve_app.config import RouterConfig
from serve_app.local import LocalHandle
from serve_app.messages import AdmitRequest, ReplicaStats
from serve_app.protocol import APIError
from serve_app.router import Router


def req(rid: str) -> AdmitRequest:
    return AdmitRequest(rid, 0, 10, 10)


def full(replica_id: str = "r0") -> ReplicaStats:
    """A replica with no headroom (its engine's waiting queue at the router's bound of 1)."""
    return ReplicaStats(replica_id, True, 1, 4, 4, 100, 100, 0.0, 0, 16, (), (), 0.0)


def room(replica_id: str = "r0", free_slots: int = 1) -> ReplicaStats:
    return ReplicaStats(replica_id, True, 0, 4 - free_slots, 4, 100, 100, 0.0, 0, 16, (), (), 0.0)


class _HeldRouter:
    """The real Router behind a batch call that is on its way until `arrive` is set; records each
    batch's request ids and each released one."""

    def __init__(self, router: Router):
        self.router = router
        self.batches: list[list[str]] = []
        self.released: list[str] = []
        self.arrive = asyncio.Event()

    async def release(self, request_ids: list[str]) -> None:
        self.released.extend(request_ids)
        await self.router.release(request_ids)

    async def admit_many(self, requests: list[AdmitRequest]):
        self.batches.append([r.request_id for r in requests])
        await self.arrive.wait()
        async with contextlib.aclosing(self.router.admit_many(requests)) as answers:
            async for batch in answers:
                yield batch


class _Ingress:
    """AdmissionBatches as an ingress holds it, calling `target` in-process."""

    def __init__(self, target) -> None:
        self.target = target
        self.tasks: set[asyncio.Task] = set()
        self.admissions = AdmissionBatches(LocalHandle(target), self.in_background)

    @property
    def released(self) -> list[str]:
        return self.target.released

    def in_background(self, call) -> None:
        task = asyncio.ensure_future(call)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def admit(self, rid: str) -> asyncio.Task:
        return asyncio.ensure_future(self.admissions.admit(req(rid)))


async def _settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


def _router(**config) -> Router:
    router = Router(RouterConfig(max_waiting_per_replica=1, **config))
    router._tick_task.cancel()
    return router


def test_admissions_that_arrive_while_a_batch_is_on_its_way_go_together_in_the_next():
    """1. `a` is sent alone; while its call is on its way `b`, `c` and `d` arrive.
    2. Once `a`'s batch is acknowledged the three go in one call: two calls for four requests.
    3. Each gets its own answer: the replica's two free slots and one waiting place take `a`, `b`
       and `c` at once; `d` waits in the router's queue and is admitted when a request ends.
    With a call per admission the router would see four calls."""
    async def go():
        router = _router()
        await router.report(room(free_slots=2))
        held = _HeldRouter(router)
        ingress = _Ingress(held)
        a = ingress.admit("a")
        await _settle()
        b, c, d = (ingress.admit(rid) for rid in "bcd")
        await _settle()
        assert held.batches == [["a"]]
        held.arrive.set()
        await _settle()
        assert held.batches == [["a"], ["b", "c", "d"]]
        assert [(await t).replica_id for t in (a, b, c)] == ["r0"] * 3
        assert not d.done() and len(router.queue) == 1
        await router.release(["a"])
        assert (await asyncio.wait_for(d, 1)).replica_id == "r0"
        assert not ingress.released

    run(go())


def test_a_wait_cancelled_before_its_batch_is_sent_never_reaches_the_router():
    async def go():
        router = _router()
        await router.report(full())
        held = _HeldRouter(router)
        ingress = _Ingress(held)
        ingress.admit("a")
        await _settle()
        b = ingress.admit("b")
        await _settle()
        b.cancel()
        await _settle()
        held.arrive.set()
        await _settle()
        assert held.batches == [["a"]] and [e.request.request_id for e in router.queue.entries()] == ["a"]
        assert not ingress.released

    run(go())


@pytest.mark.parametrize("acknowledged", [False, True])
def test_a_wait_cancelled_after_its_batch_is_sent_is_withdrawn_from_the_routers_queue(acknowledged):
    """A client that leaves while its request is queued at the router: released once the router
    holds it (after the acknowledgement, so the release cannot arrive first), and it leaves the
    queue; the other request of its batch still gets its answer."""
    async def go():
        router = _router()
        await router.report(full())
        held = _HeldRouter(router)
        ingress = _Ingress(held)
        a, b = ingress.admit("a"), ingress.admit("b")
        await _settle()
        if acknowledged:
            held.arrive.set()
            await _settle()
            assert len(router.queue) == 2
        a.cancel()
        await _settle()
        assert ingress.released == (["a"] if acknowledged else [])
        held.arrive.set()
        await _settle()
        assert ingress.released == ["a"]
        assert [e.request.request_id for e in router.queue.entries()] == ["b"]
        await router.report(room())
        assert (await asyncio.wait_for(b, 1)).replica_id == "r0"
        assert not router.pool.views["r0"].pending.keys() - {"b"}

    run(go())


def test_a_wait_cancelled_while_its_admission_is_on_its_way_back_is_released_once():
    """The router admitted `a`, and its client left before the answer reached it: `a` is
    released once, and the replica's place it took is free again."""
    async def go():
        router = _router()
        await router.report(full())
        held = _HeldRouter(router)
        held.arrive.set()
        ingress = _Ingress(held)
        a = ingress.admit("a")
        await _settle()
        await router.report(room())  # dispatched: the answer is on its way
        a.cancel()
        await _settle()
        assert ingress.released == ["a"]
        assert "a" not in router.pool.views["r0"].active and not router.queue

    run(go())


def test_a_refusal_answers_at_once_and_a_withdrawn_refusal_is_not_released():
    async def go():
        router = _router(max_queued_requests=1)
        await router.report(full())
        held = _HeldRouter(router)
        ingress = _Ingress(held)
        a, b, c = ingress.admit("a"), ingress.admit("b"), ingress.admit("c")
        await _settle()
        c.cancel()
        held.arrive.set()
        await _settle()
        assert (await b).error.status == 429 and not a.done()
        assert ingress.released == []  # `c` was refused: nothing of it at the router

    run(go())


def test_a_batch_whose_call_fails_answers_each_of_its_requests_with_a_503():
    class _Unreachable:
        released: list[str] = []

        async def admit_many(self, requests):
            raise ConnectionError("router unreachable")
            yield

    async def go():
        ingress = _Ingress(_Unreachable())
        waits = [ingress.admit(rid) for rid in "ab"]
        for wait in waits:
            with pytest.raises(APIError) as failed:
                await asyncio.wait_for(wait, 1)
            assert failed.value.status == 503 and "router" in failed.value.message
        later = ingress.admit("c")  # the next batch is sent again
        with pytest.raises(APIError):
            await asyncio.wait_for(later, 1)

    run(go())


def test_a_batch_call_that_ends_early_withdraws_what_it_holds():
    """The ingress's end of a batch call went away (its process died): the router takes the
    batch's queued requests out of its queue and frees the place of one admitted but not yet
    answered."""
    async def go():
        router = _router()
        await router.report(full())
        answers = router.admit_many([req("a"), req("b")])
        assert await answers.__anext__() == []  # the acknowledgement: both queued
        await router.report(room())  # `a` admitted, its answer not read
        await answers.aclose()
        assert not router.queue and "a" not in router.pool.views["r0"].active

    run(go())
