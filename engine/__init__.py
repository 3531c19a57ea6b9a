"""cbserve engine: continuous batching over a paged KV cache.

Exports resolve lazily, so the torch-free parts (SamplingParams, outputs, errors, the client
contract) import without loading torch: the serve app's ingress and router rely on that.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "engine.llm",
    "LLMEngine": "engine.llm_engine",
    "AsyncEngine": "engine.async_engine",
    "SamplingParams": "engine.sampling_params",
    "PoolingParams": "engine.sampling_params",
    "EngineConfig": "engine.config",
    "ModelConfig": "engine.config",
    "CacheConfig": "engine.config",
    "SchedulerConfig": "engine.config",
    "EngineStats": "engine.metrics",
    "RequestOutput": "engine.outputs",
    "CompletionOutput": "engine.outputs",
    "RequestMetrics": "engine.outputs",
    "EngineClient": "engine.client",
    "InvalidRequestError": "engine.errors",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
