"""The engine/serve seam: each rule the two sides share has one home, and these tests hold the
two sides to it (ranking, aging across the hop, prefix hashes, one tokenization per prompt)."""

from __future__ import annotations

import asyncio
import random

import pytest
from conftest import admit_alone, local_stack, run
from fake_engine import FakeTokenizer

from engine.chat_output import ChatOutputFormat
from engine.config import EngineConfig
from engine.kv_cache.manager import KVCacheManager
from engine.llm_engine import LLMEngine
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler.queue import WaitingQueue
from serve_app.admission_queue import AdmissionQueue
from serve_app.api.completions import CompletionRequest
from serve_app.config import EngineReplicaConfig, RouterConfig
from serve_app.jobs import Sampling, Target, make_job
from serve_app.messages import AdmitRequest, ModelInfo, ReplicaStats
from serve_app.router import Router
from serve_app.served_model import ServedModel


@pytest.mark.parametrize("policy", ["fcfs", "sjf", "priority"])
def test_router_and_engine_queues_rank_the_same_requests_in_the_same_order(policy):
    """300 requests with random classes, prompt and output lengths and arrival times (ties
    included) go into the router's admission queue and an engine's waiting queue: both give
    them back in one order."""
    rng = random.Random(7)
    router_q = AdmissionQueue(RouterConfig(policy=policy, aging_rate=0.5, max_queued_requests=10**6,
                                           max_queued_tokens=10**9))
    engine_q = WaitingQueue(policy, aging_rate=0.5)
    for i in range(300):
        priority, prompt, max_tokens = rng.randint(0, 9), rng.randint(1, 500), rng.randint(1, 300)
        arrival = float(rng.randint(0, 60))
        router_q.push(AdmitRequest(f"r{i}", "m", priority, prompt, max_tokens), arrival)
        engine_q.add(Request(f"r{i}", [1] * prompt, SamplingParams(max_tokens=max_tokens), priority=priority,
                             arrival_time=arrival))
    router_order, engine_order = [], []
    while (entry := router_q.peek()) is not None:
        router_order.append(router_q.remove(entry.request.request_id).request.request_id)
    while (request := engine_q.pop()) is not None:
        engine_order.append(request.request_id)
    assert router_order == engine_order and len(set(router_order)) == 300


class _Clock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_requests_aged_rank_is_continuous_from_router_to_engine(tiny_llama):
    """A priority-9 request waits 4 s in the router (aging 1 class/s): its aged rank there is
    9 - 4 = 5. The engine, on another clock, gets the router's wait and ranks it 5 at once, not
    9: behind a priority-4 request that arrives with it, ahead of a priority-6 one."""
    async def admitted_after_wait() -> float:
        clock = _Clock(100.0)
        router = Router(RouterConfig(policy="priority", aging_rate=1.0), clock=clock)
        router._tick_task.cancel()
        waiting = asyncio.ensure_future(admit_alone(router, AdmitRequest("old", "m", 9, 4, 4)))
        await asyncio.sleep(0)
        clock.now += 4.0
        await router.report(ReplicaStats("r0", "m", True, 0, 0, 1, 64, 64, 0.0, 0, 16, (), (), 0.0))
        return (await waiting).queue_wait_s

    waited = run(admitted_after_wait())
    assert waited == pytest.approx(4.0)
    engine_clock = _Clock(5_000.0)
    config = EngineConfig.from_kwargs(model=tiny_llama, policy="priority", aging_rate=1.0, max_num_seqs=1)
    engine = LLMEngine(config, clock=engine_clock)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    engine.add_request("busy", [5, 6, 7], params, priority=0)  # takes the one slot
    engine.step()
    engine.add_request("p6", [5, 6, 7], params, priority=6)
    engine.add_request("old", [5, 6, 7], params, priority=9, waited_s=waited)
    engine.add_request("p4", [5, 6, 7], params, priority=4)
    waiting = engine.scheduler.waiting
    aged = {r.request_id: waiting.key(r) - engine_clock.now for r in waiting.requests()}
    assert aged["old"] == pytest.approx(9 - 4.0)
    order = []
    while (r := waiting.pop()) is not None:
        order.append(r.request_id)
    assert order == ["p4", "old", "p6"]


class _KnowsInfo:
    """An engine replica as far as the model's info goes."""

    def __init__(self, info: ModelInfo):
        self.info = info

    async def model_info(self) -> ModelInfo:
        return self.info


def test_the_routers_prefix_hashes_are_the_engines_block_hashes():
    """The prefix hashes the ingress sends to the router for a prompt are the hashes under which
    an engine's KV cache stores that prompt's full blocks."""
    block_size, prompt = 4, [random.Random(3).randrange(1, 1000) for _ in range(23)]
    info = ModelInfo("m", max_model_len=256, block_size=block_size, vocab_size=1000, hidden_size=8, tokenizer=None,
                     chat_format=ChatOutputFormat(None, "hermes"))
    model = ServedModel(EngineReplicaConfig(served_model_name="m"), _KnowsInfo(info))
    run(model.load_info())
    job = make_job("j", prompt, Target(model, (None, None), 0), Sampling(CompletionRequest(prompt=prompt), 4, 16), 0)
    kv = KVCacheManager(num_blocks=16, block_size=block_size, enable_prefix_caching=True)
    request = Request("j", prompt, SamplingParams(max_tokens=4))
    kv.allocate_slots(request, len(prompt))
    request.num_computed_tokens = len(prompt)
    kv.cache_full_blocks(request)
    table = kv.block_tables["j"][0]
    engine_hashes = [kv.pool.block_hash[table[i]] for i in range(len(prompt) // block_size)]
    assert list(job.admit.prefix_hashes) == engine_hashes and len(engine_hashes) == 5


def test_a_chat_request_is_templated_and_tokenized_once_and_reaches_the_engine_as_token_ids(monkeypatch):
    calls = {"template": 0, "encode": 0}
    template, encode = FakeTokenizer.apply_chat_template, FakeTokenizer.encode

    def counted_template(self, *args, **kwargs):
        calls["template"] += 1
        return template(self, *args, **kwargs)

    def counted_encode(self, *args, **kwargs):
        calls["encode"] += 1
        return encode(self, *args, **kwargs)

    monkeypatch.setattr(FakeTokenizer, "apply_chat_template", counted_template)
    monkeypatch.setattr(FakeTokenizer, "encode", counted_encode)

    async def go():
        async with local_stack() as (client, _, replicas):
            engine = replicas[0].engine
            prompts = []
            generate = engine.generate

            def recording(prompt, *args, **kwargs):
                prompts.append(prompt)
                return generate(prompt, *args, **kwargs)

            engine.generate = recording
            r = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 3})
            assert r.status_code == 200, r.text
            assert calls["template"] == 1 and calls["encode"] == 1  # the template's own encode
            calls.update(template=0, encode=0)
            r = await client.post("/v1/completions", json={"prompt": "plain text", "max_tokens": 3})
            assert r.status_code == 200, r.text
            assert calls == {"template": 0, "encode": 1}
            assert all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompts)
            assert len(prompts) == 2

    run(go())
