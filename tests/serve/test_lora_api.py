"""LoRA adapters through the OpenAI API (the official openai client) on the real engine (a tiny
random Llama with PEFT adapters made here): `model` as `base:adapter` or the adapter's own name
gives the adapter's greedy output (the offline engine's with it); /v1/models lists the base and
its adapters; an unknown adapter is a 404 in OpenAI's shape; /v1/load_lora_adapter and
/v1/unload_lora_adapter behind the API key; requests of several adapters at once each get their
own adapter's output; the router prefers the replica already holding a request's adapter."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from conftest import served_real_engine

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from serve_app.config import RouterConfig
from serve_app.messages import AdmitRequest, ReplicaStats
from serve_app.replica_pool import ReplicaPool
from tests.engine.test_lora import make_adapter

PROMPT = [5, 17, 33, 8, 2, 41, 9]


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("served-lora")
    return {name: make_adapter(tiny_llama, root / name, seed) for seed, name in enumerate(["sql", "poet", "late"])}


@pytest.fixture(scope="module")
def served(tiny_llama, adapters):
    engine_args = {"enable_lora": True, "lora_modules": [f"{n}={adapters[n]}" for n in ("sql", "poet")]}
    with served_real_engine(tiny_llama, 256, engine={"engine_args": engine_args},
                            ingress={"api_keys": [{"key": "k1"}]}) as url:
        yield url


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served + "/v1", api_key="k1")


@pytest.fixture(scope="module")
def offline(tiny_llama, adapters):
    llm = LLM(tiny_llama, enable_lora=True, lora_modules=[f"{n}={p}" for n, p in adapters.items()])

    def text(lora: str | None) -> str:
        return llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
                            use_tqdm=False, lora=lora)[0].outputs[0].text
    return text


def _text(client, model: str) -> str:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=0,
                                    extra_body={"ignore_eos": True})
    return out.choices[0].text


def test_model_names_an_adapter_as_base_colon_adapter_or_by_its_own_name(client, offline):
    assert _text(client, "tiny:sql") == offline("sql")
    assert _text(client, "poet") == offline("poet")
    assert _text(client, "tiny") == offline(None) != offline("sql")
    listed = {m.id: m for m in client.models.list().data}
    assert set(listed) == {"tiny", "sql", "poet"}
    assert listed["sql"].parent == "tiny" and listed["tiny"].parent is None


def test_an_unknown_adapter_is_a_404_and_the_server_goes_on(client, offline):
    with pytest.raises(openai.NotFoundError) as raised:
        client.completions.create(model="tiny:nope", prompt=PROMPT, max_tokens=4)
    assert raised.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    assert _text(client, "sql") == offline("sql")


def test_adapters_load_and_unload_at_run_time_behind_the_key(served, client, adapters, offline):
    body = {"lora_name": "late", "lora_path": adapters["late"]}
    assert httpx.post(served + "/v1/load_lora_adapter", json=body).status_code == 401
    bad = httpx.post(served + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nowhere"},
                     headers={"Authorization": "Bearer k1"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
    loaded = httpx.post(served + "/v1/load_lora_adapter", json=body, headers={"Authorization": "Bearer k1"})
    assert loaded.status_code == 200, loaded.text
    assert _text(client, "late") == offline("late")
    assert "late" in {m.id for m in client.models.list().data}
    gone = httpx.post(served + "/v1/unload_lora_adapter", json={"lora_name": "late"},
                      headers={"Authorization": "Bearer k1"})
    assert gone.status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="late", prompt=PROMPT, max_tokens=4)
    again = httpx.post(served + "/v1/unload_lora_adapter", json={"lora_name": "late"},
                       headers={"Authorization": "Bearer k1"})
    assert again.status_code == 404


def test_concurrent_requests_of_several_adapters_each_get_their_own(served, offline):
    async def all_at_once():
        async with openai.AsyncOpenAI(base_url=served + "/v1", api_key="k1") as aclient:
            async def one(model):
                out = await aclient.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=0,
                                                       extra_body={"ignore_eos": True})
                return out.choices[0].text
            return await asyncio.gather(*(one(m) for m in ["sql", "tiny", "poet", "tiny:sql", "poet", "tiny"]))
    got = asyncio.run(all_at_once())
    assert got == [offline(n) for n in ["sql", None, "poet", "sql", "poet", None]]


def _stats(replica_id: str, running: int, adapters: tuple[str, ...]) -> ReplicaStats:
    return ReplicaStats(replica_id, "m", True, 0, running, 8, 100, 100, 0.0, 0, 16, (), (), 0.0, adapters)


def test_the_router_prefers_a_replica_holding_the_adapter_within_its_load_slack():
    """Among replicas whose loads tie (within affinity_load_slack) the one holding the adapter
    wins; a holder loaded past the slack does not: the request goes to the lighter replica, which
    is then known to have it."""
    pool = ReplicaPool(RouterConfig(affinity_load_slack=0.05))
    pool.report(_stats("r0", 1, ()), 0.0)
    pool.report(_stats("r1", 1, ("sql",)), 0.0)
    assert pool.choose(AdmitRequest("q1", "m", 0, 8, 8, adapter="sql")) == "r1"
    assert pool.choose(AdmitRequest("q2", "m", 0, 8, 8, adapter="poet")) == "r0"  # no holder: least loaded, then id
    busy = ReplicaStats("r1", "m", True, 0, 4, 8, 60, 100, 0.4, 0, 16, (), (), 0.0, ("sql",))
    pool.report(busy, 1.0)
    assert pool.choose(AdmitRequest("q3", "m", 0, 8, 8, adapter="sql")) == "r0"
    pool.assign("r0", AdmitRequest("q3", "m", 0, 8, 8, adapter="sql"), 1.0)
    assert "sql" in pool.views["r0"].adapters


def test_an_adapter_the_engine_cannot_find_is_a_404():
    """A name the ingress passes on (one adapter_dirs may hold) that no directory has: the engine's
    AdapterNotFoundError answers as OpenAI's model_not_found 404."""
    from engine.errors import AdapterNotFoundError
    from serve_app.replica import error_info

    info = error_info(AdapterNotFoundError("model", "adapter 'x' does not exist", "model_not_found"))
    assert (info.status, info.code, info.param) == (404, "model_not_found", "model")
