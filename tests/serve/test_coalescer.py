"""StreamCoalescer on synthetic engine streams: message count, text preserved, deadline flushes,
closing the source when the consumer leaves, errors passed through."""

from __future__ import annotations

import asyncio

import pytest
from conftest import run

from engine.errors import RequestFailedError
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from serve_app.coalescer import StreamCoalescer


def _output(step: int, finished: bool, n: int = 1) -> RequestOutput:
    outs = [CompletionOutput(i, f" w{step}", [step], "length" if finished else None) for i in range(n)]
    return RequestOutput("r", None, [1, 2], outs, finished, RequestMetrics(0.0))


class Source:
    """An engine stream: `steps` outputs, `delay_s` apart; records whether it was closed."""

    def __init__(self, steps: int, delay_s: float, n: int = 1, fail_at: int | None = None, finish: bool = True):
        self.steps, self.delay_s, self.n, self.fail_at, self.finish = steps, delay_s, n, fail_at, finish
        self.closed = False

    async def __call__(self):
        try:
            for step in range(self.steps):
                await asyncio.sleep(self.delay_s)
                if step == self.fail_at:
                    raise RequestFailedError("boom")
                yield _output(step, self.finish and step == self.steps - 1, self.n)
        finally:
            self.closed = True


async def _collect(coalescer: StreamCoalescer, source: Source):
    return [chunk async for chunk in coalescer.coalesce(source())]


def _text(chunks, index: int = 0) -> str:
    return "".join(o.text for c in chunks for o in c.outputs if o.index == index)


def test_zero_interval_passes_every_output_through():
    chunks = run(_collect(StreamCoalescer(0.0), Source(10, 0.0)))
    assert len(chunks) == 10 and chunks[-1].finished and not any(c.finished for c in chunks[:-1])
    assert _text(chunks) == "".join(f" w{i}" for i in range(10))
    assert all(c.num_prompt_tokens == 2 for c in chunks)


def test_interval_coalesces_first_token_at_once_and_keeps_every_sample():
    """40 steps 5 ms apart (~200 ms), flush every 50 ms: a handful of messages, the first one
    holding only the first token, every sample's text whole, the finish reason on the last."""
    coalescer = StreamCoalescer(0.05)
    chunks = run(_collect(coalescer, Source(40, 0.005, n=2)))
    assert 2 <= len(chunks) <= 8 and coalescer.num_messages == len(chunks)
    assert [len(o.token_ids) for o in chunks[0].outputs] == [1, 1]
    for index in (0, 1):
        assert _text(chunks, index) == "".join(f" w{i}" for i in range(40))
    assert chunks[-1].finished and [o.finish_reason for o in chunks[-1].outputs] == ["length", "length"]
    assert coalescer.num_output_tokens == 80 and coalescer.metrics is not None


def test_buffered_tokens_flush_on_the_deadline_even_if_the_next_step_is_slow():
    async def go():
        loop = asyncio.get_running_loop()
        t0, times = loop.time(), []
        async for _ in StreamCoalescer(0.05).coalesce(Source(6, 0.03)()):
            times.append(loop.time() - t0)
        return [b - a for a, b in zip(times, times[1:])]

    assert max(run(go())) < 0.1  # never held longer than the interval + one step


def test_leaving_early_closes_the_engine_stream():
    async def go():
        source = Source(100, 0.01)
        gen = StreamCoalescer(0.0).coalesce(source())
        await gen.__anext__()
        await gen.aclose()
        return source

    assert run(go()).closed


def test_a_stream_that_ends_unfinished_gets_a_final_chunk():
    chunks = run(_collect(StreamCoalescer(0.0), Source(3, 0.0, finish=False)))
    assert chunks[-1].finished and _text(chunks) == " w0 w1 w2"


def test_engine_errors_reach_the_caller():
    with pytest.raises(RequestFailedError, match="boom"):
        run(_collect(StreamCoalescer(0.05), Source(5, 0.001, fail_at=3)))


@pytest.mark.parametrize("interval_s", [0.0, 1.0])  # the read awaited directly; raced against a held flush
def test_a_consumer_cancelled_while_waiting_on_the_engine_closes_its_stream(interval_s):
    async def go():
        source = Source(100, 0.02)
        chunks = []

        async def consume():
            async for chunk in StreamCoalescer(interval_s).coalesce(source()):
                chunks.append(chunk)

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.07)  # the first token sent, the next outputs read (and held, with an interval)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return source, chunks

    source, chunks = run(go())
    assert source.closed and chunks[0].outputs[0].text == " w0"
    if interval_s:
        assert len(chunks) == 1  # only the first token sent, the rest held
    else:
        assert len(chunks) >= 2  # every output read sent
