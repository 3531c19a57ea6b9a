"""EngineReplica without Ray: coalescing of deltas, errors as chunks, abort on cancel."""

from __future__ import annotations

import asyncio

from conftest import greedy_text, run
from fake_engine import FakeAsyncEngine, FakeSamplingParams

from serve_app.config import EngineReplicaConfig
from serve_app.messages import EngineRequest
from serve_app.replica import EngineReplica


def make(interval: float, **engine_opts) -> EngineReplica:
    cfg = EngineReplicaConfig(stream_flush_interval_s=interval)
    return EngineReplica(cfg, None, FakeAsyncEngine.with_options(**engine_opts),
                         FakeSamplingParams, replica_id="r")


def request(rid="x", max_tokens=40, **sampling) -> EngineRequest:
    return EngineRequest(rid, [11, 12], None,
                         {"max_tokens": max_tokens, "temperature": 0, **sampling})


async def collect(replica: EngineReplica, req: EngineRequest):
    return [c async for c in replica.generate(req)]


def test_coalescing_cuts_messages_keeps_text():
    """Steps every 5 ms, flush every 50 ms: 40 tokens (~200 ms) -> a handful of messages."""
    async def go():
        fast = await collect(make(0.0, step_delay_s=0.005), request())
        slow = await collect(make(0.05, step_delay_s=0.005), request())
        assert len(fast) == 40
        assert 2 <= len(slow) <= 8
        assert len(slow[0].deltas[0].token_ids) == 1  # first token goes out at once
        for chunks in (fast, slow):
            text = "".join(d.text for c in chunks for d in c.deltas)
            assert text == greedy_text([11, 12], 40)
            assert chunks[-1].finished and chunks[-1].deltas[-1].finish_reason == "length"
            assert all(c.num_prompt_tokens == 2 for c in chunks)

    run(go())


def test_buffered_tokens_flush_on_deadline_even_if_next_step_is_slow():
    async def go():
        replica = make(0.05, step_delay_s=0.03)
        loop = asyncio.get_running_loop()
        t0, times = loop.time(), []
        async for _ in replica.generate(request(max_tokens=6)):
            times.append(loop.time() - t0)
        gaps = [b - a for a, b in zip(times, times[1:])]
        assert max(gaps) < 0.1  # never held longer than the interval + one step

    run(go())


def test_invalid_params_and_engine_value_error_become_400_chunks():
    async def go():
        replica = make(0.0)
        [chunk] = await collect(replica, request(max_tokens=0))
        assert chunk.error.status == 400 and chunk.error.param == "max_tokens"
        bad = EngineRequest("y", [999], None, {"max_tokens": 2})
        [chunk] = await collect(replica, bad)
        assert chunk.error.status == 400 and "prompt" in chunk.error.message

    run(go())


def test_cancelling_the_consumer_aborts_in_engine():
    async def go():
        replica = make(0.0, step_delay_s=0.01)
        gen = replica.generate(request("z", max_tokens=100))
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
        assert replica.stats().received_ids == ("z",)

    run(go())
