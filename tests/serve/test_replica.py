"""EngineReplica without Ray: the fake engine behind the EngineClient contract, engine errors as
error chunks, abort on cancel, load reports only when something changed."""

from __future__ import annotations

import asyncio
import gc
import time

from conftest import greedy_text, run
from fake_engine import FakeAsyncEngine

from engine.gc_settings import YOUNG_COLLECTION_OBJECTS
from engine.sampling_params import SamplingParams
from serve_app.config import EngineReplicaConfig
from serve_app.messages import Abort, EngineRequest, Open, Submit
from serve_app.replica import EngineReplica
from serve_app.slo import SLOTarget


def make(interval: float = 0.0, router=None, slo=None, **engine_opts) -> EngineReplica:
    cfg = EngineReplicaConfig(stream_flush_interval_s=interval, stats_report_interval_s=0.02,
                              stats_heartbeat_s=0.5)
    return EngineReplica(cfg, router, FakeAsyncEngine.with_options(**engine_opts), replica_id="r", slo=slo)


def request(rid="x", max_tokens=40, prompt=(11, 12)) -> EngineRequest:
    return EngineRequest(rid, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0))


async def collect(replica: EngineReplica, req: EngineRequest):
    """The request's chunks, streamed in-process."""
    return [c async for c in replica.stream(req)]


def test_streams_the_engine_output_coalesced():
    chunks = run(collect(make(0.05, step_delay_s=0.005), request()))
    assert 2 <= len(chunks) <= 8
    assert "".join(o.text for c in chunks for o in c.outputs) == greedy_text([11, 12], 40)
    assert chunks[-1].finished and chunks[-1].outputs[-1].finish_reason == "length"


def test_a_replica_collects_its_streams_young_objects_less_often():
    gc.set_threshold(700)  # Python's default
    make()
    assert gc.get_threshold()[0] == YOUNG_COLLECTION_OBJECTS


def test_engine_refusal_becomes_a_400_chunk_naming_the_field():
    [chunk] = run(collect(make(), request(prompt=[999], max_tokens=2)))
    assert chunk.finished and chunk.error.status == 400 and chunk.error.param == "prompt"


def test_slo_verdicts_only_for_requests_the_service_answered():
    """A finished request is judged; a bad request the engine refused is not (it is the
    client's), nor one whose client left before the end."""
    replica = make(slo={0: SLOTarget(ttft_s=30.0)}, step_delay_s=0.005)
    run(collect(replica, request("ok", max_tokens=3)))
    run(collect(replica, request("bad", prompt=[999], max_tokens=2)))

    async def leave_early():
        gen = replica.stream(request("left", max_tokens=100))
        await gen.__anext__()
        await gen.__anext__()
        await gen.aclose()

    run(leave_early())
    assert replica.slo.snapshot()[0] | {"goodput_rps": None} == {
        "finished": 1, "met": 1, "met_ttft": 1, "met_tpot": 0, "attainment": 1.0, "goodput_rps": None}


def test_cancelling_the_consumer_aborts_in_engine():
    async def go():
        replica = make(step_delay_s=0.01)
        gen = replica.stream(request("z", max_tokens=100))
        await gen.__anext__()
        task = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.005)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for _ in range(200):
            if not replica.engine._running:
                break
            await asyncio.sleep(0.01)
        assert not replica.engine._running
        assert replica.engine.aborted == ["z"] and not replica.engine.finished
        assert replica.stats().received_ids == ("z",) and replica.stats().ended_ids == ("z",)

    run(go())


def test_a_report_lists_a_request_only_once_the_engine_counts_it():
    """The replica has received a request, but the engine has not been handed it yet: the
    report must not list it, or the router would drop its pending admission while the load it
    sees leaves the request out. Once the engine holds it, the report lists it and counts it."""
    async def go():
        replica = make(step_delay_s=0.01, max_num_seqs=1)
        channel = replica.channel(Open("c", replica.replica_id))
        await channel.__anext__()
        assert await replica.submit(Submit("c", replica.replica_id, [request("q", max_tokens=100)]))
        before = replica.stats()
        assert before.received_ids == () and before.num_waiting == 0
        while not replica.engine.has_request("q"):
            await asyncio.sleep(0.001)
        after = replica.stats()
        assert after.received_ids == ("q",) and after.num_waiting + after.num_running == 1
        await replica.abort(Abort(replica.replica_id, ["q"]))
        await channel.aclose()

    run(go())


class _Recorder:
    """Stands in for the router (serve_app.replica.LoadReports): records every report."""

    def __init__(self):
        self.reports = []
        self.times = []

    async def report(self, stats):
        self.reports.append(stats)
        self.times.append(time.monotonic())


def test_load_reports_are_sent_on_change_and_as_a_heartbeat():
    """Checking every 20 ms: an idle replica reports once, then only every 0.5 s heartbeat; a
    request's arrival and end are reported at once."""
    async def go():
        router = _Recorder()
        replica = make(router=router, step_delay_s=0.01)
        await replica.check_health()
        await asyncio.sleep(0.3)
        assert len(router.reports) == 1
        await collect(replica, request(max_tokens=5))
        await asyncio.sleep(0.1)
        assert any(r.received_ids == ("x",) for r in router.reports)
        assert router.reports[-1].num_running == 0 and router.reports[-1].ready
        ended = [r for r in router.reports if r.ended_ids]  # its end listed once, in counts without it
        assert [r.ended_ids for r in ended] == [("x",)] and ended[0].num_running + ended[0].num_waiting == 0
        before = len(router.reports)
        await asyncio.sleep(0.6)
        assert len(router.reports) == before + 1  # one heartbeat
        replica.shutdown()

    run(go())


def test_a_burst_of_ends_is_reported_once_an_engine_output_interval():
    """Requests ending every few ms: each end would wake a report (a Serve call); they go out at
    most once per output interval of the engine (its counts change no more often), and the last
    end is still reported within about one interval."""
    async def go():
        router = _Recorder()
        replica = make(0.1, router=router, step_delay_s=0.002)
        await replica.check_health()
        await asyncio.sleep(0.15)
        first = len(router.reports)
        requests = [collect(replica, request(f"q{i}", max_tokens=2 + i)) for i in range(40)]
        await asyncio.gather(*requests)  # the ends spread over ~0.1 s
        ended_at = time.monotonic()
        await asyncio.sleep(0.25)
        ended = [rid for r in router.reports for rid in r.ended_ids]
        assert sorted(ended) == sorted(f"q{i}" for i in range(40))
        gaps = [b - a for a, b in zip(router.times[first - 1:], router.times[first:])]
        assert gaps and min(gaps) >= 0.09
        assert router.times[-1] - ended_at <= 0.2
        replica.shutdown()

    run(go())
