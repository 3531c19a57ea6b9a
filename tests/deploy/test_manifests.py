"""The deployment files, checked with the tools and schemas that will read them: Ray's cluster
launcher validation, kustomize, the KubeRay RayService CRD (v1.7.0, crds/), Kubernetes' own
schemas (kubernetes-validate --strict), Ray Serve's config schema and ours. No Kubernetes API
server runs here: reconciliation by KubeRay on a real cluster is not tested."""
from __future__ import annotations

import copy
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import kubernetes_validate.utils
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config
from ray.serve.schema import ServeDeploySchema

from cluster import k8s
from serve_app.config import AppConfig

ROOT = Path(__file__).resolve().parents[2]
CRDS = Path(__file__).parent / "crds"
OVERLAYS = ["cpu-dev", "gpu-prod", "multi-model"]
KUBERNETES_VERSION = kubernetes_validate.utils.latest_version()


def _strict(schema: dict) -> dict:
    """A CRD's OpenAPI schema as the API server applies it, in JSON Schema: unknown fields are
    errors (except where the CRD preserves them), int-or-string takes either, int32/int64 have
    their ranges, `nullable` admits null. Defaults are not applied (they fill, never reject)."""
    schema = dict(schema)
    if schema.get("x-kubernetes-int-or-string"):
        schema.pop("type", None)
        schema["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    bits = {"int32": 31, "int64": 63}.get(schema.get("format"))
    if bits and schema.get("type") == "integer":
        schema.setdefault("minimum", -(2 ** bits))
        schema.setdefault("maximum", 2 ** bits - 1)
    if schema.get("nullable") and "type" in schema:
        schema["type"] = [schema["type"], "null"]
    if "properties" in schema:
        schema["properties"] = {k: _strict(v) for k, v in schema["properties"].items()}
        if not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema.setdefault("additionalProperties", False)
    if isinstance(schema.get("additionalProperties"), dict):
        schema["additionalProperties"] = _strict(schema["additionalProperties"])
    if "items" in schema:
        schema["items"] = _strict(schema["items"])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in schema:
            schema[key] = [_strict(s) for s in schema[key]]
    return schema


def _crd_validator(kind: str) -> jsonschema.Draft7Validator:
    crd = yaml.safe_load((CRDS / f"ray.io_{kind.lower()}s.yaml").read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    schema = _strict(version["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = {"type": "object", "required": ["name"],
                                        "properties": {"name": {"type": "string"}}}
    return jsonschema.Draft7Validator(schema)


VALIDATORS = {"RayService": _crd_validator("RayService")}


def validate_document(doc: dict) -> None:
    """Raises for a document its reader would refuse."""
    if doc["apiVersion"].startswith("ray.io/"):
        VALIDATORS[doc["kind"]].validate(doc)
        if doc["kind"] == "RayService":
            validate_serve_config(doc["spec"]["serveConfigV2"])
    elif doc["apiVersion"].startswith("monitoring.coreos.com/"):
        assert doc["kind"] == "PodMonitor"  # no schema here: checked against the pods below
    else:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def validate_serve_config(text: str) -> None:
    config = ServeDeploySchema.model_validate(yaml.safe_load(text))
    for app in config.applications:
        AppConfig.model_validate(app.args)


def render(overlay: str) -> list[dict]:
    kubectl = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
    out = subprocess.run([kubectl, "kustomize", str(ROOT / "k8s" / "overlays" / overlay)], check=True,
                         capture_output=True, text=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, render(request.param)


def test_generated_manifests_agree_with_the_serve_configs():
    assert k8s.stale() == []
    service = yaml.safe_load((ROOT / "k8s" / "base" / "rayservice.yaml").read_text())
    served = yaml.safe_load(service["spec"]["serveConfigV2"])
    source = yaml.safe_load((ROOT / "configs" / "serve.yaml").read_text())
    assert served["applications"] == source["applications"]
    assert served["http_options"] == source["http_options"] | {"host": "0.0.0.0"}


def test_every_rendered_document_validates(rendered):
    overlay, docs = rendered
    assert sorted(d["kind"] for d in docs) == ["PodMonitor", "RayService", "Service"]
    for doc in docs:
        validate_document(doc)


def test_overlays_place_engines_as_intended(rendered):
    overlay, docs = rendered
    service = next(d for d in docs if d["kind"] == "RayService")
    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # the head runs no replicas
    assert cluster["enableInTreeAutoscaling"] is True
    (workers,) = cluster["workerGroupSpecs"]
    limits = workers["template"]["spec"]["containers"][0]["resources"]["limits"]
    args = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"]
    if overlay == "multi-model":  # every model's replica fits in a worker pod, on the CPU
        assert len(args["models"]) == 2 and "nvidia.com/gpu" not in limits
        assert all(m["engine_args"]["device"] == "cpu" and float(limits["cpu"]) >= m["num_cpus"]
                   for m in args["models"])
        return
    engine = args["engine"]
    if overlay == "gpu-prod":
        assert limits["nvidia.com/gpu"] == "1" and workers["rayStartParams"]["num-gpus"] == "1"
        assert engine["num_gpus"] == 1 and engine["engine_args"]["device"] == "cuda"
        assert (workers["minReplicas"], workers["maxReplicas"]) == (1, 8)
    else:
        assert "nvidia.com/gpu" not in limits and engine["engine_args"]["device"] == "cpu"
        assert float(limits["cpu"]) >= engine["num_cpus"]  # a replica fits in a worker pod


def test_monitor_and_service_select_the_ray_pods(rendered):
    overlay, docs = rendered
    service, monitor, api = (next(d for d in docs if d["kind"] == k) for k in ("RayService", "PodMonitor", "Service"))
    cluster = service["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for group in groups:
        template = group["template"]
        labels = template["metadata"]["labels"]
        assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
        ports = {p["name"] for p in template["spec"]["containers"][0]["ports"]}
        assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} <= ports
        assert group["rayStartParams"]["metrics-export-port"] == "8080"
    head_ports = {p["name"]: p["containerPort"] for p in groups[0]["template"]["spec"]["containers"][0]["ports"]}
    serve_port = yaml.safe_load(service["spec"]["serveConfigV2"])["http_options"]["port"]
    assert head_ports[api["spec"]["ports"][0]["targetPort"]] == serve_port


def _mutated(doc: dict, change) -> dict:
    doc = copy.deepcopy(doc)
    change(doc)
    return doc


def _cluster(doc: dict) -> dict:
    return doc["spec"]["rayClusterConfig"]


@pytest.mark.parametrize("change", [
    lambda d: _cluster(d).__setitem__("workerGroupSpec", _cluster(d).pop("workerGroupSpecs")),  # misspelt
    lambda d: _cluster(d)["workerGroupSpecs"][0]["rayStartParams"].__setitem__("num-gpus", 1),  # not a string
    lambda d: _cluster(d)["workerGroupSpecs"][0].__setitem__("maxReplicas", 2 ** 31),  # over int32
    lambda d: _cluster(d)["headGroupSpec"]["template"]["spec"]["containers"][0].__setitem__("imagePullPolicyy", "x"),
    lambda d: d["spec"].__setitem__("serveConfigV2", d["spec"]["serveConfigV2"].replace(
        "max_num_seqs", "max_num_seq")),  # an engine argument that does not exist
    lambda d: d["spec"].__setitem__("serveConfigV2", d["spec"]["serveConfigV2"].replace(
        "applications", "aplications")),
], ids=["misspelt-field", "gpu-count-as-integer", "int32-range", "pod-template-typo", "unknown-engine-arg",
        "serve-config-typo"])
def test_broken_rayservice_is_refused(change):
    doc = next(d for d in render("gpu-prod") if d["kind"] == "RayService")
    validate_document(doc)
    with pytest.raises((jsonschema.ValidationError, ValueError)):
        validate_document(_mutated(doc, change))


def test_broken_core_document_is_refused():
    doc = next(d for d in render("cpu-dev") if d["kind"] == "Service")
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_document(_mutated(doc, lambda d: d["spec"].__setitem__("portz", [])))


@pytest.mark.parametrize("name", ["ray-cluster-gpu.yaml", "ray-cluster-cpu.yaml"])
def test_cluster_launcher_configs_pass_rays_validation(name):
    config = yaml.safe_load((ROOT / "cluster" / name).read_text())
    validate_config(prepare_config(config))  # what `ray up` runs first
    broken = copy.deepcopy(config)
    broken["available_node_types"][next(iter(broken["available_node_types"]))]["resourcez"] = {}
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(broken))


def test_every_image_and_manifest_installs_the_header_deadline_the_launcher_installs():
    """Serve's proxy on a cluster reads the same callback `make serve` sets: each file that names
    one names the launcher's, and it imports."""
    import importlib
    import re

    from serve_app.launch import HEADER_DEADLINE_ENV

    [(name, expected)] = HEADER_DEADLINE_ENV.items()
    files = [ROOT / "k8s" / "Dockerfile", *(ROOT / "k8s").rglob("*.yaml")]
    named = {path.name: re.findall(rf"{name}[=\s\S]{{0,40}}?(serve_app\.[\w.]+:\w+)", path.read_text())
             for path in files if name in path.read_text()}
    assert named and all(found == [expected] * len(found) and found for found in named.values()), named
    module, function = expected.split(":")
    assert callable(getattr(importlib.import_module(module), function))
