"""Every shipped config parses into AppConfig; unknown keys are errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from serve_app.app import (
    build_app,
    engine_ingress_deployment_options,
    ingress_deployment_options,
    replica_deployment_options,
)
from serve_app.config import AppConfig, AutoscalingSettings, load_config

CONFIGS = sorted((Path(__file__).parents[2] / "configs").rglob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_parse(path):
    cfg = load_config(path)
    opts = replica_deployment_options(cfg, cfg.engine)
    assert opts["ray_actor_options"]["num_gpus"] == cfg.engine.num_gpus
    assert ("autoscaling_config" in opts) != ("num_replicas" in opts)


def test_gpu_config_takes_one_gpu_per_replica():
    cfg = load_config(Path(__file__).parents[2] / "configs" / "serve-gpu.yaml")
    assert replica_deployment_options(cfg, cfg.engine)["ray_actor_options"]["num_gpus"] == 1


def test_custom_resources_reach_the_replica_actor():
    cfg = AppConfig.model_validate({"engine": {"resources": {"engine_node": 1}}})
    assert replica_deployment_options(cfg, cfg.engine)["ray_actor_options"]["resources"] == {"engine_node": 1}
    assert "resources" not in replica_deployment_options(AppConfig(), AppConfig().engine)["ray_actor_options"]
    with pytest.raises(ValueError):
        AppConfig.model_validate({"engine": {"resources": {"engine_node": "one"}}})


def test_scaling_settings_reach_serve_under_its_names():
    """Serve ignores unknown autoscaling keys, so a misnamed field would silently not apply."""
    from ray.serve.config import AutoscalingConfig

    cfg = AppConfig.model_validate({"engine": {"max_replicas_per_node": 1, "autoscaling": {
        "min_replicas": 1, "max_replicas": 3, "initial_replicas": 2, "target_ongoing_requests": 4,
        "upscale_delay_s": 1.0, "downscale_delay_s": 5.0, "look_back_period_s": 3.0,
        "metrics_interval_s": 0.5}}})
    opts = replica_deployment_options(cfg, cfg.engine)
    assert opts["max_replicas_per_node"] == 1
    serve_cfg = AutoscalingConfig(**opts["autoscaling_config"])
    assert set(opts["autoscaling_config"]) == set(AutoscalingSettings.model_fields) | {"policy"}
    for key, value in opts["autoscaling_config"].items():
        if key != "policy":
            assert getattr(serve_cfg, key) == value, key
    assert serve_cfg.policy.policy_function == "serve_app.autoscaling:live_requests_policy"


def test_engine_replicas_scale_on_the_requests_inside_them_not_on_serves_calls():
    """A replica's one call may hold many requests (serve_app.replicas): Serve's rule on the
    requests each replica reports, plus the calls queued at handles."""
    from ray.serve._private.common import DeploymentID
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    from serve_app.autoscaling import live_requests_policy

    def decision(live: dict[str, float] | None, ongoing_calls: float, queued: float, replicas: int = 2) -> float:
        ctx = AutoscalingContext(
            deployment_id=DeploymentID("EngineReplica", "app"), deployment_name="EngineReplica", app_name="app",
            current_num_replicas=replicas, target_num_replicas=replicas, running_replicas=[],
            total_num_requests=ongoing_calls + queued, total_queued_requests=queued,
            aggregated_metrics={"live_requests": live} if live is not None else {}, raw_metrics={},
            capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=8, policy_state={},
            last_scale_up_time=None, last_scale_down_time=None, current_time=0.0,
            config=AutoscalingConfig(min_replicas=1, max_replicas=8, target_ongoing_requests=4))
        return live_requests_policy(ctx)[0]

    assert decision({"a": 10.0, "b": 6.0}, ongoing_calls=3, queued=4) == 5.0  # (16 + 4) / 4
    assert decision({"a": 1.0, "b": 1.0}, ongoing_calls=3, queued=0) == 0.5
    assert decision(None, ongoing_calls=12, queued=0) == 3.0  # before any report: Serve's count
    assert decision(None, ongoing_calls=3, queued=0, replicas=0) == 0  # at zero: Serve's cold start decides


@pytest.mark.parametrize("bad", [
    {"engine": {"modle": "x"}},
    {"router": {"policy": "lifo"}},
    {"engine": {"engine_args": {"max_num_seq": 4}}},
    {"engine": {"engine_args": {"speculative_config": {"method": "eagle"}}}},
    {"engine": {"engine_args": {"speculative_config": {"method": "ngram", "num_speculative_token": 4}}}},
    {"extra": 1},
    {"engine": {"autoscaling": {"min_replicas": 3, "max_replicas": 2}}},
])
def test_unknown_or_invalid_keys_are_errors(bad):
    with pytest.raises(ValidationError):
        AppConfig.model_validate(bad)


def test_speculative_config_reaches_the_engine_config():
    cfg = AppConfig.model_validate({"engine": {"engine_args": {
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}}}})
    spec = cfg.engine.engine_config.speculative
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max) == ("ngram", 3, 2)


def test_autoscaling_target_must_be_reachable_behind_the_router():
    def cfg(target: float) -> AppConfig:
        return AppConfig.model_validate({
            "engine": {"engine_args": {"max_num_seqs": 8},
                       "autoscaling": {"max_replicas": 2, "target_ongoing_requests": target}},
            "router": {"max_waiting_per_replica": 2}})

    assert cfg(9).engine.autoscaling.target_ongoing_requests == 9
    with pytest.raises(ValidationError, match=r"below max_num_seqs \+ router.max_waiting_per_replica \(10\)"):
        cfg(10)


@pytest.mark.parametrize("config,colocated,router_in_ingress", [
    ({}, True, True),  # one engine replica: its actor takes the front end
    ({"engine": {"num_replicas": 2}}, False, True),  # one ingress replica: the router in it
    ({"engine": {"autoscaling": {"max_replicas": 2}}}, False, True),
    ({"ingress": {"colocated": False}}, False, True),
    ({"ingress": {"num_replicas": 2}}, False, False),  # two ingress replicas share the Router deployment
    ({"engine": {"num_replicas": 2}, "router": {"in_ingress": False}}, False, False),
])
def test_the_front_end_joins_the_engine_replica_and_the_router_the_front_end_only_when_there_is_one(
        config, colocated, router_in_ingress):
    cfg = AppConfig.model_validate(config)
    assert cfg.colocated is colocated and cfg.router_in_ingress is router_in_ingress
    if colocated:
        opts = engine_ingress_deployment_options(cfg)
        assert opts["name"] == "IngressRouterEngine" and "request_router_config" not in opts
        assert opts["ray_actor_options"]["num_cpus"] == pytest.approx(
            cfg.engine.num_cpus + cfg.ingress.num_cpus + cfg.router.num_cpus)
        assert opts["num_replicas"] == 1
    elif router_in_ingress:
        assert ingress_deployment_options(cfg)["ray_actor_options"]["num_cpus"] == pytest.approx(
            cfg.ingress.num_cpus + cfg.router.num_cpus)
    # the deployments Serve would start: colocated, one actor holds front end, router and engine;
    # with the router in the ingress, the split graph has no Router deployment
    expected = ({"IngressRouterEngine"} if colocated else {"IngressRouter", "EngineReplica"} if router_in_ingress
                else {"Ingress", "Router", "EngineReplica"})
    assert _deployment_names(build_app(cfg)) == expected


def test_a_router_in_one_of_several_ingress_replicas_is_an_error():
    with pytest.raises(ValidationError, match="router.in_ingress needs ingress.num_replicas 1"):
        AppConfig.model_validate({"ingress": {"num_replicas": 2}, "router": {"in_ingress": True}})


def _deployments(app) -> set[tuple[str, type]]:
    """The deployments of a bound application graph, (name, class), walking the applications bound
    as arguments."""
    from ray.serve.deployment import Application

    bound = app._bound_deployment
    found = {(bound.name, bound.func_or_class)}
    for arg in (*bound.init_args, *bound.init_kwargs.values()):
        for value in arg.values() if isinstance(arg, dict) else [arg]:  # each model's replicas, by name
            if isinstance(value, Application):
                found |= _deployments(value)
    return found


def _deployment_names(app) -> set[str]:
    return {name for name, _ in _deployments(app)}


TWO_MODELS = {"models": [{"served_model_name": "a"}, {"served_model_name": "b"}]}


def test_each_deployment_class_has_one_role_in_every_graph_and_is_named_after_it():
    """A class deployed in two roles (in one graph the ingress, in another the router too) would make
    every change to it a change to each graph; each class here is one role, its deployment named
    after it (an engine replica deployment per model: `EngineReplica-<model>`)."""
    roles: dict[str, set[str]] = {}
    for config in [{}, {"engine": {"num_replicas": 2}}, {"engine": {"autoscaling": {"max_replicas": 2}}},
                   {"ingress": {"num_replicas": 2}}, {"engine": {"num_replicas": 2}, "router": {"in_ingress": False}},
                   TWO_MODELS, {**TWO_MODELS, "router": {"in_ingress": False}}]:
        for name, cls in _deployments(build_app(AppConfig.model_validate(config))):
            roles.setdefault(cls.__name__, set()).add(name.split("-")[0])
    assert roles == {"IngressRouterEngine": {"IngressRouterEngine"}, "IngressRouter": {"IngressRouter"},
                     "Ingress": {"Ingress"}, "Router": {"Router"}, "EngineReplica": {"EngineReplica"}}


@pytest.mark.parametrize("config", [{"engine": {"num_replicas": 2}}, {"engine": {"autoscaling": {"max_replicas": 2}}},
                                    {"ingress": {"num_replicas": 2}},
                                    {"models": [{"served_model_name": "a"}, {"served_model_name": "b"}]}])
def test_a_colocated_front_end_with_several_engines_is_an_error(config):
    config = {**config, "ingress": {**config.get("ingress", {}), "colocated": True}}
    with pytest.raises(ValidationError, match="ingress.colocated needs exactly one model and one engine replica"):
        AppConfig.model_validate(config)


def test_several_models_each_get_an_engine_replica_deployment_of_their_own():
    cfg = AppConfig.model_validate({"models": [
        {"served_model_name": "small", "num_cpus": 0.5, "engine_args": {"max_num_seqs": 4}},
        {"model": "/models/Qwen3-0.6B", "num_replicas": 2, "num_cpus": 1.0, "resources": {"big": 1}}]})
    assert [m.model_name for m in cfg.served_models] == ["small", "Qwen3-0.6B"]
    assert not cfg.colocated and cfg.router_in_ingress
    small, qwen = (replica_deployment_options(cfg, m) for m in cfg.served_models)
    assert (small["name"], qwen["name"]) == ("EngineReplica-small", "EngineReplica-Qwen3-0.6B")
    assert small["num_replicas"] == 1 and qwen["num_replicas"] == 2
    assert qwen["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 0.0, "resources": {"big": 1}}
    assert _deployment_names(build_app(cfg)) == {"IngressRouter", "EngineReplica-small", "EngineReplica-Qwen3-0.6B"}
    split = cfg.model_copy(update={"router": cfg.router.model_copy(update={"in_ingress": False})})
    assert _deployment_names(build_app(split)) == {"Ingress", "Router", "EngineReplica-small",
                                                   "EngineReplica-Qwen3-0.6B"}


@pytest.mark.parametrize("config,message", [
    ({"engine": {}, "models": [{"served_model_name": "a"}]}, "either `engine`"),
    ({"models": [{"served_model_name": "a"}, {"served_model_name": "a"}]}, "one name"),
    ({"models": [{"model": "/m/x"}, {"model": "/n/x"}]}, "one name"),
    ({"models": [{"served_model_name": "a", "autoscaling": {"max_replicas": 2, "target_ongoing_requests": 500}}]},
     "of model 'a'"),
])
def test_a_models_list_that_cannot_be_served_is_an_error(config, message):
    with pytest.raises(ValidationError, match=message):
        AppConfig.model_validate(config)


def test_the_example_config_of_two_models_loads():
    cfg = load_config(Path(__file__).parents[2] / "configs" / "serve-models.yaml")
    assert len(cfg.served_models) == 2 and not cfg.colocated
