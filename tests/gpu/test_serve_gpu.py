"""The serve app with one engine replica on the GPU (marked `gpu`), through Serve's HTTP proxy:
the replica holds the GPU, and greedy text over HTTP (bfloat16, flash attention: the CUDA
defaults) equals the offline engine's on CUDA."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.conftest import run_app, save_tiny_model

pytestmark = pytest.mark.gpu

PROMPTS = ["the cat sat on", "dogs ran fast", "people sang songs about old ships"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_tiny_model(tmp_path_factory.mktemp("gpu-llama-words"), "llama", tokenizer="words", hidden_size=256,
                           intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def gpu_app(serve_cluster, model_dir):
    from ray import serve

    from serve_app.config import AppConfig

    cfg = AppConfig.model_validate({"engine": {
        "model": model_dir, "served_model_name": "tiny", "num_replicas": 1, "num_cpus": 1, "num_gpus": 1,
        "engine_args": {"device": "cuda", "max_num_seqs": 8, "seed": 0}}})
    yield run_app(cfg, "gpu")
    serve.delete("gpu")


def test_gpu_replica_serves_greedy_text_equal_to_offline(gpu_app, model_dir):
    import ray

    import engine

    assert ray.cluster_resources().get("GPU") == 1
    assert ray.available_resources().get("GPU", 0) == 0  # the one replica holds the GPU

    offline = engine.LLM(model=model_dir, device="cuda", seed=0)
    params = engine.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    # one prompt at a time, as the requests below run: in bfloat16 a batch's shape may move a near tie
    expected = [offline.generate([p], params, use_tqdm=False)[0].outputs[0].text for p in PROMPTS]
    url = gpu_app + "/v1/completions"
    for prompt, want in zip(PROMPTS, expected):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        c = httpx.post(url, json=body, timeout=60).json()
        assert c["choices"][0]["text"] == want, c
        streamed = httpx.post(url, json=body | {"stream": True}, timeout=60).text
        events = [json.loads(line[6:]) for line in streamed.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == want
        assert streamed.rstrip().endswith("data: [DONE]")
    sampled = httpx.post(gpu_app + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "blue lakes"}], "max_tokens": 8,
        "temperature": 1.0, "seed": 3}).json()
    assert sampled["usage"]["completion_tokens"] >= 1, sampled
    assert sampled["choices"][0]["finish_reason"] in ("length", "stop")
