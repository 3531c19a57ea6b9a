"""Serve-side configuration: pydantic models filled from the `args` of a serve YAML.

Owns: the typed options of the ingress, the router and the engine replicas, and YAML loading.
The engine's own options (`engine.engine_args`) are not written here: `EngineArgs` is generated
from the engine's config dataclasses (engine.config.ENGINE_PARTS) and validated by building the
EngineConfig, so the two cannot drift. Deployment options beyond the few we expose are derived
in `app.py`.

Every model forbids unknown keys and takes values strictly as typed, so a typo or a quoted
number in a YAML file is an error at `serve run` time.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, Strict, StrictInt, create_model, field_validator, model_validator

from engine.config import ENGINE_PARTS, EngineConfig
from serve_app.slo import SLOTarget

Policy = Literal["fcfs", "sjf", "priority"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class _EngineArgsBase(_Strict):
    """Engine arguments (engine.config); unset fields keep the engine's defaults."""

    def as_kwargs(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)

    @model_validator(mode="after")
    def _engine_accepts(self) -> _EngineArgsBase:
        EngineConfig.from_kwargs(**self.as_kwargs())  # the engine's own checks, at load time
        return self


def _engine_args_model() -> type[_EngineArgsBase]:
    fields: dict[str, Any] = {}
    for part in ENGINE_PARTS:
        hints = typing.get_type_hints(part)
        for f in dataclasses.fields(part):
            if f.name != "model":  # the replica's `model` names it
                fields[f.name] = (hints[f.name] | None, Field(None, description=f.metadata["help"]))
    fields["speculative_config"] = (dict[str, Any] | None, Field(
        None, description="speculative decoding, as vLLM spells it: {method: ngram, num_speculative_tokens: 4, ...}"))
    return create_model("EngineArgs", __base__=_EngineArgsBase, **fields)


if typing.TYPE_CHECKING:
    EngineArgs = _EngineArgsBase  # its fields are made at import, from the engine's dataclasses
else:
    EngineArgs = _engine_args_model()


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
    def _check_bounds(self) -> AutoscalingSettings:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) > max_replicas ({self.max_replicas})")
        return self


class DraftModelSettings(_Strict):
    """The DraftModel deployment, deployed when speculative_config says placement: actor."""
    num_replicas: int = Field(1, ge=1, description="Draft replicas (engine replicas share them).")
    num_cpus: float = Field(0.5, ge=0, description="CPUs reserved per draft replica.")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per draft replica.")
    num_threads: int | None = Field(None, ge=1, description="torch threads of a draft replica; None keeps torch's.")


class EngineReplicaConfig(_Strict):
    model: str | None = Field(None, description="Model directory/GGUF; None = embedded model.")
    served_model_name: str | None = Field(
        None, description="Name clients pass as `model`; default: the model's directory name.")
    engine_args: EngineArgs = Field(default_factory=EngineArgs)
    num_replicas: int = Field(1, ge=1, description="Fixed replica count (ignored with autoscaling).")
    autoscaling: AutoscalingSettings | None = Field(None, description="Serve autoscaling.")
    max_replicas_per_node: int | None = Field(
        None, ge=1, description="Spread replicas over nodes: at most this many on one node.")
    num_cpus: float = Field(0.5, ge=0, description="CPUs reserved per replica.")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per replica (1 on GPU hosts).")
    resources: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources per replica, e.g. {engine_node: 1} to keep "
                                          "replicas on the nodes that declare it.")
    max_ongoing_requests: int = Field(
        1024, ge=1, description="Serve-level cap; admission is the router's job, keep it high.")
    engine_process: bool = Field(
        True, description="Run the engine's step loop in a child process of the replica, so the "
                          "replica's serving threads take neither the GIL nor the forward's cores.")
    draft: DraftModelSettings = Field(default_factory=DraftModelSettings)
    stream_flush_interval_s: float = Field(
        0.05, ge=0, description="Coalesce token deltas into one message per interval per stream.")
    stats_report_interval_s: float = Field(
        0.25, gt=0, description="How often a replica checks its load and reports it if it changed; a request's "
                                "end has it check at once, but never within stream_flush_interval_s (the "
                                "engine's counts change no more often) of its last check.")
    stats_heartbeat_s: float = Field(
        1.0, gt=0, description="A replica reports at least this often, changed or not.")

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if self.model:
            return Path(self.model.rstrip("/")).name
        return "SmolLM2-135M-Instruct"

    @property
    def engine_config(self) -> EngineConfig:
        return EngineConfig.from_kwargs(model=self.model, **self.engine_args.as_kwargs())


PriorityRange = Annotated[tuple[StrictInt, StrictInt], Strict(False)]  # YAML and JSON give a list


def _check_range(r: PriorityRange, name: str) -> PriorityRange:
    if r[0] > r[1]:
        raise ValueError(f"{name} {list(r)}: the first bound must not exceed the second")
    return r


class RouterConfig(_Strict):
    policy: Policy = Field("fcfs", description="Order of the global admission queue.")
    aging_rate: float = Field(
        1.0, ge=0,
        description="Rank units gained per second of waiting, as in the engine: priority classes/s "
                    "for `priority`, tokens/s for `sjf`. FCFS ignores it.")
    priority_range: PriorityRange = Field(
        (0, 10), description="Priorities a request may ask for (lower = sooner); outside -> 400. "
                             "With the default, clients can only lower their own priority.")
    max_queued_requests: int = Field(256, ge=1, description="Bound of each model's admission queue.")
    max_queued_tokens: int = Field(
        1_000_000, ge=1, description="Bound on prompt + n * max_tokens summed over each model's queue.")
    max_waiting_per_replica: int = Field(
        2, ge=1, description="A replica has headroom while its waiting queue is below this.")
    replica_stale_after_s: float = Field(
        5.0, gt=0, description="A replica silent for this long is taken out of rotation.")
    no_replica_timeout_s: float = Field(
        10.0, ge=0, description="Queued requests get 503 after this long with no live replica.")
    affinity_load_slack: float = Field(
        0.05, ge=0, description="Loads within this of the least count as a tie (a replica holding the request's "
                                "LoRA adapter, then prefix affinity, decides).")
    num_cpus: float = Field(0.1, ge=0)
    in_ingress: bool | None = Field(
        None, description="In the split graph, the router inside the ingress replica's actor "
                          "(serve_app.frontend): no router actor, and no hop to it for each request's "
                          "admission and release. Needs ingress.num_replicas 1: a second ingress would hold a "
                          "second queue. None: in the ingress exactly then.")

    @model_validator(mode="after")
    def _range_ordered(self) -> RouterConfig:
        _check_range(self.priority_range, "priority_range")
        return self


class ApiKey(_Strict):
    key: str = Field(min_length=1, description="The bearer token.")
    priority_range: PriorityRange | None = Field(
        None, description="Narrows router.priority_range for requests with this key.")


class SharedPortConfig(_Strict):
    """Where every ingress replica of a node serves HTTP itself (serve_app.front_door)."""
    host: str = Field("127.0.0.1", description="Address to bind, as http_options.host.")
    port: int = Field(ge=1, le=65535, description="The port every ingress replica on a node binds (SO_REUSEPORT).")
    keep_alive_timeout_s: float = Field(
        5.0, gt=0, description="An idle keep-alive connection is closed after this, as http_options' is.")


class IngressConfig(_Strict):
    api_keys: list[str | ApiKey] = Field(
        default_factory=list, description="Bearer tokens (a string, or a key with its priority range); "
                                          "empty = open.")
    max_body_bytes: int = Field(1 << 20, ge=1, description="Larger bodies get 413.")
    body_timeout_s: float = Field(
        30.0, gt=0, description="A request body not received in full within this gets 408.")
    replica_accept_timeout_s: float = Field(
        10.0, gt=0, description="A replica that has not acknowledged a dispatched request within this is "
                                "taken as lost (its node died before the call reached it): 503, not a hang.")
    max_prompts_per_request: int = Field(
        64, ge=1, description="Prompts in one /v1/completions request; more get 400. Capped at "
                              "router.max_queued_requests: more could never be admitted together.")
    num_replicas: int = Field(1, ge=1)
    num_cpus: float = Field(0.1, ge=0)
    shared_port: SharedPortConfig | None = Field(
        None, description="Each ingress replica also serves HTTP on this port, which every ingress replica on the "
                          "node shares (SO_REUSEPORT): the kernel spreads connections over them, with no proxy in "
                          "between. `make serve` sets it for a graph of several ingress replicas; None: Serve's "
                          "front door only.")
    colocated: bool | None = Field(
        None, description="The OpenAI front end and the router inside the engine replica's actor "
                          "(serve_app.frontend): no ingress or router actor and no hops between them, so "
                          "fewer processes wake and fewer messages are serialized per token. Needs one engine "
                          "replica and one ingress replica, without autoscaling; None: colocated exactly then.")
    default_completion_max_tokens: int = Field(16, ge=1, description="OpenAI's default.")
    grpc_transport: bool = Field(
        True, description="The request path's calls (admissions, submissions, the replicas' channels) over "
                          "Serve's gRPC transport (_by_reference=False) instead of the object store.")
    ignore_unknown_fields: bool = Field(
        False, description="Accept request fields this server does not know, logging their names, for clients "
                           "that send vendor fields; off: such a request gets a 400 naming the field.")
    max_stored_responses: int = Field(
        1024, ge=0, description="Responses API: responses kept (store: true) for previous_response_id and GET, "
                                "the least recently used dropped first. Kept in each ingress replica's memory: "
                                "with several ingress replicas a later request may reach one that does not hold "
                                "the response (a 404 that says so).")


class AppConfig(_Strict):
    engine: EngineReplicaConfig = Field(
        default_factory=EngineReplicaConfig, description="The one model served, where `models` is not given.")
    models: list[EngineReplicaConfig] = Field(
        default_factory=list, description="Several models in one app, each an `engine` section (its own replicas, "
                                          "resources and engine args); a request's `model` picks one, and the first "
                                          "serves requests that name none. Empty: `engine` alone.")
    router: RouterConfig = Field(default_factory=RouterConfig)
    ingress: IngressConfig = Field(default_factory=IngressConfig)
    slo: dict[int, SLOTarget] = Field(
        default_factory=dict, description="Latency objectives per priority class, e.g. {0: {ttft_s: 1, tpot_s: 0.2}}: "
                                          "replicas count requests that met them (cbserve_slo_*, goodput).")

    @field_validator("slo", mode="before")
    @classmethod
    def _class_keys(cls, value: Any) -> Any:
        """Priority classes as JSON writes them ("0") are classes too."""
        if isinstance(value, dict):
            return {int(k) if isinstance(k, str) and k.lstrip("-").isdigit() else k: v for k, v in value.items()}
        return value

    @model_validator(mode="after")
    def _bounds_agree(self) -> AppConfig:
        lo, hi = self.router.priority_range
        for key in self.ingress.api_keys:
            if isinstance(key, ApiKey) and key.priority_range is not None:
                k_lo, k_hi = _check_range(key.priority_range, "api key priority_range")
                if k_lo < lo or k_hi > hi:
                    raise ValueError(f"an API key's priority_range {[k_lo, k_hi]} is not within "
                                     f"router.priority_range {[lo, hi]}")
        return self

    @property
    def served_models(self) -> list[EngineReplicaConfig]:
        """The models this app serves, the default (requests that name none) first."""
        return self.models or [self.engine]

    @model_validator(mode="after")
    def _models_named_once(self) -> AppConfig:
        if self.models and "engine" in self.model_fields_set:
            raise ValueError("give either `engine` (one model) or `models` (several), not both")
        names = [m.model_name for m in self.served_models]
        if len(set(names)) != len(names):
            raise ValueError(f"two models are served under one name: {names}; set served_model_name")
        if sum(_draft_actor(m) for m in self.served_models) > 1:
            raise ValueError("at most one model may draft with speculative placement `actor`: the app deploys one "
                             "DraftModel deployment")
        return self

    @property
    def colocated(self) -> bool:
        """Whether the ingress runs inside the engine replica (ingress.colocated resolved)."""
        if self.ingress.colocated is not None:
            return self.ingress.colocated
        return (len(self.served_models) == 1 and self.engine.num_replicas == 1 and self.engine.autoscaling is None
                and self.ingress.num_replicas == 1)

    @property
    def router_in_ingress(self) -> bool:
        """Whether the split graph's router runs inside its ingress (router.in_ingress resolved)."""
        if self.router.in_ingress is not None:
            return self.router.in_ingress
        return self.ingress.num_replicas == 1

    @model_validator(mode="after")
    def _one_queue(self) -> AppConfig:
        """Admission is fleet-wide: one queue, so a router inside the ingress needs the one ingress."""
        if self.router.in_ingress and self.ingress.num_replicas != 1:
            raise ValueError("router.in_ingress needs ingress.num_replicas 1: each ingress replica would hold an "
                             "admission queue of its own")
        return self

    @model_validator(mode="after")
    def _colocation_fits(self) -> AppConfig:
        """One front end per engine: with several, the router could admit a request to an engine
        other than the one whose front end holds it."""
        if self.ingress.colocated and (len(self.served_models) != 1 or self.engine.num_replicas != 1
                                       or self.engine.autoscaling is not None or self.ingress.num_replicas != 1):
            raise ValueError("ingress.colocated needs exactly one model and one engine replica (engine.num_replicas "
                             "1, no autoscaling) and ingress.num_replicas 1")
        return self

    @model_validator(mode="after")
    def _autoscaling_sees_demand(self) -> AppConfig:
        """Serve scales on requests ongoing at replicas, but the router holds the rest: a replica
        never has more than max_num_seqs + max_waiting_per_replica, so a target at or above that
        would never scale up."""
        for model in self.served_models:
            auto = model.autoscaling
            if auto is None:
                continue
            ceiling = model.engine_config.scheduler.max_num_seqs + self.router.max_waiting_per_replica
            if auto.target_ongoing_requests >= ceiling:
                raise ValueError(
                    f"autoscaling.target_ongoing_requests ({auto.target_ongoing_requests:g}) of model "
                    f"'{model.model_name}' must be below max_num_seqs + router.max_waiting_per_replica ({ceiling}), "
                    "the most requests the router lets one replica hold; otherwise it never scales up")
        return self


def _draft_actor(model: EngineReplicaConfig) -> bool:
    speculative = model.engine_config.speculative
    return speculative is not None and speculative.placement == "actor"


def load_config(path: str | Path) -> AppConfig:
    """Reads a config YAML: either a bare AppConfig mapping or a serve config whose first
    application carries it in `args`."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    if "applications" in data:
        data = data["applications"][0].get("args", {}) or {}
    return AppConfig.model_validate(data)
