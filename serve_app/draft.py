"""`DraftModel`: a draft model served to every engine replica (speculative `placement: actor`).

One replica holds one DraftWorker (engine.spec_decode.draft_model): the draft model of the
engine's speculative_config (or the target's first layers for `self_draft`) with its own paged KV
cache, answering each engine step's DraftCall. Calls run one at a time (one model, one set of
cores); an engine replica that waits past its deadline decodes that step without drafts. app.py
makes it a deployment; `bind_draft_app` points an engine at it.
"""
from __future__ import annotations

import dataclasses
import os
import threading

from engine.config import EngineConfig
from engine.spec_decode.messages import DraftCall, DraftReply


class DraftModel:
    def __init__(self, engine_config: EngineConfig, num_threads: int | None = None):
        import torch

        from engine.spec_decode.draft_model import load_draft_worker

        if num_threads is not None:  # process-wide: the draft forward is this process's work
            torch.set_num_threads(num_threads)
        spec, cache = engine_config.speculative, engine_config.cache
        self.worker = load_draft_worker(spec, engine_config.model, None, cache.block_size, cache.kv_cache_memory_bytes)
        self._lock = threading.Lock()
        self.num_calls = 0

    def propose(self, call: DraftCall) -> DraftReply:
        with self._lock:
            self.num_calls += 1
            return self.worker.propose(call)

    def counters(self) -> dict[str, int]:
        return {"calls": self.num_calls, "sequences": self.worker.num_sequences}


def bind_draft_app(config: EngineConfig) -> EngineConfig:
    """The engine config with its actor-placed drafts pointed at this Serve application's
    DraftModel, and RAY_ADDRESS set for an engine process of its own to reach the cluster."""
    spec = config.speculative
    if spec is None or spec.placement != "actor" or spec.draft_app is not None:
        return config
    import ray
    from ray import serve

    os.environ.setdefault("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
    app_name = serve.get_replica_context().app_name
    return dataclasses.replace(config, speculative=dataclasses.replace(spec, draft_app=app_name))
