"""A real Prometheus (the Debian package) scraping the app on the test cluster (slow).

The shipped cluster/prometheus/prometheus.yml and alerts.yml are used as they are, except that the
service-discovery file is the test cluster's, targets are relabelled to loopback, scrapes run every
3 s and rule evaluation every second. The app runs the real engine on a tiny model with a KV cache
too small for its batch (preemptions) behind a small admission queue (queue depth, rejections),
under a closed loop of clients for long enough that several scrapes catch the load.
Then, through Prometheus' HTTP API: the queue, batch, KV, TTFT, preemption and rejection series
moved as the traffic implies; every alert rule evaluates without error; every PromQL expression
of the Grafana dashboard evaluates, and the cbserve ones return data; and every cbserve metric
name the dashboard and the alerts use is on a real scrape of the nodes.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml
from conftest import free_port, metrics_of_every_node, run_app

from cluster import grafana

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]
SHIPPED = ROOT / "cluster" / "prometheus"
APP = "prom"
WORKERS = 24
LOAD_S = 10.0
MAX_QUEUED = 6
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def prom_app(serve_cluster, tiny_llama_words):
    from ray import serve

    from serve_app.config import AppConfig

    cfg = AppConfig.model_validate({
        "engine": {"model": tiny_llama_words, "served_model_name": "tiny", "num_replicas": 1, "num_cpus": 0.5,
                   "engine_args": {"max_num_seqs": 8, "num_blocks": 24, "block_size": 16, "seed": 0}},
        "router": {"max_waiting_per_replica": 4, "max_queued_requests": MAX_QUEUED},
        "slo": {0: {"ttft_s": 600, "tpot_s": 60}, 1: {"ttft_s": 1e-4, "tpot_s": 60}},
    })
    url = run_app(cfg, APP)
    deadline = time.time() + 120
    while httpx.get(url + "/health", timeout=10).status_code != 200:
        assert time.time() < deadline, "app not healthy"
        time.sleep(0.5)
    yield url
    serve.delete(APP)


def _config_for(ray_tmpdir: Path, out: Path) -> Path:
    """The shipped config, pointed at the test cluster, scraping every 3 s (a node's /metrics under
    the load of 2 busy cores can take over a second, and a scrape that times out keeps no sample)
    and evaluating the rules every second."""
    config = yaml.safe_load((SHIPPED / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="3s", scrape_timeout="3s", evaluation_interval="1s")
    config["rule_files"] = [str(SHIPPED / f) for f in config["rule_files"]]
    (job,) = config["scrape_configs"]
    job["file_sd_configs"] = [{"files": [str(ray_tmpdir / "session_latest" / "prom_metrics_service_discovery.json")]}]
    job["relabel_configs"] = [{"source_labels": ["__address__"], "regex": r"[^:]+:(\d+)",
                               "replacement": "127.0.0.1:$1", "target_label": "__address__"}]
    path = out / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def prometheus(serve_cluster, prom_app, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prometheus")
    config = _config_for(serve_cluster["ray_tmpdir"], tmp)
    check = subprocess.run(["promtool", "check", "config", str(config)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    port = free_port()
    proc = subprocess.Popen(
        [shutil.which("prometheus"), f"--config.file={config}", f"--storage.tsdb.path={tmp / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=subprocess.DEVNULL, stderr=open(tmp / "prometheus.log", "w"))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline, targets = time.time() + 60, []
        while True:
            try:
                r = httpx.get(url + "/api/v1/targets", timeout=5)  # 503 until Prometheus is ready
                targets = r.json()["data"]["activeTargets"] if r.status_code == 200 else []
            except httpx.HTTPError:  # not listening yet
                targets = []
            if targets and all(t["health"] == "up" for t in targets):
                break
            assert proc.poll() is None, (tmp / "prometheus.log").read_text()
            assert time.time() < deadline, f"targets not up: {targets}"
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def query(prometheus: str, expr: str) -> list[dict]:
    body = httpx.get(prometheus + "/api/v1/query", params={"query": expr}, timeout=10).json()
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def scalar(prometheus: str, expr: str) -> float:
    result = query(prometheus, expr)
    assert result, f"no series: {expr}; cbserve series: " + str(
        [r["metric"] for r in query(prometheus, '{__name__=~"ray_cbserve_.*_count|ray_cbserve_router_.*"}')][:5]) + \
        f"; targets: {_targets(prometheus)}"
    return float(result[0]["value"][1])


def _targets(prometheus: str) -> list[tuple]:
    """Each scrape target's URL, health, last error and last scrape's seconds (what a failure shows)."""
    targets = httpx.get(prometheus + "/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
    return [(t["scrapeUrl"], t["health"], t["lastError"], t["lastScrapeDuration"]) for t in targets]


async def _traffic(url: str) -> list[tuple[int, int]]:
    """WORKERS clients, classes 0 and 1, each sending MAX_TOKENS-token completions one after
    another for LOAD_S seconds (pausing 0.1 s after a 429): (priority, status) of each request."""
    async with httpx.AsyncClient(timeout=300) as client:
        async def worker(i: int) -> list[tuple[int, int]]:
            done, end = [], time.monotonic() + LOAD_S
            while time.monotonic() < end:
                r = await client.post(url + "/v1/completions", json={
                    "model": "tiny", "prompt": f"the cat {i} sat on the mat and dogs ran", "max_tokens": MAX_TOKENS,
                    "ignore_eos": True, "temperature": 0, "priority": i % 2})
                done.append((i % 2, r.status_code))
                if r.status_code == 429:
                    await asyncio.sleep(0.1)
            return done

        return [outcome for done in await asyncio.gather(*(worker(i) for i in range(WORKERS))) for outcome in done]


@pytest.fixture(scope="module")
def traffic(prom_app, prometheus):
    outcomes = asyncio.run(_traffic(prom_app))
    assert {code for _, code in outcomes} <= {200, 429}, outcomes
    return outcomes


def _eventually(check, timeout_s: float = 60):
    deadline = time.time() + timeout_s
    while True:
        try:
            return check()
        except AssertionError:
            if time.time() > deadline:
                raise
            time.sleep(1)


def test_queue_batch_kv_ttft_preemption_and_rejection_series_moved(prometheus, traffic):
    ok = {p: sum(1 for q, code in traffic if (q, code) == (p, 200)) for p in (0, 1)}
    rejected = sum(1 for _, code in traffic if code == 429)
    assert ok[0] and ok[1] and rejected, traffic
    app = f'application="{APP}"'

    def moved():
        assert scalar(prometheus, f"max(max_over_time(ray_cbserve_router_queue_depth{{{app}}}[10m]))") >= 1
        assert scalar(prometheus, f"max(max_over_time(ray_cbserve_replica_num_running{{{app}}}[10m]))") >= 2
        assert scalar(prometheus, f"max(max_over_time(ray_cbserve_replica_kv_usage{{{app}}}[10m]))") >= 0.5
        assert scalar(prometheus, f"sum(ray_cbserve_ttft_s_count{{{app}}})") == ok[0] + ok[1]
        assert scalar(prometheus, f"sum(ray_cbserve_generation_tokens_total{{{app}}})") \
            == MAX_TOKENS * (ok[0] + ok[1])
        assert scalar(prometheus, f"max(ray_cbserve_engine_num_preemptions_recompute{{{app}}})") >= 1
        assert scalar(prometheus, f'sum(ray_cbserve_router_rejections_total{{{app}, reason="queue_full"}})') \
            == rejected
        assert scalar(prometheus, f"max(max_over_time(ray_cbserve_replica_num_running{{{app}}}[10m]))") <= 8
        # class 1's TTFT objective (0.1 ms) is missed by every request, class 0's met by every one
        slo = f'ray_cbserve_slo_requests_total{{{app}, objective="all"'
        assert scalar(prometheus, f'sum({slo}, priority="1", verdict="missed"}})') == ok[1]
        assert scalar(prometheus, f'sum({slo}, priority="0", verdict="met"}})') == ok[0]

    _eventually(moved)


def test_every_alert_rule_evaluates_on_the_apps_series(prometheus, traffic):
    def healthy():
        groups = httpx.get(prometheus + "/api/v1/rules", timeout=10).json()["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        assert len(rules) == 6 and all(r["health"] == "ok" for r in rules), \
            [(r["name"], r["health"], r.get("lastError")) for r in rules]
        return rules

    _eventually(healthy)


def _grafana_variables(expr: str) -> str:
    return (expr.replace("$__rate_interval", "1m").replace("${datasource}", "")
            .replace("$Application", APP))


def test_every_dashboard_expression_evaluates_and_the_cbserve_ones_return_data(prometheus, traffic):
    exprs = grafana.expressions(grafana.build_dashboard())
    assert len(exprs) > 40

    def evaluated():
        empty = []
        for expr in exprs:
            concrete = re.sub(r"\$\{?\w+\}?", ".*", _grafana_variables(expr))
            # Grafana's label_values(series, label) lists the label's values of the series
            concrete = re.sub(r"^label_values\((.*), *\w+\)$", r"\1", concrete)
            result = query(prometheus, concrete)
            if grafana.CBSERVE_METRIC.search(expr) and not result:
                empty.append(concrete)
        assert not empty, empty

    _eventually(evaluated)


def test_every_cbserve_metric_name_used_is_on_a_real_scrape(prom_app, traffic):
    used = {m for e in grafana.expressions(grafana.build_dashboard()) for m in grafana.CBSERVE_METRIC.findall(e)}
    used |= set(grafana.CBSERVE_METRIC.findall((SHIPPED / "alerts.yml").read_text()))
    assert len(used) >= 25

    def scraped():
        names = set(re.findall(r"^(ray_cbserve_\w+)[{ ]", metrics_of_every_node(), re.M))
        assert not used - names, sorted(used - names)

    _eventually(scraped)
