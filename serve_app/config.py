"""Serve-side configuration: pydantic models filled from the `args` of a serve YAML.

Owns: the typed options of the ingress, the router and the engine replicas, and YAML loading.
Does not own: engine internals (engine args are passed through to `AsyncEngine.from_engine_args`)
or Serve deployment options beyond the few we expose (those are derived in `app.py`).

Every model forbids unknown keys, so a typo in a YAML file is an error at `serve run` time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

Policy = Literal["fcfs", "sjf", "priority"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EngineArgs(_Strict):
    """Engine arguments from docs/CONTRACT.md; unset fields keep the engine's defaults."""

    max_num_seqs: int | None = Field(None, ge=1, description="Max sequences per engine step.")
    max_num_batched_tokens: int | None = Field(None, ge=1, description="Token budget per step.")
    block_size: int | None = Field(None, ge=1, description="Tokens per KV block.")
    num_blocks: int | None = Field(None, ge=1, description="KV blocks on the device.")
    kv_cache_memory_bytes: int | None = Field(None, ge=1, description="KV pool size in bytes.")
    max_model_len: int | None = Field(None, ge=1, description="Context length (prompt + output).")
    policy: Literal["fcfs", "sjf", "priority", "static"] | None = Field(
        None, description="Engine scheduling policy inside one replica."
    )
    aging_rate: float | None = Field(None, ge=0, description="Engine-side aging rate.")
    preemption_mode: Literal["recompute", "swap", "auto"] | None = Field(None, description="")
    swap_space_bytes: int | None = Field(None, ge=0, description="Host swap pool size.")
    enable_prefix_caching: bool | None = Field(None, description="Reuse cached prompt blocks.")
    device: str | None = Field(None, description="'cpu' or 'cuda'.")
    attention_backend: Literal["auto", "torch", "cpu", "flash"] | None = Field(
        None, description="'auto', 'torch', 'cpu' (C++ decode kernel), 'flash' (CUDA).")
    seed: int | None = Field(None, description="Engine RNG seed.")
    num_threads: int | None = Field(
        None, ge=1, description="torch threads in the replica (Ray otherwise sets OMP threads to num_cpus).")

    def as_kwargs(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class AutoscalingSettings(_Strict):
    """Subset of Serve's autoscaling_config that makes sense for engine replicas."""

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    initial_replicas: int | None = Field(None, ge=0)
    target_ongoing_requests: float = Field(16.0, gt=0, description="Per replica.")
    upscale_delay_s: float = Field(10.0, ge=0)
    downscale_delay_s: float = Field(60.0, ge=0)
    look_back_period_s: float | None = Field(
        None, gt=0, description="Window the ongoing-request counts are averaged over (Serve: 30).")
    metrics_interval_s: float | None = Field(
        None, gt=0, description="How often callers push those counts to Serve (Serve: 10).")

    @model_validator(mode="after")
    def _check_bounds(self) -> "AutoscalingSettings":
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas ({self.min_replicas}) > max_replicas ({self.max_replicas})"
            )
        return self


class EngineReplicaConfig(_Strict):
    model: str | None = Field(None, description="Model directory/GGUF; None = embedded model.")
    served_model_name: str | None = Field(
        None, description="Name clients pass as `model`; default: the model's directory name."
    )
    engine_args: EngineArgs = Field(default_factory=EngineArgs)
    num_replicas: int = Field(1, ge=1, description="Fixed replica count (ignored with autoscaling).")
    autoscaling: AutoscalingSettings | None = Field(None, description="Serve autoscaling.")
    max_replicas_per_node: int | None = Field(
        None, ge=1, description="Spread replicas over nodes: at most this many on one node.")
    num_cpus: float = Field(0.5, ge=0, description="CPUs reserved per replica.")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per replica (1 on GPU hosts).")
    max_ongoing_requests: int = Field(
        1024, ge=1, description="Serve-level cap; admission is the router's job, keep it high."
    )
    engine_process: bool = Field(
        True, description="Run the engine's step loop in a child process of the replica, so the "
                          "replica's serving threads take neither the GIL nor the forward's cores.")
    stream_flush_interval_s: float = Field(
        0.05, ge=0, description="Coalesce token deltas into one message per interval per stream."
    )
    stats_report_interval_s: float = Field(
        0.25, gt=0, description="How often a replica pushes its load snapshot to the router."
    )

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if self.model:
            return Path(self.model.rstrip("/")).name
        return "SmolLM2-135M-Instruct"


class RouterConfig(_Strict):
    policy: Policy = Field("fcfs", description="Order of the global admission queue.")
    aging_rate: float = Field(
        1.0,
        ge=0,
        description=(
            "Rank units gained per second of waiting, as in the engine: priority classes/s for "
            "`priority`, tokens/s for `sjf`. FCFS ignores it."
        ),
    )
    max_queued_requests: int = Field(256, ge=0, description="Bound of the admission queue.")
    max_queued_tokens: int = Field(
        1_000_000, ge=1, description="Bound on prompt+max_tokens summed over the queue."
    )
    max_waiting_per_replica: int = Field(
        2, ge=1, description="A replica has headroom while its waiting queue is below this."
    )
    replica_stale_after_s: float = Field(
        5.0, gt=0, description="A replica silent for this long is taken out of rotation."
    )
    no_replica_timeout_s: float = Field(
        10.0, ge=0, description="Queued requests get 503 after this long with no live replica."
    )
    affinity_load_slack: float = Field(
        0.05, ge=0, description="Loads within this of the least count as a tie (prefix decides)."
    )
    num_cpus: float = Field(0.1, ge=0)


class IngressConfig(_Strict):
    api_keys: list[str] = Field(default_factory=list, description="Bearer tokens; empty = open.")
    max_body_bytes: int = Field(1 << 20, ge=1, description="Larger bodies get 413.")
    num_replicas: int = Field(1, ge=1)
    num_cpus: float = Field(0.1, ge=0)
    default_completion_max_tokens: int = Field(16, ge=1, description="OpenAI's default.")
    grpc_transport: bool = Field(
        True, description="Admission calls and replica streams over Serve's gRPC transport "
                          "(_by_reference=False) instead of the object store.")


class AppConfig(_Strict):
    engine: EngineReplicaConfig = Field(default_factory=EngineReplicaConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
    ingress: IngressConfig = Field(default_factory=IngressConfig)

    @model_validator(mode="after")
    def _autoscaling_sees_demand(self) -> "AppConfig":
        """Serve scales on requests ongoing at replicas, but the router holds the rest: a replica
        never has more than max_num_seqs + max_waiting_per_replica, so a target at or above that
        would never scale up."""
        auto = self.engine.autoscaling
        if auto is None:
            return self
        from engine.config import SchedulerConfig

        max_seqs = self.engine.engine_args.max_num_seqs or SchedulerConfig().max_num_seqs
        ceiling = max_seqs + self.router.max_waiting_per_replica
        if auto.target_ongoing_requests >= ceiling:
            raise ValueError(
                f"autoscaling.target_ongoing_requests ({auto.target_ongoing_requests:g}) must be "
                f"below max_num_seqs + router.max_waiting_per_replica ({ceiling}), the most "
                "requests the router lets one replica hold; otherwise it never scales up")
        return self


def load_config(path: str | Path) -> AppConfig:
    """Reads a config YAML: either a bare AppConfig mapping or a serve config whose first
    application carries it in `args`."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    if "applications" in data:
        data = data["applications"][0].get("args", {}) or {}
    return AppConfig.model_validate(data)
