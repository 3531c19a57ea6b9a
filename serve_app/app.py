"""`build_app(config)`: the only place that applies `serve.deployment(...)` and `.bind(...)`.

Graph: Ingress(config, router, replicas) -> Router (one replica, the global queue) and
EngineReplica (num_replicas or autoscaling; pinned per call by PinnedReplicaRequestRouter).
Replicas hold a router handle to push load reports, and, with speculative placement `actor`, the
DraftModel deployment's (bound so Serve deploys it with the app; engines call it by name).
With `config.router_in_ingress` (one ingress replica) there is no Router deployment: the ingress
is a RouterIngress(config, replicas) holding the router, and replicas report to it by name.
With `config.colocated` (one engine replica) the ingress, the router and the engine replica are
one deployment, EngineIngress(config), which calls the other two in-process.
`app_builder(args)` is the YAML entry point (`import_path: serve_app.app:app_builder`); unknown
keys in `args` are errors.
"""

from __future__ import annotations

from typing import Any

from engine.client import EngineClient
from serve_app.autoscaling import POLICY as AUTOSCALING_POLICY
from serve_app.config import AppConfig
from serve_app.draft import DRAFT_DEPLOYMENT, DraftModel
from serve_app.engine_ingress import EngineIngress
from serve_app.ingress import Ingress
from serve_app.replica import EngineReplica
from serve_app.router import Router
from serve_app.router_ingress import RouterIngress

_QUIET = {"enable_access_log": False}


def replica_deployment_options(config: AppConfig) -> dict[str, Any]:
    from ray.serve.config import RequestRouterConfig

    engine = config.engine
    options: dict[str, Any] = dict(
        name="EngineReplica",
        ray_actor_options={"num_cpus": engine.num_cpus, "num_gpus": engine.num_gpus,
                           **({"resources": engine.resources} if engine.resources else {})},
        max_ongoing_requests=engine.max_ongoing_requests,
        request_router_config=RequestRouterConfig(
            request_router_class="serve_app.pinning:PinnedReplicaRequestRouter"
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
    options = replica_deployment_options(config)
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


def draft_deployment_options(config: AppConfig) -> dict[str, Any]:
    draft = config.engine.draft
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

    engine_config, draft = config.engine.engine_config, None
    if engine_config.speculative is not None and engine_config.speculative.placement == "actor":
        draft_dep = serve.deployment(DraftModel, **draft_deployment_options(config))
        draft = draft_dep.bind(engine_config, config.engine.draft.num_threads)
    if config.colocated:
        options = engine_ingress_deployment_options(config)
        return serve.deployment(serve.ingress()(EngineIngress), **options).bind(config, engine_cls, draft)
    replica_dep = serve.deployment(EngineReplica, **replica_deployment_options(config))
    options = ingress_deployment_options(config)
    if config.router_in_ingress:
        replicas = replica_dep.bind(config.engine, options["name"], engine_cls, metrics_enabled=True,
                                    slo=config.slo, draft=draft)
        return serve.deployment(serve.ingress()(RouterIngress), **options).bind(config, replicas)
    router = serve.deployment(Router, **router_deployment_options(config)).bind(config.router, metrics_enabled=True)
    replicas = replica_dep.bind(config.engine, router, engine_cls, metrics_enabled=True, slo=config.slo,
                                draft=draft)
    return serve.deployment(serve.ingress()(Ingress), **options).bind(config, router, replicas)


def app_builder(args: dict[str, Any] | None = None):
    """Serve application builder: `args` from the YAML are validated as an AppConfig."""
    return build_app(AppConfig.model_validate(args or {}))
