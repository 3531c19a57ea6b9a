"""AsyncEngine: streamed deltas, concurrency, abort, cancellation, validation before streaming;
each with the step loop on a thread, in its own process, and there with async scheduling."""
from __future__ import annotations

import asyncio
import threading

import pytest

from engine import LLM, AsyncEngine, EngineConfig, SamplingParams
from engine.errors import EngineDeadError, InvalidRequestError

PARAMS = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=[(False, False), (True, False), (True, True)],
                ids=["thread", "process", "process-async-scheduling"])
def engine(request, tiny_llama):
    engine_process, async_scheduling = request.param
    eng = AsyncEngine.from_engine_args(tiny_llama, engine_process=engine_process, max_num_batched_tokens=32,
                                       async_scheduling=async_scheduling)
    yield eng
    eng.shutdown()


async def _collect(engine, prompt, request_id, params=PARAMS):
    tokens, text, deltas, last = [], "", 0, None
    async for out in engine.generate(prompt, params, request_id):
        deltas += 1
        for o in out.outputs:
            tokens += o.token_ids
            text += o.text
        last = out
    return tokens, text, deltas, last


def test_concurrent_streams_equal_offline_generate(engine, tiny_llama):
    prompts = [[5, 6, 7, 8], [40, 41], [100, 3, 3, 3, 3, 9, 12]]
    expected = LLM(tiny_llama).generate(prompts, PARAMS, use_tqdm=False)

    async def main():
        return await asyncio.gather(*(_collect(engine, p, f"c{i}") for i, p in enumerate(prompts)))

    for (tokens, text, deltas, last), ref in zip(asyncio.run(main()), expected):
        assert tokens == ref.outputs[0].token_ids and text == ref.outputs[0].text
        assert deltas > 1 and last.finished and last.outputs[0].finish_reason == "length"


def test_every_delta_shows_the_prompt_that_the_step_loop_sends_once(engine, tiny_llama):
    """The step loop's outputs carry a request's prompt and its token ids with its first output
    only (a long prompt is not sent again with every delta); every delta the stream yields shows
    them, a text prompt and a prompt of token ids alike."""
    ids = LLM(tiny_llama).engine.encode_prompt("the cat sat")

    async def main():
        return ([out async for out in engine.generate("the cat sat", PARAMS, "text-prompt")],
                [out async for out in engine.generate([5, 6, 7], PARAMS, "ids-prompt")])

    text_outputs, id_outputs = asyncio.run(main())
    assert len(text_outputs) > 1 and len(id_outputs) > 1
    assert all(o.prompt == "the cat sat" and o.prompt_token_ids == ids for o in text_outputs)
    assert all(o.prompt is None and o.prompt_token_ids == [5, 6, 7] for o in id_outputs)


def test_the_step_loop_sends_a_requests_prompt_with_its_first_output_alone(tiny_llama):
    from engine.engine_core import AddRequest, StepLoop
    from engine.llm_engine import LLMEngine

    sent = []
    commands = [[AddRequest("a", "the cat sat", PARAMS), AddRequest("b", [5, 6, 7], PARAMS)]]

    def receive(timeout):
        return commands.pop() if commands else [] if loop.engine.has_unfinished_requests() else None

    loop = StepLoop(LLMEngine(EngineConfig.from_kwargs(model=tiny_llama)), lambda out: sent.extend(out.events))
    loop.run(receive)
    for request_id, prompt in (("a", "the cat sat"), ("b", None)):
        first, *rest = [o for o in sent if o.request_id == request_id]
        assert first.prompt == prompt and first.prompt_token_ids and len(rest) == PARAMS.max_tokens - 1
        assert all(o.prompt is None and o.prompt_token_ids == [] for o in rest)  # not sent again


def test_thread_core_builds_and_steps_the_engine_on_one_thread(tiny_llama, monkeypatch):
    """Every parallel region starts from the step loop's thread: libgomp stops spinning at
    barriers once a process holds more OpenMP pools' threads than CPUs, and an engine built on
    the caller's thread gave its pool to that one."""
    import engine.llm_engine as llm_engine

    threads = set()
    build, step = llm_engine.LLMEngine.__init__, llm_engine.LLMEngine.step

    def recorded_build(self, *args, **kwargs):
        threads.add(threading.get_ident())
        build(self, *args, **kwargs)

    def recorded_step(self, hold_deltas=False):
        threads.add(threading.get_ident())
        return step(self, hold_deltas)

    monkeypatch.setattr(llm_engine.LLMEngine, "__init__", recorded_build)
    monkeypatch.setattr(llm_engine.LLMEngine, "step", recorded_step)
    eng = AsyncEngine.from_engine_args(tiny_llama, engine_process=False)
    try:
        tokens, _, _, _ = asyncio.run(_collect(eng, [1, 2, 3], "one"))
    finally:
        eng.shutdown()
    assert len(tokens) == PARAMS.max_tokens
    assert len(threads) == 1 and threading.get_ident() not in threads


def test_abort_ends_stream_and_frees_blocks(engine):
    async def main():
        stream = engine.generate([5, 6, 7], SamplingParams(max_tokens=500, ignore_eos=True), "to-abort")
        first = await stream.__anext__()
        engine.abort("to-abort")
        rest = [out async for out in stream]
        return first, rest

    first, rest = asyncio.run(main())
    assert not first.finished and rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
    _wait_idle(engine)


def test_cancelled_consumer_aborts_request(engine):
    async def main():
        streaming = asyncio.Event()

        async def consume():
            async for _ in engine.generate([9, 9, 9], SamplingParams(max_tokens=500, ignore_eos=True), "cancel-me"):
                streaming.set()
        task = asyncio.create_task(consume())
        await streaming.wait()  # cancelled mid-stream, whatever the machine's speed
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    _wait_idle(engine)


def test_invalid_request_raises_before_streaming(engine):
    async def main():
        with pytest.raises(ValueError, match="prompt"):
            async for _ in engine.generate("", PARAMS, "bad"):
                pass
        return await _collect(engine, [5, 6], "after-bad")

    tokens, _, _, last = asyncio.run(main())
    assert len(tokens) == 20 and last.finished


class _HeldCore:
    """Stands in front of a core and holds its commands until released: a request in flight."""

    def __init__(self, core):
        self.core, self.held = core, []

    def send(self, command):
        self.held.append(command)

    def release(self):
        for command in self.held:
            self.core.send(command)
        self.held = []


def test_stats_count_a_request_in_flight_to_the_step_loop_once(engine):
    """1. A request is handed to the engine but its command has not reached the step loop: it
    already counts as waiting. 2. Once the loop has applied it, the snapshot counts it and the
    in-flight count is gone: counted once, as waiting or running."""
    core = engine._core
    held = engine._core = _HeldCore(core)

    async def main():
        stream = engine.generate([5, 6, 7], SamplingParams(max_tokens=500, ignore_eos=True), "in-flight")
        first = asyncio.ensure_future(stream.__anext__())
        while not engine.has_request("in-flight"):
            await asyncio.sleep(0.001)
        assert engine.stats().num_waiting == 1 and engine.stats().num_running == 0 and held.held
        held.release()
        await first
        stats = engine.stats()
        assert stats.num_waiting + stats.num_running == 1
        engine._core = core  # so that the abort reaches the loop
        await stream.aclose()
        assert not engine.has_request("in-flight")

    try:
        asyncio.run(main())
    finally:
        engine._core = core
    _wait_idle(engine)


def test_engine_process_death_fails_streams_then_the_engine_heals(tiny_llama):
    """1. A stream runs in the child process; the child is killed. 2. The stream raises
    EngineDeadError instead of hanging. 3. A request sent while the child restarts waits for it
    and completes with the tokens of an undisturbed run. 4. Killed more often than
    max_restarts_per_minute, the engine stays dead: check_health and new requests raise."""
    eng = AsyncEngine(EngineConfig.from_kwargs(model=tiny_llama), engine_process=True, max_restarts_per_minute=1)
    expected = LLM(tiny_llama).generate([[5, 6]], PARAMS, use_tqdm=False)[0].outputs[0].token_ids

    async def main():
        stream = eng.generate([5, 6, 7], SamplingParams(max_tokens=5000, ignore_eos=True), "doomed")
        await stream.__anext__()
        eng._core._proc.kill()
        with pytest.raises(EngineDeadError, match="engine process exited"):
            async for _ in stream:
                pass
        assert not eng.is_ready
        tokens, _, _, last = await _collect(eng, [5, 6], "after-restart")
        assert tokens == expected and last.finished and eng.num_restarts == 1 and eng.is_ready
        eng._core._proc.kill()
        while eng.is_ready:  # until the reader thread sees the second death
            await asyncio.sleep(0.01)
        with pytest.raises(EngineDeadError, match="within a minute"):
            eng.check_health()
        with pytest.raises(EngineDeadError, match="within a minute"):
            async for _ in eng.generate([5], PARAMS, "after-second-death"):
                pass

    try:
        asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        eng.shutdown()


def _wait_idle(engine, timeout_s: float = 10.0):
    import time
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats.num_running == 0 and stats.num_waiting == 0 and stats.num_free_blocks == stats.num_total_blocks:
            return
        time.sleep(0.05)
    raise AssertionError(f"engine not idle: {engine.stats()}")


@pytest.fixture(scope="module", params=[False, True], ids=["thread", "process"])
def held_engine(request, tiny_llama):
    """Outputs held for a minute: only a request's first tokens, its end, errors and going idle emit."""
    eng = AsyncEngine(EngineConfig.from_kwargs(model=tiny_llama, max_num_batched_tokens=32),
                      engine_process=request.param, output_interval_s=60.0)
    yield eng
    eng.shutdown()


def test_held_outputs_come_as_first_tokens_then_the_rest_with_the_end(held_engine, engine):
    async def main():
        return await _collect(held_engine, [5, 6, 7, 8], "held"), await _collect(engine, [5, 6, 7, 8], "each")

    (tokens, text, deltas, last), (ref_tokens, ref_text, ref_deltas, _) = asyncio.run(main())
    assert (tokens, text) == (ref_tokens, ref_text)
    assert ref_deltas == PARAMS.max_tokens and deltas == 2 and last.finished


def test_a_batch_mates_end_sends_none_of_the_other_streams_held_deltas(held_engine):
    """Two requests started together; the short one's end goes out at once with its own deltas,
    while the long one's stay held: it gets its first tokens, then everything else with its end."""
    async def main():
        short = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        long = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        return await asyncio.gather(_drain(held_engine.generate([5, 6, 7], short, "mate-short")),
                                    _drain(held_engine.generate([5, 6, 8], long, "mate-long")))

    short, long = asyncio.run(main())
    assert [len(out.outputs[0].token_ids) for out in short] == [1, 2]
    assert [len(out.outputs[0].token_ids) for out in long] == [1, 11]
    assert short[-1].finished and long[-1].finished


def test_held_outputs_never_delay_an_abort_or_a_batch_mates_error(held_engine):
    async def main():
        stream = held_engine.generate([5, 6, 7], SamplingParams(max_tokens=500, ignore_eos=True), "long")
        first = await stream.__anext__()
        with pytest.raises(InvalidRequestError):  # refused while "long" runs: not held for a minute
            await asyncio.wait_for(_collect(held_engine, [5] * 1000, "too-long"), timeout=30)
        held_engine.abort("long")
        rest = await asyncio.wait_for(_drain(stream), timeout=30)
        return first, rest

    first, rest = asyncio.run(main())
    assert len(first.outputs[0].token_ids) == 1 and not first.finished
    assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
    _wait_idle(held_engine)


def test_held_samples_and_stop_strings_come_out_as_unheld(held_engine, engine):
    """Held deltas wait in the output processor, each sample's since its last output: n seeded
    samples, a stop string's holdback and the end come out as they do delta by delta."""
    params = SamplingParams(n=3, max_tokens=16, temperature=1.0, seed=11, stop=["e", "a"])

    async def by_index(eng, request_id):
        texts, tokens, reasons = {}, {}, {}
        async for out in eng.generate([5, 6, 7, 8], params, request_id):
            for o in out.outputs:
                texts[o.index] = texts.get(o.index, "") + o.text
                tokens[o.index] = tokens.get(o.index, []) + o.token_ids
                reasons[o.index] = o.finish_reason or reasons.get(o.index)
        return texts, tokens, reasons

    async def main():
        return await by_index(held_engine, "held-n"), await by_index(engine, "each-n")

    held, each = asyncio.run(main())
    assert held == each and len(held[0]) == 3 and all(held[2].values())


async def _drain(stream):
    return [out async for out in stream]
