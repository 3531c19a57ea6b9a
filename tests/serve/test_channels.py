"""Stream channels (serve_app.channels, EngineReplica.channel) and the batches that submit
requests beside them (serve_app.submissions, EngineReplica.submit): many requests' chunks in one
message per caller, many requests in one call that only acknowledges and ends (or carries their
chunks while the channel opens), and every way a channel or a call can end failing only the
requests on it, never hanging them."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from conftest import greedy_text, local_stack, run, sse_events
from fake_engine import FakeAsyncEngine

import serve_app.channels as channels_module
import serve_app.replica as replica_module
from engine.outputs import CompletionOutput
from engine.sampling_params import SamplingParams
from serve_app.channels import ReplicaChannels
from serve_app.config import AppConfig, EngineReplicaConfig
from serve_app.jobs import Job, JobStream
from serve_app.local import LocalReplicaSet
from serve_app.messages import AdmitRequest, AdmitResult, EngineRequest, StreamChunk
from serve_app.replica import EngineReplica
from serve_app.submissions import Submissions


def make_replica(**engine_opts) -> EngineReplica:
    cfg = EngineReplicaConfig(stream_flush_interval_s=0.0)
    return EngineReplica(cfg, None, FakeAsyncEngine.with_options(**engine_opts), replica_id="r")


def request(rid: str, max_tokens: int = 12) -> EngineRequest:
    return EngineRequest(rid, [11, len(rid)], SamplingParams(max_tokens=max_tokens, temperature=0))


def test_a_channel_carries_its_requests_chunks_batched_and_their_call_only_acknowledges():
    async def go():
        replica = make_replica(step_delay_s=0.005)
        channel = replica.channel("ingress-1")
        assert await channel.__anext__() == "r"  # the replica names itself first
        call = replica.submit([request(f"q{i}") for i in range(4)], "ingress-1")
        assert await call.__anext__() is True  # on the channel
        assert replica.record_autoscaling_stats() == {"live_requests": 4}
        end = asyncio.ensure_future(drain(call))
        texts: dict[str, str] = {}
        messages = finished = 0
        while finished < 4:
            batch = await channel.__anext__()
            messages += 1
            for request_id, chunk in batch:
                texts[request_id] = texts.get(request_id, "") + "".join(o.text for o in chunk.outputs)
                finished += chunk.finished
        assert await end == []  # no chunk on the call, which ends with its requests
        assert texts == {f"q{i}": greedy_text([11, 2], 12) for i in range(4)}
        assert messages <= 14  # 4 requests x 12 tokens, one step's chunks a message
        await channel.aclose()
        assert replica._outboxes == {} and replica._tasks == {}
        assert replica.record_autoscaling_stats() == {"live_requests": 0}

    run(go())


def test_requests_submitted_naming_no_open_channel_stream_on_their_call():
    async def go():
        replica = make_replica()
        messages = [m async for m in replica.submit([request("q"), request("qq")], "gone")]
        assert messages[0] is False
        texts: dict[str, str] = {}
        for request_id, chunk in (pair for batch in messages[1:] for pair in batch):
            texts[request_id] = texts.get(request_id, "") + "".join(o.text for o in chunk.outputs)
        assert texts == {"q": greedy_text([11, 1], 12), "qq": greedy_text([11, 2], 12)}
        assert sum(chunk.finished for batch in messages[1:] for _, chunk in batch) == 2
        assert replica._tasks == {} and replica._live == set()

    run(go())


def test_a_channel_ends_once_idle_but_not_while_a_request_is_on_it(monkeypatch):
    """Serve's drain of a replica waits for its open calls: a channel must not hold it open."""
    monkeypatch.setattr(replica_module, "CHANNEL_IDLE_S", 0.05)

    async def go():
        replica = make_replica(step_delay_s=0.04)  # steps slower than the idle window
        channel = replica.channel("c")
        await channel.__anext__()
        call = replica.submit([request("slow", max_tokens=6)], "c")
        assert await call.__anext__() is True
        rest = asyncio.ensure_future(drain(call))  # as Serve drives the call
        batches = [batch async for batch in channel]  # ends by itself, after the request and the window
        assert await rest == []
        assert sum(chunk.finished for batch in batches for _, chunk in batch) == 1
        assert replica._outboxes == {}

    run(go())


async def submitted_on_channel(replica: EngineReplica, *requests: EngineRequest) -> tuple:
    """Channel "c" opened at the replica and the requests submitted on it, acknowledged: (the
    channel's stream, the submit call)."""
    channel = replica.channel("c")
    await channel.__anext__()
    call = replica.submit(list(requests), "c")
    assert await call.__anext__() is True
    return channel, call


def test_a_call_left_at_its_acknowledgement_aborts_its_requests_and_does_not_hold_the_channel(monkeypatch):
    monkeypatch.setattr(replica_module, "CHANNEL_IDLE_S", 0.05)

    async def go():
        replica = make_replica(step_delay_s=0.01)
        channel, call = await submitted_on_channel(replica, request("left", 200), request("too", 200))
        await asyncio.sleep(0.05)  # both running
        await call.aclose()  # the caller went away (Serve cancels the call)
        assert await asyncio.wait_for(drain(channel), 5) != []  # their chunks so far, then the idle end
        assert sorted(replica.engine.aborted) == ["left", "too"] and not replica.engine._running
        assert replica._outboxes == {} and replica._tasks == {} and replica._live == set()

    run(go())


def test_a_submitted_request_is_aborted_alone_and_the_call_ends_with_the_rest():
    async def go():
        replica = make_replica(step_delay_s=0.01)
        channel, call = await submitted_on_channel(replica, request("stays", 20), request("leaves", 200))
        await asyncio.sleep(0.05)
        replica.abort(["leaves", "unknown"])
        assert await asyncio.wait_for(drain(call), 5) == []
        assert replica.engine.aborted == ["leaves"] and replica.engine.finished == ["stays"]
        await channel.aclose()

    run(go())


def test_requests_over_http_stream_on_their_call_until_the_channel_opens_then_over_it_submitted_together(
        monkeypatch):
    put = []
    original = replica_module._Outbox.put
    monkeypatch.setattr(replica_module._Outbox, "put",
                        lambda self, rid, chunk: (put.append((rid, self)), original(self, rid, chunk)))
    submitted: list[tuple[list[str], str | None]] = []
    submit = EngineReplica.submit

    def counted(self, requests, channel, replica_hint=None):
        submitted.append(([r.request_id for r in requests], channel))
        return submit(self, requests, channel, replica_hint)

    monkeypatch.setattr(EngineReplica, "submit", counted)

    async def go():
        async with local_stack(engine_cls=FakeAsyncEngine.with_options(step_delay_s=0.002)) as (client, router, reps):
            body = {"model": "fake", "prompt": [11, 12], "max_tokens": 8, "temperature": 0, "stream": True}
            first = await client.post("/v1/completions", json=body)  # opens the channel, streams on its batch's call
            assert first.status_code == 200
            [([first_id], first_channel)] = submitted
            assert first_channel is None  # none open yet
            for _ in range(100):
                if reps[0]._outboxes:
                    break
                await asyncio.sleep(0.01)
            [channel_outbox] = reps[0]._outboxes.values()
            responses = await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(6)))
            texts = {text_of(sse_events(r.text)) for r in [first, *responses]}
            assert len(texts) == 1 and texts.pop().count(" t") == 8  # the same on the call and on the channel
            on_channel = {rid for rid, outbox in put if outbox is channel_outbox}
            assert len(on_channel) == 6 and first_id not in on_channel  # every later request's chunks
            assert {rid for rid, outbox in put if outbox is not channel_outbox} == {first_id}
            later = submitted[1:]
            assert sorted(rid for ids, _ in later for rid in ids) == sorted(on_channel)
            assert all(channel is not None for _, channel in later)
            assert len(later) <= 3  # those that came while a call was on its way went together
            assert released(router) and not reps[0].engine._running

    run(go())


def test_a_channel_that_breaks_fails_its_requests_with_a_503_and_aborts_them(monkeypatch):
    original = EngineReplica.channel

    async def breaks_after_two(self, channel_id, replica_hint=None):
        sent = 0
        async for message in original(self, channel_id, replica_hint):
            yield message
            sent += 1
            if sent == 3:  # the replica's id and two batches
                raise ConnectionError("channel lost")

    monkeypatch.setattr(EngineReplica, "channel", breaks_after_two)

    async def go():
        async with local_stack(engine_cls=FakeAsyncEngine.with_options(step_delay_s=0.01)) as (client, router, reps):
            body = {"model": "fake", "prompt": [11, 12], "max_tokens": 4, "stream": True}
            await client.post("/v1/completions", json=body)
            for _ in range(100):
                if reps[0]._outboxes:
                    break
                await asyncio.sleep(0.01)
            long = dict(body, max_tokens=200)
            responses = await asyncio.wait_for(asyncio.gather(*(client.post("/v1/completions", json=long)
                                                                 for _ in range(3))), 20)
            for r in responses:
                events = sse_events(r.text)
                assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "service_unavailable"
            for _ in range(200):
                if not reps[0].engine._running and released(router):
                    break
                await asyncio.sleep(0.01)
            assert len(reps[0].engine.aborted) == 3 and not reps[0].engine._running
            assert released(router)
            after = await client.post("/v1/completions", json=body)  # the next one streams (on a new channel)
            assert text_of(sse_events(after.text)).count(" t") == 4

    run(go())


def job_host(streams, channels: ReplicaChannels, reported: list, replicas=None, accept_timeout_s=5.0
             ) -> SimpleNamespace:
    """The ingress as a job sees it, admitting every request to replica r; `streams` and
    `replicas` (default: `streams`) as the ingress's handles with streaming on and off."""
    async def admit(admit_request):
        return AdmitResult("r")

    def lost(replica_id):
        reported.append(("remove_replica", replica_id))

    host = SimpleNamespace(
        config=AppConfig(), admissions=SimpleNamespace(
            admit=admit, release_later=lambda rid: reported.append(("release", rid))),
        replica_streams=streams,
        call_router_later=lambda method, arg: reported.append((method, arg)), background=set())
    host.submissions = Submissions(replicas or streams, streams, channels, accept_timeout_s,
                                   lambda call: host.background.add(asyncio.ensure_future(call)), lost)
    return host


async def until_open(channels: ReplicaChannels, replica_id: str) -> None:
    for _ in range(100):
        if channels.get(replica_id):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the channel did not open")


async def job_beside_open_channel(streams) -> tuple[list, list, ReplicaChannels]:
    """Job j run to its end, admitted to replica r once r's channel is open: what it put on its
    queue (chunks, then None or an APIError), what it told the router, and the channels."""
    channels = ReplicaChannels(streams, 5.0)
    await until_open(channels, "r")
    reported: list = []
    out: asyncio.Queue = asyncio.Queue()
    job = Job(request("j"), AdmitRequest("j", 0, 2, 12), 0)
    await asyncio.wait_for(JobStream(job_host(streams, channels, reported), job, out).run(), 5)
    return [out.get_nowait()[1] for _ in range(out.qsize())], reported, channels


async def silent_channel(channel_id, replica_hint):
    yield replica_hint
    await asyncio.Event().wait()


def test_a_request_on_a_channel_fails_when_its_call_fails():
    """The replica died mid-request: its call fails, the channel stays silent; the job gets a 503
    and the replica is reported lost."""
    async def dies(requests, channel, replica_hint):
        yield True
        raise ConnectionError("replica died")

    async def go():
        streams = SimpleNamespace(submit=_Remote(dies), channel=_Remote(silent_channel))
        channels = ReplicaChannels(streams, 5.0)
        await until_open(channels, "r")
        reported: list = []
        job = Job(EngineRequest("j", [1, 2], SamplingParams(max_tokens=2)), AdmitRequest("j", 0, 2, 2), 0)
        stream = JobStream(job_host(streams, channels, reported), job, asyncio.Queue())
        await asyncio.wait_for(stream.run(), 5)
        assert stream.started.exception().status == 503
        assert ("remove_replica", "r") in reported and ("release", "j") in reported

    run(go())


def test_a_batch_not_acknowledged_in_time_fails_its_requests_and_reports_the_replica_lost():
    async def never_answers(requests, channel, replica_hint):
        await asyncio.Event().wait()
        yield True

    async def go():
        streams = SimpleNamespace(submit=_Remote(never_answers), channel=_Remote(silent_channel))
        channels = ReplicaChannels(streams, 5.0)
        await until_open(channels, "r")
        reported: list = []
        host = job_host(streams, channels, reported, accept_timeout_s=0.1)
        jobs = [Job(request(f"j{i}"), AdmitRequest(f"j{i}", 0, 2, 12), 0) for i in range(3)]
        streams_ = [JobStream(host, job, asyncio.Queue()) for job in jobs]
        await asyncio.wait_for(asyncio.gather(*(s.run() for s in streams_)), 5)
        for s in streams_:
            assert s.started.exception().status == 503 and "unreachable" in s.started.exception().message
        assert ("remove_replica", "r") in reported
        assert sorted(arg for what, arg in reported if what == "release") == ["j0", "j1", "j2"]

    run(go())


async def drain(stream) -> list:
    return [item async for item in stream]


def text_of(events: list) -> str:
    return "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])


def released(router) -> bool:
    return not any(view.active for view in router.pool.views.values())


class _Remote:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args, **kwargs):
        result = self.fn(*args, **kwargs)
        if hasattr(result, "__anext__"):
            return result
        return asyncio.ensure_future(result)


def test_a_call_that_lands_on_another_replica_streams_on_its_own_call():
    """Each channel's id names its replica: a call the handle sent elsewhere (a stale view) must
    not put its chunks on that replica's channel, which reads them for other requests."""
    async def go():
        replicas = [make_replica(), make_replica()]
        replicas[1].replica_id = "r1"
        channels = ReplicaChannels(LocalReplicaSet(replicas).options(stream=True), 5.0)
        for rid in ("r", "r1"):
            await until_open(channels, rid)
        messages = await drain(replicas[1].submit([request("q")], channels.get("r").id))
        assert messages[0] is False and messages[-1][-1][1].finished

    run(go())


def test_a_channel_whose_replica_never_answers_is_given_up_and_tried_again_later(monkeypatch):
    monkeypatch.setattr(channels_module, "RETRY_S", 0.1)
    opened = []

    async def silent(channel_id, replica_hint):
        opened.append(channel_id)
        await asyncio.Event().wait()
        yield replica_hint

    async def go():
        channels = ReplicaChannels(SimpleNamespace(channel=_Remote(silent)), 0.05)
        assert channels.get("r") is None  # opening
        await asyncio.sleep(0.08)  # given up
        assert channels.get("r") is None
        await asyncio.sleep(0.01)
        assert len(opened) == 1  # not before RETRY_S
        await asyncio.sleep(0.1)
        assert channels.get("r") is None
        await asyncio.sleep(0.01)
        assert len(opened) == 2

    run(go())


def test_a_job_whose_call_lands_beside_its_channel_streams_on_the_call_and_outlives_the_channel():
    """The job registered on replica r's channel, but its call reached r1 (a stale view): its
    chunks come over the call, and r's channel failing meanwhile does not fail it."""
    async def go():
        replicas = [make_replica(), make_replica(step_delay_s=0.01)]
        replicas[1].replica_id = "r1"
        streams = LocalReplicaSet(replicas).options(stream=True)
        channels = ReplicaChannels(streams, 5.0)
        await until_open(channels, "r")
        to_r1 = SimpleNamespace(submit=SimpleNamespace(
            remote=lambda reqs, channel, replica_hint: streams.submit.remote(reqs, channel, replica_hint="r1")))
        reported: list = []
        out: asyncio.Queue = asyncio.Queue()
        job = Job(request("j"), AdmitRequest("j", 0, 2, 12), 0)
        stream = JobStream(job_host(to_r1, channels, reported), job, out)
        task = asyncio.ensure_future(stream.run())
        await asyncio.wait_for(stream.started, 5)
        channels._channels["r"]._reader.cancel()  # r's channel ends mid-job
        await asyncio.wait_for(task, 5)
        items = [out.get_nowait()[1] for _ in range(out.qsize())]
        assert items[-1] is None and items[-2].finished
        assert "".join(o.text for chunk in items[:-1] for o in chunk.outputs) == greedy_text([11, 1], 12)
        assert reported == [("release", "j")] and replicas[1].engine.finished == ["j"]

    run(go())


def test_a_job_whose_call_ends_unfinished_beside_its_channel_gets_a_503():
    async def stops_early(requests, channel, replica_hint):  # no such channel there: all on the call
        yield False
        yield [(requests[0].request_id, StreamChunk(outputs=[CompletionOutput(0, "a", [7])]))]

    async def go():
        streams = SimpleNamespace(submit=_Remote(stops_early), channel=_Remote(silent_channel))
        (chunk, error), reported, _ = await job_beside_open_channel(streams)
        assert chunk.outputs[0].text == "a" and error.status == 503 and "without finishing" in error.message
        assert reported == [("release", "j")]

    run(go())


def test_a_job_acknowledged_off_its_channel_as_the_channel_ends_streams_on_its_call():
    """The replica's channel ended idle just before the job's batch reached it: the batch is
    acknowledged off the channel, and the channel's end, which reaches the ingress meanwhile, does
    not fail the job."""
    ended = asyncio.Event()

    async def ends_when_told(channel_id, replica_hint):
        yield replica_hint
        await ended.wait()

    async def off_channel(requests, channel, replica_hint):
        ended.set()  # the channel ends at the ingress while this call is acknowledged
        yield False
        await asyncio.sleep(0.05)
        yield [(requests[0].request_id, StreamChunk(outputs=[CompletionOutput(0, "a", [7])], finished=True))]

    async def go():
        streams = SimpleNamespace(submit=_Remote(off_channel), channel=_Remote(ends_when_told))
        (chunk, end), reported, channels = await job_beside_open_channel(streams)
        assert chunk.outputs[0].text == "a" and chunk.finished and end is None
        assert reported == [("release", "j")] and "r" not in channels._channels

    run(go())
