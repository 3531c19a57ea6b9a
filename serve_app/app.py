"""`build_app(config)`: the graph's shape, and the only place that applies `serve.deployment(...)`
and `.bind(...)`. Each deployment is named after its class (serve_app.frontend), one role each:

- colocated (`config.colocated`: one model, one engine replica): `IngressRouterEngine`, the front
  end, the router and the engine replica in one actor.
- router in the ingress (`config.router_in_ingress`: one ingress replica): `IngressRouter` ->
  `EngineReplica` (num_replicas or autoscaling; each call pinned to the replica the router named by
  PinnedReplicaRequestRouter).
- split: `Ingress` (num_replicas) -> `Router` (one replica, the global queue) and `EngineReplica`.
Several models (`config.models`): an EngineReplica deployment per model (`EngineReplica-<name>`,
its own replicas, resources and engine args), one ingress and one router for all. Engine replicas
report their load to the deployment holding the router, by its name (serve_app.replica.RouterByName),
and, with speculative placement `actor`, hold the DraftModel deployment's handle (bound so Serve
deploys it with the app; engines call it by name).
`app_builder(args)` is the YAML entry point (`import_path: serve_app.app:app_builder`); unknown
keys in `args` are errors.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from engine.client import EngineClient
from serve_app.autoscaling import POLICY as AUTOSCALING_POLICY
from serve_app.config import AppConfig, EngineReplicaConfig
from serve_app.draft import DRAFT_DEPLOYMENT, DraftModel
from serve_app.frontend import Ingress, IngressRouter, IngressRouterEngine
from serve_app.replica import EngineReplica, RouterByName
from serve_app.router import Router

if TYPE_CHECKING:
    from ray.serve import Application

_QUIET = {"enable_access_log": False}


def replica_deployment_name(config: AppConfig, engine: EngineReplicaConfig) -> str:
    """`EngineReplica`, or with several models `EngineReplica-<served name>` (characters Serve's
    names and Prometheus's label values take)."""
    if len(config.served_models) == 1:
        return "EngineReplica"
    return "EngineReplica-" + re.sub(r"[^A-Za-z0-9_.-]", "_", engine.model_name)


def replica_deployment_options(config: AppConfig, engine: EngineReplicaConfig) -> dict[str, Any]:
    from ray.serve.config import RequestRouterConfig

    options: dict[str, Any] = dict(
        name=replica_deployment_name(config, engine),
        ray_actor_options={"num_cpus": engine.num_cpus, "num_gpus": engine.num_gpus,
                           **({"resources": engine.resources} if engine.resources else {})},
        max_ongoing_requests=engine.max_ongoing_requests,
        request_router_config=RequestRouterConfig(  # Ray types its **kwargs as dicts
            request_router_class="serve_app.pinning:PinnedReplicaRequestRouter"  # type: ignore[arg-type]
        ),
        logging_config=_QUIET,
        health_check_period_s=5,
    )
    if engine.max_replicas_per_node is not None:
        options["max_replicas_per_node"] = engine.max_replicas_per_node
    if engine.autoscaling is not None:
        options["autoscaling_config"] = {**engine.autoscaling.model_dump(exclude_none=True),
                                         "policy": {"policy_function": AUTOSCALING_POLICY}}
    else:
        options["num_replicas"] = engine.num_replicas
    return options


def engine_ingress_deployment_options(config: AppConfig) -> dict[str, Any]:
    """The engine replica's actor and resources, taking the ingress's requests and the ingress's
    and router's CPU too."""
    options = replica_deployment_options(config, config.engine)
    del options["request_router_config"]  # one replica: nothing to pin
    options["ray_actor_options"]["num_cpus"] += config.ingress.num_cpus + config.router.num_cpus
    options["name"] = IngressRouterEngine.__name__
    options["max_ongoing_requests"] = ingress_deployment_options(config)["max_ongoing_requests"]
    return options


def router_deployment_options(config: AppConfig) -> dict[str, Any]:
    # admit_many() calls stay open inside the router while their requests are queued: Serve must
    # never queue them itself.
    max_ongoing = 4 * config.router.max_queued_requests + 4096
    return dict(
        name=Router.__name__,
        num_replicas=1,
        ray_actor_options={"num_cpus": config.router.num_cpus},
        max_ongoing_requests=max_ongoing,
        max_queued_requests=-1,
        logging_config=_QUIET,
    )


def ingress_deployment_options(config: AppConfig) -> dict[str, Any]:
    num_cpus = config.ingress.num_cpus + (config.router.num_cpus if config.router_in_ingress else 0)
    return dict(
        name=(IngressRouter if config.router_in_ingress else Ingress).__name__,
        num_replicas=config.ingress.num_replicas,
        ray_actor_options={"num_cpus": num_cpus},
        max_ongoing_requests=4 * config.router.max_queued_requests + 4096,
    )


def draft_deployment_options(engine: EngineReplicaConfig) -> dict[str, Any]:
    draft = engine.draft
    return dict(
        name=DRAFT_DEPLOYMENT,
        num_replicas=draft.num_replicas,
        ray_actor_options={"num_cpus": draft.num_cpus, "num_gpus": draft.num_gpus},
        max_ongoing_requests=64,  # one call per engine step per engine replica; they run one at a time
        logging_config=_QUIET,
        health_check_period_s=5,
    )


def build_app(config: AppConfig, engine_cls: type[EngineClient] | None = None) -> Application:
    """The application graph; `engine_cls` defaults to engine.AsyncEngine (tests inject a fake
    EngineClient; it must be importable on the workers)."""
    from ray import serve

    if config.colocated:
        options = engine_ingress_deployment_options(config)
        return serve.deployment(**options)(serve.ingress()(IngressRouterEngine)).bind(
            config, engine_cls, _draft(config.engine))
    options = ingress_deployment_options(config)
    reports = RouterByName(options["name"] if config.router_in_ingress else Router.__name__)
    replicas = {
        engine.model_name: serve.deployment(**replica_deployment_options(config, engine))(EngineReplica).bind(
            engine, reports, engine_cls, metrics_enabled=True, slo=config.slo, draft=_draft(engine))
        for engine in config.served_models}
    if config.router_in_ingress:
        return serve.deployment(**options)(serve.ingress()(IngressRouter)).bind(config, replicas)
    router = serve.deployment(**router_deployment_options(config))(Router).bind(config.router, metrics_enabled=True)
    return serve.deployment(**options)(serve.ingress()(Ingress)).bind(config, router, replicas)


def _draft(engine: EngineReplicaConfig):
    """The DraftModel deployment bound for a model that drafts with placement `actor`, else None."""
    from ray import serve

    engine_config = engine.engine_config
    if engine_config.speculative is None or engine_config.speculative.placement != "actor":
        return None
    return serve.deployment(**draft_deployment_options(engine))(DraftModel).bind(engine_config,
                                                                               engine.draft.num_threads)


def app_builder(args: dict[str, Any] | None = None):
    """Serve application builder: `args` from the YAML are validated as an AppConfig."""
    return build_app(AppConfig.model_validate(args or {}))
