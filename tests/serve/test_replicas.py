"""The transport between the ingress and the engine replicas (serve_app.transport), state by state
of its docstring: both ends, ServeReplicas and EngineReplica.channel / .submit / .abort: requests
sent in batched calls, every chunk back over one channel per ingress and replica (many requests'
chunks a message), and every way a channel or a call can end failing only the requests on it with
a 503, never hanging them. In-process: the calls
go through a handle's stand-in (tests/serve/handles.py); through Serve: test_serve_e2e."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import httpx
import pytest
from conftest import greedy_text, merge, one_lane, run, sse_events
from fake_engine import FakeAsyncEngine
from handles import ReplicaSetHandle

import serve_app.transport as transport
from engine.sampling_params import SamplingParams
from serve_app.admission import LocalAdmission
from serve_app.config import AppConfig, EngineReplicaConfig
from serve_app.ingress import FrontEnd
from serve_app.messages import Abort, EngineRequest, Open, Submit
from serve_app.replica import EngineReplica
from serve_app.router import Router
from serve_app.transport import ReplicaUnavailable, ServeReplicas


def make_replica(replica_id: str = "r", **engine_opts) -> EngineReplica:
    cfg = EngineReplicaConfig(stream_flush_interval_s=0.0)
    return EngineReplica(cfg, None, FakeAsyncEngine.with_options(**engine_opts), replica_id=replica_id)


def request(rid: str, max_tokens: int = 12) -> EngineRequest:
    return EngineRequest(rid, [11, len(rid)], SamplingParams(max_tokens=max_tokens, temperature=0))


async def drain(stream) -> list:
    return [item async for item in stream]


def test_a_channel_carries_its_requests_chunks_batched_and_a_submit_only_acknowledges():
    async def go():
        replica = make_replica(step_delay_s=0.005)
        channel = replica.channel(Open("ingress-1", "r"))
        assert await channel.__anext__() == "r"  # the replica names itself first
        assert await replica.submit(Submit("ingress-1", "r", [request(f"q{i}") for i in range(4)])) is True
        assert replica.record_autoscaling_stats() == {"live_requests": 4}
        texts: dict[str, str] = {}
        messages = finished = 0
        while finished < 4:
            batch = await channel.__anext__()
            messages += 1
            for request_id, chunk in batch:
                texts[request_id] = texts.get(request_id, "") + "".join(o.text for o in chunk.outputs)
                finished += chunk.finished
        assert texts == {f"q{i}": greedy_text([11, 2], 12) for i in range(4)}
        assert messages <= 14  # 4 requests x 12 tokens, one step's chunks a message
        await channel.aclose()
        assert replica.channels.outboxes == {} and replica.channels.tasks == {}
        assert replica.record_autoscaling_stats() == {"live_requests": 0}

    run(go())


def test_a_submit_naming_a_channel_not_open_here_runs_nothing():
    replica = make_replica()
    assert run(replica.submit(Submit("gone", "r", [request("q")]))) is False
    assert replica.channels.tasks == {} and replica._live == set()


def test_a_channel_ends_once_idle_but_not_while_a_request_is_on_it(monkeypatch):
    """Serve's drain of a replica waits for its open calls: a channel must not hold it open."""
    monkeypatch.setattr(transport, "CHANNEL_IDLE_S", 0.05)

    async def go():
        replica = make_replica(step_delay_s=0.04)  # steps slower than the idle window
        channel = replica.channel(Open("c", "r"))
        await channel.__anext__()
        assert await replica.submit(Submit("c", "r", [request("slow", max_tokens=6)]))
        batches = await asyncio.wait_for(drain(channel), 5)  # ends by itself, after the request and the window
        assert sum(chunk.finished for batch in batches for _, chunk in batch) == 1
        assert replica.channels.outboxes == {}

    run(go())


def test_a_submitted_request_is_aborted_alone():
    async def go():
        replica = make_replica(step_delay_s=0.01)
        channel = replica.channel(Open("c", "r"))
        await channel.__anext__()
        assert await replica.submit(Submit("c", "r", [request("stays", 20), request("leaves", 200)]))
        await asyncio.sleep(0.05)
        await replica.abort(Abort("r", ["leaves", "unknown"]))
        for _ in range(500):
            if replica.engine.finished:
                break
            await asyncio.sleep(0.01)
        assert replica.engine.aborted == ["leaves"] and replica.engine.finished == ["stays"]
        await channel.aclose()

    run(go())


class _Counted:
    """A replica handle's stand-in that records each submit call's request ids and channel, and
    each abort's."""

    def __init__(self, replicas: list[EngineReplica]):
        self.replicas = replicas
        self.submits: list[tuple[list[str], str]] = []
        self.aborts: list[list[str]] = []
        for replica in replicas:
            submit, abort = replica.submit, replica.abort

            def counted(message, submit=submit):
                self.submits.append(([r.request_id for r in message.requests], message.channel_id))
                return submit(message)

            def aborted(message, abort=abort):
                self.aborts.append(list(message.request_ids))
                return abort(message)

            replica.submit, replica.abort = counted, aborted

    def handle(self) -> ReplicaSetHandle:
        return ReplicaSetHandle(self.replicas)


@contextlib.asynccontextmanager
async def served(replicas: list[EngineReplica], handle, accept_timeout_s: float = 5.0, **config):
    """The ingress over `replicas` by `handle` (ServeReplicas) and the router in-process:
    (HTTP client, router, the ServeReplicas)."""
    cfg = AppConfig.model_validate(merge({"engine": {"served_model_name": "fake"},
                                          "ingress": {"replica_accept_timeout_s": accept_timeout_s}}, config))
    router = Router(cfg.router)
    for replica in replicas:
        replica._reports = router
        await replica.check_health()
    transport = ServeReplicas(handle, accept_timeout_s)
    ingress = FrontEnd(cfg, LocalAdmission(router), {"fake": transport})
    for _ in range(200):
        if router.lanes and len(one_lane(router).pool.views) == len(replicas):
            break
        await asyncio.sleep(0.01)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=ingress.build_asgi_app()),
                                     base_url="http://test", timeout=30) as client:
            yield client, router, transport
    finally:
        for replica in replicas:
            replica.shutdown()
        router._tick_task.cancel()


BODY = {"model": "fake", "prompt": [11, 12], "max_tokens": 8, "temperature": 0, "stream": True}


def text_of(events: list) -> str:
    return "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])


def released(router) -> bool:
    return not any(view.active for view in one_lane(router).pool.views.values())


def test_a_burst_goes_in_few_submit_calls_and_every_chunk_over_the_one_channel(monkeypatch):
    put = []
    original = transport._Outbox.put
    monkeypatch.setattr(transport._Outbox, "put",
                        lambda self, rid, chunk: (put.append((rid, self)), original(self, rid, chunk)))

    async def go():
        replicas = [make_replica("r0", step_delay_s=0.002)]
        counted = _Counted(replicas)
        async with served(replicas, counted.handle()) as (client, router, _):
            responses = await asyncio.gather(*(client.post("/v1/completions", json=BODY) for _ in range(8)))
            texts = {text_of(sse_events(r.text)) for r in responses}
            assert len(texts) == 1 and texts.pop().count(" t") == 8
            assert len({outbox for _, outbox in put}) == 1  # one channel carried them all
            assert sorted(rid for ids, _ in counted.submits for rid in ids) == sorted({rid for rid, _ in put})
            assert len(counted.submits) <= 3  # those that came while a call was on its way went together
            assert released(router) and not replicas[0].engine._running and not counted.aborts

    run(go())


def test_a_channel_that_breaks_fails_its_requests_with_a_503_and_the_next_opens_another(monkeypatch):
    original = EngineReplica.channel
    broken = []

    async def breaks_once(self, opened):
        sent = 0
        async for message in original(self, opened):
            yield message
            sent += 1
            if sent == 3 and not broken:  # the replica's id and two batches
                broken.append(opened.channel_id)
                raise ConnectionError("channel lost")

    monkeypatch.setattr(EngineReplica, "channel", breaks_once)

    async def go():
        replicas = [make_replica("r0", step_delay_s=0.01)]
        async with served(replicas, ReplicaSetHandle(replicas)) as (client, router, _):
            long = dict(BODY, max_tokens=200)
            responses = await asyncio.wait_for(asyncio.gather(*(client.post("/v1/completions", json=long)
                                                                 for _ in range(3))), 20)
            for r in responses:
                events = sse_events(r.text)
                assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "service_unavailable"
            for _ in range(300):
                if not replicas[0].engine._running and released(router):
                    break
                await asyncio.sleep(0.01)
            assert len(replicas[0].engine.aborted) == 3 and released(router)
            for _ in range(100):  # the replica reported lost, and back with its next report
                if one_lane(router).pool.views:
                    break
                await asyncio.sleep(0.02)
            after = await client.post("/v1/completions", json=BODY)  # on a new channel
            assert text_of(sse_events(after.text)).count(" t") == 8

    run(go())


class _StaleView(ReplicaSetHandle):
    """A handle that does not list `late` yet for its first `misses` calls: those go to the first replica."""

    def __init__(self, replicas: list[EngineReplica], late: str, misses: int, stream: bool = False, calls=None):
        super().__init__(replicas, stream)
        self.late, self.misses, self.calls = late, misses, calls if calls is not None else []

    def options(self, stream: bool = False, **_):
        return _StaleView(self._target, self.late, self.misses, stream, self.calls)

    def __getattr__(self, name):
        method = super().__getattr__(name)
        remote = method.remote

        def call(*args, **kwargs):
            self.calls.append(name)
            if args and getattr(args[0], "replica_id", None) == self.late and len(self.calls) <= self.misses:
                args = (dataclasses.replace(args[0], replica_id=self._target[0].replica_id), *args[1:])
            return remote(*args, **kwargs)

        method.remote = call
        return method


@pytest.mark.parametrize("misses", [1, 2, 5])
def test_a_replica_the_handle_does_not_list_yet_gets_its_requests_once_it_does(misses):
    """A replica the router learnt of before this handle (or one the handle no longer lists): the
    channel opened for it reaches another replica, whose channel it then is, and the requests run
    there, whole. Once the handle lists the replica, a channel opened for it reaches it."""
    async def go():
        replicas = [make_replica("r0", step_delay_s=0.002), make_replica("r1", step_delay_s=0.002)]
        handle = _StaleView(replicas, "r1", misses)
        async with served(replicas, handle) as (client, router, _):
            for _ in range(10):
                responses = await asyncio.wait_for(
                    asyncio.gather(*(client.post("/v1/completions", json=BODY) for _ in range(8))), 20)
                assert all(text_of(sse_events(r.text)).count(" t") == 8 for r in responses)
                if replicas[1]._num_received:
                    break
            assert replicas[1]._num_received and replicas[0].num_misrouted == replicas[1].num_misrouted == 0
            assert released(router) and len(handle.calls) > misses

    run(go())


def test_a_channel_that_ends_while_running_requests_ends_their_streams(monkeypatch):
    """No hung stream: a channel that ends cleanly with requests still on it (the replica went
    away) ends them with a 503 chunk."""
    original = EngineReplica.channel

    async def ends_early(self, opened):
        sent = 0
        async for message in original(self, opened):
            yield message
            sent += 1
            if sent == 2:
                return

    monkeypatch.setattr(EngineReplica, "channel", ends_early)

    async def go():
        replicas = [make_replica("r0", step_delay_s=0.01)]
        async with served(replicas, ReplicaSetHandle(replicas)) as (client, router, _):
            long = dict(BODY, max_tokens=200)
            responses = await asyncio.wait_for(asyncio.gather(*(client.post("/v1/completions", json=long)
                                                                 for _ in range(3))), 20)
            for r in responses:
                events = sse_events(r.text)
                assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "service_unavailable"

    run(go())


class _Silent:
    """A replica handle whose channel opens (or never does) and whose submits never answer; it
    knows `replica`'s model info."""

    def __init__(self, opens: bool, replica: EngineReplica):
        self.opens, self.replica = opens, replica

    def options(self, **_):
        return self

    async def _channel(self, opened):
        if not self.opens:
            await asyncio.Event().wait()
        yield opened.replica_id
        await asyncio.Event().wait()

    async def _never(self, *args, **kwargs):
        await asyncio.Event().wait()

    def __getattr__(self, name):
        from types import SimpleNamespace

        if name == "channel":
            return SimpleNamespace(remote=lambda *a, **k: _stream(self._channel(*a, **k)))
        if name == "model_info":
            return SimpleNamespace(remote=lambda: asyncio.sleep(0, self.replica.model_info()))
        return SimpleNamespace(remote=lambda *a, **k: asyncio.ensure_future(self._never()))


def _stream(agen):
    from handles import _Stream

    return _Stream(agen)


@pytest.mark.parametrize("channel_opens", [False, True], ids=["channel-never-opens", "submit-never-answers"])
def test_a_replica_that_never_answers_is_a_503_and_reported_lost_not_a_hang(channel_opens):
    """The router names a replica whose node died after it chose it: Serve's handle then holds
    the calls until some replica exists, maybe forever. Past replica_accept_timeout_s the jobs
    fail with a 503, each is released, and the replica is reported lost to the router."""
    async def go():
        replicas = [make_replica("r0")]
        async with served(replicas, _Silent(channel_opens, replicas[0]), accept_timeout_s=0.2) as (client, router, _):
            responses = await asyncio.wait_for(asyncio.gather(*(client.post("/v1/completions", json=BODY)
                                                                 for _ in range(3))), 10)
            for r in responses:
                assert r.status_code == 503 and "unreachable" in r.json()["error"]["message"]
            assert released(router) and "r0" not in one_lane(router).pool.views

    run(go())


def test_a_submit_the_replica_refuses_goes_again_on_a_new_channel(monkeypatch):
    """The replica's channel ended idle just as a batch came: the replica runs none of it and says
    so, and the batch goes again once a new channel is open."""
    async def go():
        replicas = [make_replica("r0")]
        counted = _Counted(replicas)
        async with served(replicas, counted.handle()) as (client, router, transport):
            first = await client.post("/v1/completions", json=BODY)
            assert text_of(sse_events(first.text)).count(" t") == 8
            for outbox in list(replicas[0].channels.outboxes):  # the replica's end of the channel ended idle ...
                del replicas[0].channels.outboxes[outbox]
            # ... and the ingress has not read its end yet
            again = await client.post("/v1/completions", json=BODY)
            assert text_of(sse_events(again.text)).count(" t") == 8
            (_, refused), (_, accepted) = counted.submits[-2:]
            assert refused != accepted and counted.submits[-2][0] == counted.submits[-1][0]

    run(go())


def test_a_closed_stream_of_a_request_not_yet_sent_never_reaches_the_replica():
    async def go():
        replica = make_replica("r0", step_delay_s=0.01)
        counted = _Counted([replica])
        transport = ServeReplicas(counted.handle(), 5.0)
        streams = [transport.stream("r0", request(f"q{i}")) for i in range(3)]
        first = asyncio.ensure_future(streams[0].__anext__())  # the first batch: q0 alone
        await asyncio.sleep(0)
        second = asyncio.ensure_future(streams[1].__anext__())
        third = asyncio.ensure_future(streams[2].__anext__())
        await asyncio.sleep(0)
        third.cancel()  # left before its batch went
        await asyncio.gather(third, return_exceptions=True)
        await streams[2].aclose()
        assert (await asyncio.wait_for(first, 5)).outputs and (await asyncio.wait_for(second, 5)).outputs
        assert "q2" not in [rid for ids, _ in counted.submits for rid in ids] and not counted.aborts
        for stream in streams[:2]:
            await stream.aclose()  # left mid-stream: aborted at the replica
        for _ in range(100):
            if len(replica.engine.aborted) == 2:
                break
            await asyncio.sleep(0.01)
        assert sorted(replica.engine.aborted) == ["q0", "q1"]
        replica.shutdown()

    run(go())


def test_replica_unavailable_is_a_503_naming_the_replica():
    error = ReplicaUnavailable("r7", "gone")
    assert error.status == 503 and error.replica_id == "r7" and error.body()["error"]["type"] == "service_unavailable"
