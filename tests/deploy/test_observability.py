"""The shipped Prometheus config and alert rules, checked by promtool (the Debian `prometheus`
package), and the Grafana dashboard provisioned with grafana-client into a loopback stand-in
for Grafana's HTTP API (grafana_standin.py: no Grafana server can run here). The dashboard's
PromQL against a real Prometheus and its metric names against a real scrape:
tests/serve/test_prometheus_e2e.py."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from grafana_client import GrafanaApi
from grafana_client.client import GrafanaUnauthorizedError
from grafana_standin import grafana_standin

from cluster import grafana
from tests.conftest import serving

PROMETHEUS = Path(__file__).resolve().parents[2] / "cluster" / "prometheus"


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([shutil.which("promtool"), *args], capture_output=True, text=True, cwd=PROMETHEUS)


def test_promtool_accepts_the_config_and_rules_and_the_rules_pass_their_unit_tests():
    for args in (("check", "config", "prometheus.yml"), ("check", "rules", "alerts.yml"),
                 ("test", "rules", "alerts_test.yml")):
        done = promtool(*args)
        assert done.returncode == 0, (args, done.stdout, done.stderr)
    assert "SUCCESS: 6 rules found" in promtool("check", "rules", "alerts.yml").stdout


def test_promtool_rejects_a_broken_rule(tmp_path):
    rules = (PROMETHEUS / "alerts.yml").read_text().replace("> 0.95", "> > 0.95")
    (tmp_path / "alerts.yml").write_text(rules)
    done = subprocess.run([shutil.which("promtool"), "check", "rules", str(tmp_path / "alerts.yml")],
                          capture_output=True, text=True)
    assert done.returncode != 0 and "parse error" in done.stdout + done.stderr, (done.stdout, done.stderr)


def test_dashboard_is_rays_serve_dashboard_with_the_cbserve_rows():
    from ray.dashboard.modules.metrics.grafana_dashboard_factory import generate_serve_grafana_dashboard

    ray_panels = json.loads(generate_serve_grafana_dashboard()[0])["panels"]
    dashboard = grafana.build_dashboard()
    panels = dashboard["panels"]
    assert [p["title"] for p in panels[: len(ray_panels)]] == [p["title"] for p in ray_panels]
    ours = panels[len(ray_panels):]
    assert [p["title"] for p in ours if p["type"] == "row"] == [title for title, _ in grafana.ROWS]
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in ours:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel["targets"] and all('application=~"$Application", model=~"$Model"' in t["expr"]
                                        for t in panel["targets"])
    assert any(v["name"] == "Model" and "model)" in v["query"]["query"] for v in dashboard["templating"]["list"])
    # below Ray's panels, no two of ours overlap
    cells = set()
    for panel in ours:
        g = panel["gridPos"]
        area = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not area & cells, panel["title"]
        cells |= area
    assert min(y for _, y in cells) >= max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in ray_panels)
    titles = " ".join(p["title"] for p in ours)
    for wanted in ("queue depth", "Admission wait", "SLO attainment", "Goodput", "Batch per step", "KV cache",
                   "Preemptions and swaps", "Speculative decoding", "Time to first token", "Time per output token"):
        assert wanted in titles


@pytest.fixture
def standin():
    app, state = grafana_standin(token="t0ken")
    with serving(app) as (url, _):
        yield url, state


def test_provisioning_creates_then_updates_in_place(standin):
    url, state = standin
    api = GrafanaApi.from_url(url, credential="t0ken")
    first = grafana.provision(api, "http://prometheus:9090")
    assert first["url"] == "/d/cbserve/cbserve"
    assert list(state["datasources"]) == [grafana.DATASOURCE_UID]
    assert state["datasources"][grafana.DATASOURCE_UID]["url"] == "http://prometheus:9090"
    assert list(state["folders"]) == [grafana.FOLDER_UID]
    saved = state["dashboards"][grafana.DASHBOARD_UID]
    assert saved["meta"]["folderUid"] == grafana.FOLDER_UID and saved["dashboard"]["version"] == 1
    variable = next(v for v in saved["dashboard"]["templating"]["list"] if v["type"] == "datasource")
    assert variable["current"]["value"] == grafana.DATASOURCE_UID

    # again, with Prometheus moved: nothing duplicated, the datasource updated, the dashboard a new version
    grafana.provision(api, "http://prometheus.monitoring:9090")
    assert list(state["datasources"]) == [grafana.DATASOURCE_UID]
    datasource = state["datasources"][grafana.DATASOURCE_UID]
    assert datasource["url"] == "http://prometheus.monitoring:9090" and datasource["version"] == 2
    assert list(state["folders"]) == [grafana.FOLDER_UID]
    assert list(state["dashboards"]) == [grafana.DASHBOARD_UID]
    again = state["dashboards"][grafana.DASHBOARD_UID]["dashboard"]
    assert again["version"] == 2
    assert {k: v for k, v in again.items() if k != "version"} == {k: v for k, v in saved["dashboard"].items()
                                                                  if k != "version"}


def test_provisioning_with_basic_auth_and_a_wrong_token(standin):
    url, state = standin
    grafana.main(["--grafana-url", url, "--user", "admin", "--password", "admin",
                  "--prometheus-url", "http://p:9090"])
    assert grafana.DASHBOARD_UID in state["dashboards"]
    with pytest.raises(GrafanaUnauthorizedError):
        grafana.provision(GrafanaApi.from_url(url, credential="wrong"), "http://p:9090")


def test_cli_writes_the_dashboard_json(tmp_path):
    out = tmp_path / "dashboard.json"
    grafana.main(["--out", str(out)])
    assert json.loads(out.read_text()) == grafana.build_dashboard()
