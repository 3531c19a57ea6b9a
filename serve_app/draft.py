"""`DraftModel`: a draft model served to every engine replica (speculative `placement: actor`),
and the engines' transport to it.

One replica holds one DraftWorker (engine.runner.speculation.draft_model): the draft model of the
engine's speculative_config (or the target's first layers for `self_draft`) with its own paged KV
cache, answering each engine step's DraftCall. Calls run one at a time (one model, one set of
cores). app.py makes it a deployment; `draft_transport` gives an engine replica the factory of its
ServeDraftTransport (the engine's DraftTransport protocol, engine/drafts.py).

The transport makes one call per engine step, carrying every speculating request's query, and
awaits the reply until the deadline. A late reply, a draft replica that is down or restarting, or
no replica yet: the step decodes without drafts, and the next step asks again, unless the late
call is still running (a call sent behind it would wait for it and be late too). In an engine
process of its own (not a Ray worker), the transport connects to the cluster at RAY_ADDRESS,
which `draft_transport` sets for it.
"""
from __future__ import annotations

import functools
import logging
import os
import threading
import time
from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.drafts import DraftCall, DraftReply, DraftTransportFactory

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentResponse, DeploymentResponseGenerator

logger = logging.getLogger(__name__)

DRAFT_DEPLOYMENT = "DraftModel"  # the deployment's name in its application
_WARN_EVERY_S = 30.0
_GIVE_UP_S = 10.0  # a late call still unanswered after this is taken for lost


class DraftModel:
    def __init__(self, engine_config: EngineConfig, num_threads: int | None = None):
        import torch

        from engine.runner.speculation.draft_model import load_draft_worker

        if num_threads is not None:  # process-wide: the draft forward is this process's work
            torch.set_num_threads(num_threads)
        spec, cache = engine_config.speculative, engine_config.cache
        if spec is None:
            raise ValueError("the draft deployment needs the engine's speculative config")
        self.worker = load_draft_worker(spec, engine_config.model, None, cache.block_size, cache.kv_cache_bytes)
        self._lock = threading.Lock()
        self.num_calls = 0

    def propose(self, call: DraftCall) -> DraftReply:
        with self._lock:
            self.num_calls += 1
            return self.worker.propose(call)

    def counters(self) -> dict[str, int]:
        return {"calls": self.num_calls, "sequences": self.worker.num_sequences}


class ServeDraftTransport:
    """An engine's DraftTransport to the DraftModel deployment of `app_name`."""

    def __init__(self, app_name: str, deadline_s: float):
        import ray
        from ray import serve

        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), log_to_driver=False,
                     logging_level=logging.WARNING)
        self.handle = serve.get_deployment_handle(DRAFT_DEPLOYMENT, app_name)
        # Called from the engine's step loop, a thread with no event loop: the handle routes on
        # Serve's own router thread even where the replica's handles route on its main loop
        # (serve_app.launch.SERVE_LOOP_ENV, inherited by an engine process).
        self.handle._init(_run_router_in_separate_loop=True)
        self.deadline_s = deadline_s
        self.num_missed = 0  # steps that got no drafts
        # the call that missed its deadline, and when it was sent, until it is done
        self._late: tuple[DeploymentResponse | DeploymentResponseGenerator, float] | None = None
        self._warned_at = -_WARN_EVERY_S

    def __call__(self, call: DraftCall) -> DraftReply | None:
        if self._late is not None:  # never queue a call behind a late one: it would be late too
            response, sent_at = self._late
            try:
                response.result(timeout_s=0)
            except TimeoutError:
                if time.monotonic() - sent_at < _GIVE_UP_S:
                    self._missed("the previous call is still running")
                    return None
                response.cancel()  # lost (e.g. with its replica): ask again
            except Exception:  # it failed; this call may find a replica
                logger.debug("a late draft call failed", exc_info=True)
            self._late = None
        response, sent_at = self.handle.propose.remote(call), time.monotonic()
        try:
            return response.result(timeout_s=self.deadline_s)
        except TimeoutError:
            self._late = response, sent_at
            self._missed(f"no reply within {self.deadline_s} s")
        except Exception as e:  # the draft replica failed or is gone
            self._missed(repr(e))
        return None

    def _missed(self, why: str) -> None:
        """Plain decoding this step."""
        self.num_missed += 1
        if time.monotonic() - self._warned_at >= _WARN_EVERY_S:
            self._warned_at = time.monotonic()
            logger.warning("draft proposals missed (%d steps so far): %s", self.num_missed, why)


def draft_transport(config: EngineConfig) -> DraftTransportFactory | None:
    """For an engine replica whose drafts come from the actor: the factory of its transport to
    this Serve application's DraftModel, with RAY_ADDRESS set for an engine process of its own
    to reach the cluster. None for every other engine."""
    spec = config.speculative
    if spec is None or spec.placement != "actor":
        return None
    import ray
    from ray import serve

    os.environ.setdefault("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
    return functools.partial(ServeDraftTransport, serve.get_replica_context().app_name, spec.deadline_s)
