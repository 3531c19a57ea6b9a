"""Serve-side metrics (prefix `cbserve_`), exported through `ray.util.metrics`.

Owns: metric names, tags and the two recorder classes the router and replicas call.
Does not own: engine-internal metrics (the engine exports its own). Recorders are created with
`enabled=False` outside Ray (unit tests, local app) and then do nothing. Every series carries the
Serve `application` and `deployment` it comes from, as Ray Serve's own metrics name them.

On a node's metrics endpoint the names appear prefixed `ray_` (counters suffixed `_total`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.metrics import ModelReport

_LATENCY_BOUNDARIES = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]


class _Null:
    def set(self, *a: Any, **k: Any) -> None: ...
    def observe(self, *a: Any, **k: Any) -> None: ...
    def inc(self, *a: Any, **k: Any) -> None: ...


def _deployment_tags() -> dict[str, str]:
    """The calling Serve replica's application and deployment ('' outside a replica)."""
    from ray import serve

    try:
        deployment = serve.get_replica_context().replica_id.deployment_id
    except Exception:
        return {"application": "", "deployment": ""}
    return {"application": deployment.app_name, "deployment": deployment.name}


def _make(enabled: bool):
    if not enabled:
        return (lambda *a, **k: _Null(),) * 3
    from ray.util.metrics import Counter, Gauge, Histogram

    defaults = _deployment_tags()

    def tagged(metric):
        metric.set_default_tags(defaults)
        return metric

    def gauge(name: str, desc: str, tags: tuple[str, ...]):
        return tagged(Gauge(name, description=desc, tag_keys=(*defaults, *tags)))

    def hist(name: str, desc: str, tags: tuple[str, ...]):
        return tagged(Histogram(name, description=desc, boundaries=_LATENCY_BOUNDARIES,
                                tag_keys=(*defaults, *tags)))

    def counter(name: str, desc: str, tags: tuple[str, ...]):
        return tagged(Counter(name, description=desc, tag_keys=(*defaults, *tags)))

    return gauge, hist, counter


_BY_REPLICA = ("replica", "model")  # the tags of every replica series


class RouterMetrics:
    """Per model: queue depth per priority class, admission wait, rejections, dispatches per replica,
    live replicas."""

    def __init__(self, enabled: bool):
        gauge, hist, counter = _make(enabled)
        self.queue_depth = gauge(
            "cbserve_router_queue_depth", "Requests in a model's admission queue.", ("model", "priority")
        )
        self.admission_wait = hist(
            "cbserve_router_admission_wait_s", "Time from arrival at the router to dispatch.", ("model", "priority")
        )
        self.rejections = counter(
            "cbserve_router_rejections", "Requests refused by the router.", ("model", "reason")
        )
        self.dispatched = counter(
            "cbserve_router_dispatched", "Requests sent to a replica.", ("model", "replica", "priority")
        )
        self.live_replicas = gauge("cbserve_router_live_replicas", "A model's replicas reporting load.", ("model",))
        self._priorities: dict[str, set[int]] = {}  # per model, the classes whose depth has been reported

    def record_depth(self, model: str, priority: int, depth: int) -> None:
        self._priorities.setdefault(model, set()).add(priority)
        self.queue_depth.set(depth, tags={"model": model, "priority": str(priority)})

    def refresh_depths(self, model: str, depth_by_priority: Mapping[int, int]) -> None:
        """Sets every known class's depth again: Ray's metrics agent drops a gauge series that is
        not set for two report intervals, so an idle queue would vanish from /metrics."""
        for priority in self._priorities.get(model, ()):
            self.queue_depth.set(depth_by_priority.get(priority, 0), tags={"model": model, "priority": str(priority)})

    def record_dispatch(self, model: str, replica_id: str, priority: int, wait_s: float) -> None:
        self.admission_wait.observe(wait_s, tags={"model": model, "priority": str(priority)})
        self.dispatched.inc(tags={"model": model, "replica": replica_id, "priority": str(priority)})


class ReplicaMetrics:
    """Engine load as seen by a replica, and per-request latencies tagged by priority class
    (from the engine's own RequestMetrics: TTFT counts from the request's arrival at the router)."""

    def __init__(self, enabled: bool, replica_id: str, served_model: str, model: ModelReport | None = None,
                 objectives: Mapping[tuple[int, str], float] | None = None):
        """`served_model`: the model's served name, the `model` label of every series (the model id,
        name or name:adapter, on the `cbserve_model_*` request series); `model`: the engine's
        ModelReport, how it computes: quantization, dtype and device are the labels of
        `cbserve_engine_info` (value 1), so dashboards can split any figure by mode; its numbers
        are the `cbserve_model_*` gauges. `objectives`: (priority, objective) ->
        seconds, the app's SLO, exported so that alert rules and dashboards compare latencies with it."""
        gauge, hist, counter = _make(enabled)
        self._objectives = dict(objectives or {})
        self._gauge = gauge
        self._engine_gauges: dict[str, Any] = {}
        self.tags = {"replica": replica_id, "model": served_model}
        labels = {} if model is None else {"quantization": model.quantization, "dtype": model.dtype,
                                           "kv_cache_dtype": model.kv_cache_dtype, "device": model.device,
                                           "architecture": model.architecture, "model_path": model.model_path}
        self._execution = {**self.tags, **labels}
        self.engine_info = gauge("cbserve_engine_info", "1, labelled with how the engine computes.",
                                 tuple(self._execution))
        figures = {"weight_bytes_per_token": "Matmul weight bytes one decode step reads.",
                   "top1_agreement": "Teacher-forced top-1 agreement of the quantized model with fp32 "
                                     "(engine/quality.py).",
                   "perplexity_increase": "Perplexity of the quantized model over fp32's, minus 1."}
        self._model_figures = [(gauge(f"cbserve_model_{name}", desc, _BY_REPLICA), getattr(model, name))
                               for name, desc in figures.items()
                               if model is not None and getattr(model, name) is not None]
        self.num_waiting = gauge("cbserve_replica_num_waiting", "Engine waiting queue.", _BY_REPLICA)
        self.num_running = gauge("cbserve_replica_num_running", "Engine running batch.", _BY_REPLICA)
        self.kv_usage = gauge("cbserve_replica_kv_usage", "KV cache usage 0..1.", _BY_REPLICA)
        self.ready = gauge("cbserve_replica_ready", "1 while the engine takes requests.", _BY_REPLICA)
        self.ttft = hist("cbserve_ttft_s", "Time to first token.", (*_BY_REPLICA, "priority"))
        self.e2e = hist("cbserve_e2e_latency_s", "Request latency.", (*_BY_REPLICA, "priority"))
        self.tpot = hist("cbserve_tpot_s", "Time per output token.", (*_BY_REPLICA, "priority"))
        self.generation_tokens = counter(
            "cbserve_generation_tokens", "Tokens generated.", (*_BY_REPLICA, "priority")
        )
        self.prompt_tokens = counter(
            "cbserve_prompt_tokens", "Prompt tokens processed.", (*_BY_REPLICA, "priority")
        )
        self.stream_messages = counter(
            "cbserve_stream_messages", "Coalesced stream messages sent.", _BY_REPLICA
        )
        self.slo_requests = counter(
            "cbserve_slo_requests", "Finished requests of a class with objectives, by verdict (met or missed) "
            "on each objective and on all of them (objective 'all').",
            (*_BY_REPLICA, "priority", "objective", "verdict"))
        self.slo_attainment = gauge("cbserve_slo_attainment", "Share of the last minute's finished requests "
                                    "that met every objective.", (*_BY_REPLICA, "priority"))
        self.goodput = gauge("cbserve_goodput_rps", "Requests per second that met every objective (last "
                             "minute).", (*_BY_REPLICA, "priority"))
        self.slo_objective = gauge("cbserve_slo_objective_s", "The latency objective of a class, seconds.",
                                   (*_BY_REPLICA, "priority", "objective"))
        # per model id: the served model's name, or name:adapter for a LoRA adapter's requests
        self.model_requests = counter("cbserve_model_requests", "Requests that ended, by model id.",
                                      _BY_REPLICA)
        self.model_generation_tokens = counter("cbserve_model_generation_tokens", "Tokens generated, by model id.",
                                               _BY_REPLICA)
        self.model_ttft = hist("cbserve_model_ttft_s", "Time to first token, by model id.", _BY_REPLICA)
        self.model_e2e = hist("cbserve_model_e2e_latency_s", "Request latency, by model id.", _BY_REPLICA)

    def record_load(self, stats: Any, engine_stats: Any) -> None:
        """`stats`: the replica's ReplicaStats; `engine_stats`: the engine's EngineStats, every
        numeric field exported as `cbserve_engine_<field>` (batch size, prefix-cache hit rate,
        step latency, preemptions, swapped blocks, failed requests, ...)."""
        self.num_waiting.set(stats.num_waiting, tags=self.tags)
        self.num_running.set(stats.num_running, tags=self.tags)
        self.kv_usage.set(stats.kv_usage, tags=self.tags)
        self.ready.set(int(stats.ready), tags=self.tags)
        self.engine_info.set(1, tags=self._execution)
        for figure, value in self._model_figures:
            figure.set(value, tags=self.tags)
        for (priority, objective), seconds in self._objectives.items():
            self.slo_objective.set(seconds, tags={**self.tags, "priority": str(priority), "objective": objective})
        for name, value in engine_stats.as_dict().items():
            if not isinstance(value, int | float):  # the adapters' names: in ReplicaStats, not a figure
                continue
            gauge = self._engine_gauges.get(name)
            if gauge is None:
                gauge = self._engine_gauges[name] = self._gauge(
                    f"cbserve_engine_{name}", f"Engine stats field {name}.", _BY_REPLICA
                )
            gauge.set(value, tags=self.tags)

    def record_slo(self, priority: int, verdicts: Mapping[str, bool]) -> None:
        for objective, met in verdicts.items():
            self.slo_requests.inc(tags={**self.tags, "priority": str(priority), "objective": objective,
                                        "verdict": "met" if met else "missed"})

    def record_slo_window(self, window: Mapping[int, tuple[float | None, float]]) -> None:
        """Each tick: goodput of every class seen, attainment of those with requests in the window."""
        for priority, (attainment, goodput) in window.items():
            tags = {**self.tags, "priority": str(priority)}
            if attainment is not None:
                self.slo_attainment.set(attainment, tags=tags)
            self.goodput.set(goodput, tags=tags)

    def record_request(self, priority: int, timings: Any, num_messages: int, num_output: int,
                       num_prompt: int, model: str) -> None:
        """`timings`: the engine's RequestMetrics of the request (None if it never ran); `model`:
        its model id (name, or name:adapter)."""
        by_model = {**self.tags, "model": model}
        self.model_requests.inc(tags=by_model)
        if num_output:
            self.model_generation_tokens.inc(num_output, tags=by_model)
        if timings is not None and timings.ttft is not None:
            self.model_ttft.observe(timings.ttft, tags=by_model)
        if timings is not None and timings.e2e_latency is not None:
            self.model_e2e.observe(timings.e2e_latency, tags=by_model)
        tags = {**self.tags, "priority": str(priority)}
        if num_messages:
            self.stream_messages.inc(num_messages, tags=self.tags)
        if timings is not None and timings.ttft is not None:
            self.ttft.observe(timings.ttft, tags=tags)
            tpot = timings.time_per_output_token(num_output)
            if tpot is not None:
                self.tpot.observe(tpot, tags=tags)
        if timings is not None and timings.e2e_latency is not None:
            self.e2e.observe(timings.e2e_latency, tags=tags)
        if num_output:
            self.generation_tokens.inc(num_output, tags=tags)
        if num_prompt:
            self.prompt_tokens.inc(num_prompt, tags=tags)
