"""Serve-side metrics (prefix `cbserve_`), exported through `ray.util.metrics`.

Owns: metric names, tags and the two recorder classes the router and replicas call.
Does not own: engine-internal metrics (the engine exports its own). Recorders are created with
`enabled=False` outside Ray (unit tests, local app) and then do nothing.

On a node's metrics endpoint the names appear prefixed `ray_` (counters suffixed `_total`).
"""

from __future__ import annotations

from typing import Any

_LATENCY_BOUNDARIES = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]


class _Null:
    def set(self, *a: Any, **k: Any) -> None: ...
    def observe(self, *a: Any, **k: Any) -> None: ...
    def inc(self, *a: Any, **k: Any) -> None: ...


def _make(enabled: bool):
    if not enabled:
        return (lambda *a, **k: _Null(),) * 3
    from ray.util.metrics import Counter, Gauge, Histogram

    def gauge(name: str, desc: str, tags: tuple[str, ...]):
        return Gauge(name, description=desc, tag_keys=tags)

    def hist(name: str, desc: str, tags: tuple[str, ...]):
        return Histogram(name, description=desc, boundaries=_LATENCY_BOUNDARIES, tag_keys=tags)

    def counter(name: str, desc: str, tags: tuple[str, ...]):
        return Counter(name, description=desc, tag_keys=tags)

    return gauge, hist, counter


class RouterMetrics:
    """Queue depth per priority class, admission wait, rejections, dispatches per replica."""

    def __init__(self, enabled: bool):
        gauge, hist, counter = _make(enabled)
        self.queue_depth = gauge(
            "cbserve_router_queue_depth", "Requests in the admission queue.", ("priority",)
        )
        self.admission_wait = hist(
            "cbserve_router_admission_wait_s", "Time from admit() to dispatch.", ("priority",)
        )
        self.rejections = counter(
            "cbserve_router_rejections", "Requests refused by the router.", ("reason",)
        )
        self.dispatched = counter(
            "cbserve_router_dispatched", "Requests sent to a replica.", ("replica", "priority")
        )
        self.live_replicas = gauge("cbserve_router_live_replicas", "Replicas reporting load.", ())

    def record_queue(self, depth_by_priority: dict[int, int], seen: set[int]) -> None:
        for priority in seen:
            self.queue_depth.set(depth_by_priority.get(priority, 0), tags={"priority": str(priority)})


class ReplicaMetrics:
    """Engine load as seen by a replica, and per-request latencies tagged by priority class."""

    def __init__(self, enabled: bool, replica_id: str):
        gauge, hist, counter = _make(enabled)
        self._gauge = gauge
        self._engine_gauges: dict[str, Any] = {}
        self._tags = {"replica": replica_id}
        self.num_waiting = gauge("cbserve_replica_num_waiting", "Engine waiting queue.", ("replica",))
        self.num_running = gauge("cbserve_replica_num_running", "Engine running batch.", ("replica",))
        self.kv_usage = gauge("cbserve_replica_kv_usage", "KV cache usage 0..1.", ("replica",))
        self.ttft = hist("cbserve_ttft_s", "Time to first token.", ("replica", "priority"))
        self.e2e = hist("cbserve_e2e_latency_s", "Request latency.", ("replica", "priority"))
        self.tpot = hist("cbserve_tpot_s", "Time per output token.", ("replica", "priority"))
        self.generation_tokens = counter(
            "cbserve_generation_tokens", "Tokens generated.", ("replica", "priority")
        )
        self.prompt_tokens = counter(
            "cbserve_prompt_tokens", "Prompt tokens processed.", ("replica", "priority")
        )
        self.stream_messages = counter(
            "cbserve_stream_messages", "Coalesced stream messages sent.", ("replica",)
        )

    def record_load(self, num_waiting: int, num_running: int, kv_usage: float) -> None:
        self.num_waiting.set(num_waiting, tags=self._tags)
        self.num_running.set(num_running, tags=self._tags)
        self.kv_usage.set(kv_usage, tags=self._tags)

    def record_engine_stats(self, fields: dict[str, Any]) -> None:
        """Every numeric field of the engine's stats snapshot as `cbserve_engine_<field>`
        (batch size, prefix-cache hit rate, step latency, preemptions, swapped blocks, ...)."""
        for name, value in fields.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            gauge = self._engine_gauges.get(name)
            if gauge is None:
                gauge = self._engine_gauges[name] = self._gauge(
                    f"cbserve_engine_{name}", f"Engine stats field {name}.", ("replica",)
                )
            gauge.set(value, tags=self._tags)

    def record_request(
        self, priority: int, ttft_s: float | None, e2e_s: float, num_prompt: int, num_output: int
    ) -> None:
        tags = {**self._tags, "priority": str(priority)}
        if ttft_s is not None:
            self.ttft.observe(ttft_s, tags=tags)
            if num_output > 1:
                self.tpot.observe((e2e_s - ttft_s) / (num_output - 1), tags=tags)
        self.e2e.observe(e2e_s, tags=tags)
        if num_output:
            self.generation_tokens.inc(num_output, tags=tags)
        if num_prompt:
            self.prompt_tokens.inc(num_prompt, tags=tags)
