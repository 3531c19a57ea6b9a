"""Admission as the ingress asks it (serve_app.admission): the Router deployment's client, its
admissions and releases in batches, against the real Router (its calls through a handle's
stand-in, tests/serve/handles.py; through Serve: test_admission_e2e), and the Router in-process."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from conftest import one_lane, run
from handles import Handle

from serve_app.admission import LocalAdmission, RouterClient
from serve_app.api.wire import APIError
from serve_app.config import RouterConfig
from serve_app.messages import AdmitRequest, ReplicaStats
from serve_app.router import Router


def req(rid: str) -> AdmitRequest:
    return AdmitRequest(rid, "m", 0, 10, 10)


def full(replica_id: str = "r0") -> ReplicaStats:
    """A replica with no headroom (its engine's waiting queue at the router's bound of 1)."""
    return ReplicaStats(replica_id, "m", True, 1, 4, 4, 100, 100, 0.0, 0, 16, (), (), 0.0)


def room(replica_id: str = "r0", free_slots: int = 1) -> ReplicaStats:
    return ReplicaStats(replica_id, "m", True, 0, 4 - free_slots, 4, 100, 100, 0.0, 0, 16, (), (), 0.0)


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
    """A RouterClient as an ingress holds it, calling `target` through a handle's stand-in."""

    def __init__(self, target) -> None:
        self.target = target
        self.admissions = RouterClient(Handle(target))

    @property
    def released(self) -> list[str]:
        return self.target.released

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
        assert not d.done() and len(one_lane(router).queue) == 1
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
        assert held.batches == [["a"]] and [e.request.request_id for e in one_lane(router).queue.entries()] == ["a"]
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
            assert len(one_lane(router).queue) == 2
        a.cancel()
        await _settle()
        assert ingress.released == (["a"] if acknowledged else [])
        held.arrive.set()
        await _settle()
        assert ingress.released == ["a"]
        assert [e.request.request_id for e in one_lane(router).queue.entries()] == ["b"]
        await router.report(room())
        assert (await asyncio.wait_for(b, 1)).replica_id == "r0"
        assert not one_lane(router).pool.views["r0"].pending.keys() - {"b"}

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
        assert "a" not in one_lane(router).pool.views["r0"].active and not one_lane(router).queue

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
        assert not one_lane(router).queue and "a" not in one_lane(router).pool.views["r0"].active

    run(go())


class _ReleasingRouter:
    """Records each release call's ids; the first waits for `answer`, a call of "fails" raises."""

    def __init__(self):
        self.calls: list[list[str]] = []
        self.answer = asyncio.Event()

    async def release(self, request_ids: list[str]) -> None:
        self.calls.append(list(request_ids))
        if len(self.calls) == 1:
            await self.answer.wait()
        if "fails" in request_ids:
            raise ConnectionError("router unreachable")


def test_requests_that_end_while_a_release_is_on_its_way_go_together_in_the_next():
    """Each release is a Serve call to the router: ends that come while one is on its way wait
    and go in one call, each request released once; a failed call does not stop later ones."""
    async def go():
        router = _ReleasingRouter()
        admissions = RouterClient(Handle(router))

        async def until(n: int) -> None:
            while len(router.calls) < n or admissions._releases.busy:
                await asyncio.sleep(0.001)

        admissions.release("a")
        while not router.calls:
            await asyncio.sleep(0.001)
        for request_id in ("b", "c", "fails"):  # each in a pass of the loop of its own
            admissions.release(request_id)
            await asyncio.sleep(0.001)
        router.answer.set()
        await until(2)
        admissions.release("d")
        await until(3)
        return router.calls

    assert run(go()) == [["a"], ["b", "c", "fails"], ["d"]]


def test_the_router_in_process_admits_releases_and_withdraws_a_cancelled_wait():
    """LocalAdmission: the replica named once one has room; a wait cancelled while queued leaves
    the queue; a release frees the place for the next."""
    async def go():
        router = _router()
        await router.report(full())
        admission = LocalAdmission(router)
        a, b = (asyncio.ensure_future(admission.admit(req(rid))) for rid in "ab")
        await _settle()
        assert len(one_lane(router).queue) == 2
        b.cancel()
        await _settle()
        assert [e.request.request_id for e in one_lane(router).queue.entries()] == ["a"]
        await router.report(room())
        assert (await asyncio.wait_for(a, 1)).replica_id == "r0"
        admission.release("a")
        assert "a" not in one_lane(router).pool.views["r0"].active
        admission.replica_lost("r0")
        assert await admission.ready_replicas() == {"m": 0}

    run(go())
