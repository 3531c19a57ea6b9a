"""Real Ray Serve, real engine (slow): speculative drafts from the DraftModel deployment
(`placement: actor`). The engine replica (its step loop in a child process) calls the draft
replica once per step; outputs are the target's greedy tokens. The draft replica is killed
mid-run: requests complete unchanged on plain steps, and speculation resumes once Serve has
replaced it."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from conftest import STARTUP_BOUND_S, run_app, wait_healthy

from engine import LLM, SamplingParams
from tests.engine.helpers import save_first_layer

pytestmark = pytest.mark.slow

APP = "drafts"
PROMPTS = ["the cat sat on a mat the cat sat on a mat the cat", "dogs ran fast over green hills and dogs ran",
           "blue lakes under bright stars blue lakes under", "people sang songs about old ships sailing far"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def draft_app(serve_cluster, tiny_llama, tmp_path_factory):
    from ray import serve

    from serve_app.config import AppConfig

    draft = save_first_layer(tiny_llama, tmp_path_factory.mktemp("actor-draft"))
    cfg = AppConfig.model_validate({
        "engine": {"model": tiny_llama, "served_model_name": "tiny", "num_cpus": 0.5, "stream_flush_interval_s": 0.0,
                   "engine_args": {"max_num_seqs": 8, "speculative_config": {
                       "method": "draft_model", "model": draft, "placement": "actor", "num_speculative_tokens": 3,
                       "adaptive": False, "deadline_s": 1.0}},
                   "draft": {"num_cpus": 0.25, "num_threads": 1}},
    })
    url = run_app(cfg, APP)
    wait_healthy(url, STARTUP_BOUND_S)
    yield url
    serve.delete(APP)


@pytest.fixture(scope="module")
def expected(tiny_llama) -> list[str]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return [o.outputs[0].text for o in LLM(tiny_llama).generate(PROMPTS, params, use_tqdm=False)]


async def _complete_all(url: str) -> list[str]:
    async with httpx.AsyncClient(timeout=120) as client:
        responses = await asyncio.gather(*(client.post(url + "/v1/completions", json={
            "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}) for p in PROMPTS))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    return [r.json()["choices"][0]["text"] for r in responses]


def _draft_counters() -> dict[str, int]:
    from ray import serve

    return serve.get_deployment_handle("DraftModel", APP).counters.remote().result(timeout_s=30)


def _draft_actor():
    import ray

    prefix = f"SERVE_REPLICA::{APP}#DraftModel#"
    (name,) = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
    return ray.get_actor(name, namespace="serve")


def test_drafts_from_the_actor_and_a_draft_replica_killed_mid_run(draft_app, expected):
    import ray

    assert asyncio.run(_complete_all(draft_app)) == expected
    before = _draft_counters()
    assert before["calls"] > 0  # the engine replica's step loop called the draft replica

    ray.kill(_draft_actor(), no_restart=True)
    t0 = time.monotonic()
    assert asyncio.run(_complete_all(draft_app)) == expected  # plain steps while the draft is down
    assert time.monotonic() - t0 < 60

    deadline, last_error = time.monotonic() + 120, None
    while True:  # Serve replaces the draft replica; the engine finds it by name and speculates again
        assert asyncio.run(_complete_all(draft_app)) == expected
        try:
            if _draft_counters()["calls"] > 0:
                break
        except ray.exceptions.RayError as e:  # no draft replica up yet
            last_error = e
        assert time.monotonic() < deadline, f"speculation did not resume on a new draft replica ({last_error!r})"
        time.sleep(1)
