"""The CUDA settings (graph sizes and memory, gpu_memory_utilization, the triton backend) are
validated and reach the engine from every front door on any host; the CPU keeps its fixed pool
and runs no graphs. What they do on a GPU: tests/gpu."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, llm_engine
from engine.attention.base import AttentionParams
from engine.attention.selector import kv_block_bytes, select_backend
from engine.cli import main as cli_main
from engine.config import DEFAULT_KV_CACHE_BYTES, CacheConfig, EngineConfig, ModelConfig
from engine.runner.cuda_graphs import default_sizes
from serve_app.config import AppConfig


def test_graph_buckets_follow_max_num_seqs():
    assert default_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert default_sizes(3) == [1, 2, 3]
    assert default_sizes(20) == [1, 2, 4, 8, 16, 20]  # max_num_seqs itself, so a full batch replays
    assert default_sizes(4096)[-1] == 512


def test_bad_cuda_settings_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="cuda_graph_sizes must be batch sizes >= 1"):
        ModelConfig(cuda_graph_sizes=[0, 8])
    with pytest.raises(ValueError, match="cuda_graph_sizes must be batch sizes >= 1"):
        ModelConfig(cuda_graph_sizes=[])
    with pytest.raises(ValueError, match="cuda_graph_memory_bytes must be >= 0"):
        ModelConfig(cuda_graph_memory_bytes=-1)
    for fraction in (0.0, 1.5):
        with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
            CacheConfig(gpu_memory_utilization=fraction)
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        ModelConfig(attention_backend="flashinfer")
    with pytest.raises(ValueError, match="'triton' needs a CUDA device"):
        select_backend("triton", torch.device("cpu"), torch.bfloat16, AttentionParams(0.125))


def test_the_settings_reach_the_engine_from_the_cli_and_the_serve_config(monkeypatch):
    seen = {}
    monkeypatch.setattr("engine.cli.LLM", lambda **kwargs: seen.update(kwargs) or (_ for _ in ()).throw(SystemExit))
    with pytest.raises(SystemExit):
        cli_main(["generate", "--prompt", "x", "--cuda-graph-sizes", "1,2,8", "--gpu-memory-utilization", "0.8",
                  "--enforce-eager"])
    assert (seen["cuda_graph_sizes"], seen["gpu_memory_utilization"], seen["enforce_eager"]) == ([1, 2, 8], 0.8, True)
    app = AppConfig.model_validate({"engine": {"engine_args": {
        "device": "cuda", "cuda_graph_sizes": [1, 8], "gpu_memory_utilization": 0.8, "cuda_graph_memory_bytes": 0}}})
    config = app.engine.engine_config
    assert (config.model.cuda_graph_sizes, config.model.cuda_graph_memory_bytes) == ([1, 8], 0)
    assert config.cache.gpu_memory_utilization == 0.8
    assert EngineConfig.from_kwargs().cache.kv_cache_memory_bytes is None


def test_on_the_cpu_the_pool_is_a_fixed_budget_and_no_graphs_run(tiny_llama):
    engine = LLM(tiny_llama, max_num_seqs=4096).engine  # the cap (4096 requests) does not bind
    model = engine.loaded.model
    block_bytes = kv_block_bytes(model, 16, engine.runner.kv_cache.dtype)
    assert engine.kv.pool.num_blocks == DEFAULT_KV_CACHE_BYTES // block_bytes
    assert engine.runner.graphs is None
    assert engine.runner.kv_cache.shape[engine.runner.backend.block_dim()] == engine.kv.pool.num_blocks  # no sink
    assert CacheConfig(kv_cache_memory_bytes=1 << 20).kv_cache_bytes == 1 << 20


def test_on_the_cpu_the_pool_may_take_a_fraction_of_the_memory_the_weights_left(tiny_llama, monkeypatch, caplog):
    """cpu_memory_utilization: that share of MemAvailable, read once the model is loaded (set here, as a
    host with 8 GiB free would report it), capped where max_num_seqs requests could never fill it;
    reported at start. Its flag reaches the engine."""
    monkeypatch.setattr(llm_engine, "host_memory_available", lambda: 8 << 30)
    with caplog.at_level("INFO"):
        engine = LLM(tiny_llama, max_num_seqs=4096, cpu_memory_utilization=0.05).engine
    block_bytes = kv_block_bytes(engine.loaded.model, 16, engine.runner.kv_cache.dtype)
    pool_bytes = int(0.05 * (8 << 30))
    assert engine.kv.pool.num_blocks == pool_bytes // block_bytes
    assert f"(of {pool_bytes / 2**30:.2f} GiB available)" in caplog.text
    capped = LLM(tiny_llama, max_num_seqs=2, cpu_memory_utilization=0.05).engine
    assert capped.kv.pool.num_blocks < pool_bytes // block_bytes
    assert llm_engine.host_memory_available() > 0  # the real /proc/meminfo reading
    with pytest.raises(ValueError, match="cpu_memory_utilization"):
        CacheConfig(cpu_memory_utilization=1.5)
    seen = {}
    monkeypatch.setattr("engine.cli.LLM", lambda **kwargs: seen.update(kwargs) or (_ for _ in ()).throw(SystemExit))
    with pytest.raises(SystemExit):
        cli_main(["generate", "--prompt", "x", "--cpu-memory-utilization", "0.3"])
    assert seen["cpu_memory_utilization"] == 0.3
