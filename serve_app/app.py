"""`build_app(config)`: the graph's shape, and the only place that applies `serve.deployment(...)`
and `.bind(...)`.

Split: the ingress (serve_app.frontend.Frontend, with the Router's and the replicas' handles) ->
Router (one replica, the global queue) and EngineReplica (num_replicas or autoscaling; each call
pinned to the replica the router named by PinnedReplicaRequestRouter). Several models
(`config.models`): an EngineReplica deployment per model (`EngineReplica-<name>`, its own replicas,
resources and engine args), one ingress and one router for all. Replicas hold the router's
handle to push load reports, and, with speculative placement `actor`, the DraftModel deployment's
(bound so Serve deploys it with the app; engines call it by name).
Router in the ingress (`config.router_in_ingress`: one ingress replica): no Router deployment;
the Frontend holds the router, and the replicas report to it by its deployment's name.
Colocated (`config.colocated`: one model, one engine replica): one deployment, the Frontend holding the
router and the engine replica.
`app_builder(args)` is the YAML entry point (`import_path: serve_app.app:app_builder`); unknown
keys in `args` are errors.
"""

from __future__ import annotations

import re
from typing import Any

from engine.client import EngineClient
from serve_app.autoscaling import POLICY as AUTOSCALING_POLICY
from serve_app.config import AppConfig, EngineReplicaConfig
from serve_app.draft import DRAFT_DEPLOYMENT, DraftModel
from serve_app.frontend import Frontend
from serve_app.replica import EngineReplica
from serve_app.router import Router

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
    options["name"] = "EngineIngress"
    options["max_ongoing_requests"] = ingress_deployment_options(config)["max_ongoing_requests"]
    return options


def router_deployment_options(config: AppConfig) -> dict[str, Any]:
    # admit_many() calls stay open inside the router while their requests are queued: Serve must
    # never queue them itself.
    max_ongoing = 4 * config.router.max_queued_requests + 4096
    return dict(
        name="Router",
        num_replicas=1,
        ray_actor_options={"num_cpus": config.router.num_cpus},
        max_ongoing_requests=max_ongoing,
        max_queued_requests=-1,
        logging_config=_QUIET,
    )


def ingress_deployment_options(config: AppConfig) -> dict[str, Any]:
    num_cpus = config.ingress.num_cpus + (config.router.num_cpus if config.router_in_ingress else 0)
    return dict(
        name="Ingress",
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


def build_app(config: AppConfig, engine_cls: type[EngineClient] | None = None):
    """The application graph; `engine_cls` defaults to engine.AsyncEngine (tests inject a fake
    EngineClient; it must be importable on the workers)."""
    from ray import serve

    frontend = serve.ingress()(Frontend)
    if config.colocated:
        options = engine_ingress_deployment_options(config)
        return serve.deployment(**options)(frontend).bind(config, None, None, engine_cls, _draft(config.engine))
    options = ingress_deployment_options(config)
    if config.router_in_ingress:  # the replicas report to the router in the Frontend, by its name
        report_to = options["name"]
        router = None
    else:
        router = report_to = serve.deployment(**router_deployment_options(config))(Router).bind(
            config.router, metrics_enabled=True)
    replicas = {
        engine.model_name: serve.deployment(**replica_deployment_options(config, engine))(EngineReplica).bind(
            engine, report_to, engine_cls, metrics_enabled=True, slo=config.slo, draft=_draft(engine))
        for engine in config.served_models}
    return serve.deployment(**options)(frontend).bind(config, router, replicas)


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
