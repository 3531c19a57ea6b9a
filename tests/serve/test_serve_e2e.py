"""Real Ray Serve (slow): one cluster per session; apps deployed with build_app.

- `fake` app: the fake engine behind real deployments (pinning router, handles, SSE via the
  proxy, openai client sync + async, metrics on the node's endpoint).
- `real` app: a tiny random Llama (word-level tokenizer) through engine.AsyncEngine; greedy
  text == engine.LLM.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from conftest import fake_serve_app, greedy_text, metrics_of_every_node, run_app
from fake_engine import FakeTokenizer

from serve_app.config import AppConfig

sys.path.insert(0, str(Path(__file__).parents[2]))
from benchmarks import serve_bench  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def fake_app(serve_cluster):
    with fake_serve_app(serve_cluster, "fake", {"engine": {"num_replicas": 2},
                                               "router": {"max_waiting_per_replica": 2},
                                               "slo": {2: {"ttft_s": 30.0}}},
                        step_delay_s=0.01, max_model_len=8192, num_blocks=4096) as url:
        yield url


def test_fake_app_openai_sync_and_stream(fake_app):
    client = openai.OpenAI(base_url=fake_app + "/v1", api_key="none")
    assert [m.id for m in client.models.list().data] == ["fake"]
    c = client.completions.create(model="fake", prompt="hello world", max_tokens=5, temperature=0)
    assert c.choices[0].text == greedy_text(FakeTokenizer().encode("hello world"), 5)
    parts = [ch.choices[0].text for ch in client.completions.create(
        model="fake", prompt="hello world", max_tokens=5, temperature=0, stream=True)]
    assert "".join(parts) == c.choices[0].text
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="fake", prompt="x", top_p=2)


def test_fake_app_concurrent_streams_spread_over_replicas(fake_app):
    async def go():
        client = openai.AsyncOpenAI(base_url=fake_app + "/v1", api_key="none")

        async def one(i):
            stream = await client.chat.completions.create(
                model="fake", messages=[{"role": "user", "content": f"q{i}"}], max_tokens=20,
                stream=True, stream_options={"include_usage": True})
            n, usage = 0, None
            async for ch in stream:
                n += sum(1 for c in ch.choices if c.delta.content)
                usage = ch.usage or usage
            return usage.completion_tokens

        return await asyncio.gather(*(one(i) for i in range(12)))

    assert asyncio.run(go()) == [20] * 12
    from ray import serve

    handle = serve.get_deployment_handle("EngineReplica", app_name="fake")
    counters = handle.broadcast("routing_counters").results()
    assert len(counters) == 2
    assert all(c["misrouted"] == 0 for c in counters), counters
    assert all(c["received"] > 0 for c in counters), counters  # both replicas used


def test_fake_app_client_disconnect_aborts_in_engine(fake_app):
    """1. start a 3000-token stream (~30 s at 10 ms/token); read a few events; disconnect.
    2. within a few seconds no replica's engine runs anything (the abort reached the engine)."""
    from ray import serve

    with httpx.Client(timeout=30) as client:
        with client.stream("POST", fake_app + "/v1/completions", json={
                "model": "fake", "prompt": "long", "max_tokens": 3000, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: ") for line in got)
    handle = serve.get_deployment_handle("EngineReplica", app_name="fake")
    deadline = time.time() + 10
    while time.time() < deadline:
        running = [s.num_running for s in handle.broadcast("stats").results()]
        if sum(running) == 0:
            break
        time.sleep(0.2)
    assert sum(running) == 0, running


def test_fake_app_metrics_on_node_endpoint(fake_app):
    client = openai.OpenAI(base_url=fake_app + "/v1", api_key="none")
    for _ in range(3):
        client.completions.create(model="fake", prompt="m", max_tokens=3, extra_body={"priority": 2})
    deadline = time.time() + 60
    want = ["ray_cbserve_ttft_s", "ray_cbserve_router_queue_depth", "ray_cbserve_replica_kv_usage",
            "ray_cbserve_generation_tokens_total", 'ray_cbserve_slo_requests_total{', "ray_cbserve_slo_attainment{",
            "ray_cbserve_goodput_rps{", "ray_cbserve_engine_info{", "ray_cbserve_model_weight_bytes_per_token{",
            "ray_cbserve_model_top1_agreement{", "ray_cbserve_model_perplexity_increase{",
            "ray_cbserve_model_requests_total{", "ray_cbserve_model_generation_tokens_total{",
            "ray_cbserve_model_ttft_s_count{", "ray_cbserve_engine_num_lora_loads{"]
    text = ""
    while time.time() < deadline:
        text = metrics_of_every_node()
        if all(w in text for w in want) and 'priority="2"' in text:
            break
        time.sleep(2)
    missing = [w for w in want if w not in text]
    assert not missing, (missing, [line for line in text.splitlines() if 'cbserve_router' in line][:20])
    assert 'priority="2"' in text
    by_model = [line for line in text.splitlines()
                if line.startswith("ray_cbserve_model_requests_total{") and 'application="fake"' in line]
    assert by_model and all('model="fake"' in line for line in by_model), by_model  # the served name, no adapter
    info = [line for line in text.splitlines() if line.startswith("ray_cbserve_engine_info{")]
    assert info and all('quantization="none"' in line and 'dtype="float32"' in line for line in info), info
    for prefix, deployment in (("ray_cbserve_ttft_s_count{", "EngineReplica"),
                               ("ray_cbserve_router_queue_depth{", "IngressRouter")):  # one ingress: the router in it
        lines = [line for line in text.splitlines() if line.startswith(prefix) and 'application="fake"' in line]
        assert lines and all(f'deployment="{deployment}"' in line for line in lines), (prefix, lines)


def test_fake_app_replica_killed_midstream_gets_error_event_then_served(fake_app):
    """1. start a long stream; find the replica running it and kill its actor.
    2. the client gets an SSE error event and [DONE], not a silently truncated body.
    3. new requests are served by the surviving replica (the router drops the dead one)."""
    import ray
    from ray import serve

    handle = serve.get_deployment_handle("EngineReplica", app_name="fake")
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", fake_app + "/v1/completions", json={
                "model": "fake", "prompt": "doomed", "max_tokens": 3000, "stream": True}) as r:
            lines = r.iter_lines()
            next(lines)
            busy = [s.replica_id for s in handle.broadcast("stats").results() if s.num_running]
            assert len(busy) == 1
            actor = next(a for a in ray.util.list_named_actors(all_namespaces=True)
                         if busy[0] in a["name"])
            ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]))
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert '"error"' in rest[-2] and "replica" in rest[-2]
        oai = openai.OpenAI(base_url=fake_app + "/v1", api_key="none", max_retries=0)
        for i in range(4):
            assert oai.completions.create(model="fake", prompt=f"after {i}", max_tokens=3).usage


# ------------------------------------------------------------ the real engine, tiny model


def _real_config(model: str) -> AppConfig:
    return AppConfig.model_validate({
        "engine": {"model": model, "served_model_name": "tiny", "num_replicas": 1,
                   "num_cpus": 0.5, "engine_args": {"max_num_seqs": 8, "seed": 0}},
    })


@pytest.fixture(scope="session")
def real_app(serve_cluster, tiny_llama_words):


    return run_app(_real_config(tiny_llama_words), "real")


@pytest.fixture(scope="session")
def offline_llm(tiny_llama_words):
    import engine

    return engine.LLM(model=tiny_llama_words, seed=0)


PROMPTS = ["the cat sat on", "dogs ran fast", "people sang songs about old ships"]


def test_real_greedy_equals_offline_generate(real_app, offline_llm):
    import engine

    params = engine.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = [o.outputs[0].text for o in offline_llm.generate(PROMPTS, params, use_tqdm=False)]
    client = openai.OpenAI(base_url=real_app + "/v1", api_key="none")
    for prompt, want in zip(PROMPTS, expected):
        c = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert c.choices[0].text == want
        assert c.usage.completion_tokens == 12
        assert c.usage.prompt_tokens == len(offline_llm.tokenizer.encode(prompt))
        streamed = "".join(ch.choices[0].text for ch in client.completions.create(
            model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True,
            extra_body={"ignore_eos": True}))
        assert streamed == want


def test_real_chat_equals_offline_chat(real_app, offline_llm):
    import engine

    messages = [{"role": "user", "content": "blue lakes"}]
    params = engine.SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    want = offline_llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
    client = openai.OpenAI(base_url=real_app + "/v1", api_key="none")
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == want
    parts = [ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True,
        extra_body={"ignore_eos": True}) if ch.choices]
    assert "".join(parts) == want


def test_the_served_engines_steps_are_counted_by_kind(real_app, tiny_llama_words):
    """One request alone: its prompt's step, then a decode-only step a token, as serve_bench reads
    them from every engine replica of the app (`engine_stats`)."""
    cfg = _real_config(tiny_llama_words)
    before = serve_bench.served_step_figures(cfg, app="real")
    client = openai.OpenAI(base_url=real_app + "/v1", api_key="none")
    client.completions.create(model="tiny", prompt="the cat sat on", max_tokens=12, temperature=0,
                              extra_body={"ignore_eos": True})
    deadline = time.monotonic() + 10  # the engine's snapshot comes with its outputs, once an interval
    while True:
        steps = serve_bench.steps_between(before, serve_bench.served_step_figures(cfg, app="real"))
        if steps["num_steps"] >= 12 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert (steps["num_steps"], steps["num_decode_only_steps"], steps["decode_only_rows"]) == (12, 11, 11)
    assert steps["decode_only_steps_s"] > 0 and steps["mixed_steps_s"] > 0


def test_real_n_seed_stop_and_errors(real_app, offline_llm):
    client = openai.OpenAI(base_url=real_app + "/v1", api_key="none")
    kw = dict(model="tiny", prompt="green hills", max_tokens=6, n=2, seed=11, temperature=1.0,
              extra_body={"ignore_eos": True})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.usage.completion_tokens == 12
    greedy = client.completions.create(model="tiny", prompt="green hills", max_tokens=8,
                                       temperature=0, extra_body={"ignore_eos": True})
    words = greedy.choices[0].text.split()
    stop = words[len(words) // 2]
    s = client.completions.create(model="tiny", prompt="green hills", max_tokens=8, temperature=0,
                                  stop=[stop], extra_body={"ignore_eos": True})
    assert stop not in s.choices[0].text and s.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model="tiny", prompt="the " * 600, max_tokens=4)
    ok = client.completions.create(model="tiny", prompt="the cat", max_tokens=2)
    assert ok.choices[0].finish_reason in ("length", "stop")


@pytest.fixture(scope="session")
def two_model_app(serve_cluster, tmp_path_factory):
    """The embedded model (its default mode) and a tiny random Qwen3 in one app: an EngineReplica
    deployment each, one ingress and router."""
    from ray import serve

    from tests.conftest import save_tiny_chat_model

    qwen3 = save_tiny_chat_model(tmp_path_factory.mktemp("qwen3-served"), "qwen3")
    args = {"max_num_seqs": 8, "seed": 0}
    cfg = AppConfig.model_validate({"models": [
        {"num_cpus": 0.1, "engine_args": args},
        {"model": qwen3, "served_model_name": "qwen3-tiny", "num_cpus": 0.1,
         "engine_args": {**args, "max_model_len": 1024}}]})
    url = run_app(cfg, "models")
    serve_bench.wait_healthy(url, 300)
    yield url, qwen3
    serve.delete("models")


def test_two_models_in_one_app_through_the_openai_client(two_model_app):
    """Each model answers its own requests as the offline engine does (greedy, token for token);
    /v1/models lists both; an unknown model is a 404; the router's and replicas' series carry the
    model's name."""
    import engine

    url, qwen3 = two_model_app
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct", "qwen3-tiny"]
    messages = [{"role": "user", "content": "Name a colour."}]
    for model, path in (("SmolLM2-135M-Instruct", None), ("qwen3-tiny", qwen3)):
        offline = engine.LLM(model=path, seed=0, max_model_len=1024)
        want = offline.chat(messages, engine.SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
        got = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
        assert got.model == model
        assert got.choices[0].message.content == want[0].outputs[0].text
        del offline
    with pytest.raises(openai.NotFoundError, match="qwen3-tiny"):
        client.completions.create(model="gpt-4o", prompt="hi", max_tokens=2)
    deadline, lines = time.time() + 120, []  # a bound: Ray exports a new replica's series within seconds
    while time.time() < deadline:
        text = metrics_of_every_node()
        lines = [line for line in text.splitlines() if 'application="models"' in line
                 and line.startswith(("ray_cbserve_router_dispatched_total{", "ray_cbserve_ttft_s_count{"))]
        if {m for m in ("SmolLM2-135M-Instruct", "qwen3-tiny") for line in lines if f'model="{m}"' in line} == {
                "SmolLM2-135M-Instruct", "qwen3-tiny"} and len({line.split("{")[0] for line in lines}) == 2:
            break
        time.sleep(2)
    for prefix in ("ray_cbserve_router_dispatched_total{", "ray_cbserve_ttft_s_count{"):
        for model in ("SmolLM2-135M-Instruct", "qwen3-tiny"):
            assert any(line.startswith(prefix) and f'model="{model}"' in line for line in lines), (prefix, model, lines)


def test_vllms_extensions_and_a_conversation_sent_back_whole_through_ray_serve(real_app, offline_llm):
    """The request fields a client written for vLLM sends, through the deployments: the prompt's
    ids and logprobs and each output's ids come back, a stop string is kept, and an answer sent
    back as it came (with keys of the client's own) is continued."""
    client = openai.OpenAI(base_url=real_app + "/v1", api_key="none")
    prompt_ids = offline_llm.tokenizer.encode("the cat sat on")
    out = client.completions.create(model="tiny", prompt="the cat sat on", max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True, "prompt_logprobs": 1})
    choice = out.choices[0].model_extra
    assert choice["prompt_token_ids"] == prompt_ids and len(choice["token_ids"]) == 6
    assert choice["prompt_logprobs"][0] is None and all(str(t) in entries for t, entries in
                                                        zip(prompt_ids[1:], choice["prompt_logprobs"][1:]))
    word = out.choices[0].text.split()[1]
    kept = client.completions.create(model="tiny", prompt="the cat sat on", max_tokens=6, temperature=0, stop=[word],
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text.endswith(word) and kept.choices[0].model_extra["stop_reason"] == word
    first = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "blue lakes"}],
                                           max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    answer = first.choices[0].message.model_dump() | {"refusal": None, "annotations": [], "id": "kept"}
    continued = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "blue lakes"}, answer], max_tokens=3, temperature=0,
        extra_body={"ignore_eos": True, "echo": True, "add_generation_prompt": False,
                    "continue_final_message": True})
    assert continued.choices[0].message.content.startswith(first.choices[0].message.content)
