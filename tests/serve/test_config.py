"""Every shipped config parses into AppConfig; unknown keys are errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from serve_app.app import replica_deployment_options
from serve_app.config import AppConfig, load_config

CONFIGS = sorted((Path(__file__).parents[2] / "configs").rglob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_parse(path):
    cfg = load_config(path)
    opts = replica_deployment_options(cfg)
    assert opts["ray_actor_options"]["num_gpus"] == cfg.engine.num_gpus
    assert ("autoscaling_config" in opts) != ("num_replicas" in opts)


def test_gpu_config_takes_one_gpu_per_replica():
    cfg = load_config(Path(__file__).parents[2] / "configs" / "serve-gpu.yaml")
    assert replica_deployment_options(cfg)["ray_actor_options"]["num_gpus"] == 1


@pytest.mark.parametrize("bad", [
    {"engine": {"modle": "x"}},
    {"router": {"policy": "lifo"}},
    {"engine": {"engine_args": {"max_num_seq": 4}}},
    {"extra": 1},
    {"engine": {"autoscaling": {"min_replicas": 3, "max_replicas": 2}}},
])
def test_unknown_or_invalid_keys_are_errors(bad):
    with pytest.raises(ValidationError):
        AppConfig.model_validate(bad)
