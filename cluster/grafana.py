"""The cbserve Grafana dashboard, and its provisioning into a Grafana with grafana-client.

The dashboard is Ray's generated Serve dashboard (requests, errors, latency and replicas per
deployment, as `ray.dashboard` builds it) with the cbserve rows below it: admission queue and SLO
by priority class, the engine's batch, KV cache and preemptions, and latency percentiles. Both
read the same Prometheus and share Ray's `datasource` and `Application` variables; the cbserve
rows also filter by `Model` (the served models of an app that serves several).

    python -m cluster.grafana --out dashboard.json                      # the JSON only
    python -m cluster.grafana --grafana-url http://grafana:3000 --prometheus-url http://prometheus:9090

Provisioning is idempotent: the datasource, folder and dashboard keep fixed uids and are updated
in place when they exist.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import dataclass
from typing import Any

DASHBOARD_UID = "cbserve"
DATASOURCE_UID = "cbserve-prometheus"
FOLDER_UID = "cbserve"
APP = 'application=~"$Application", model=~"$Model"'
MODEL_VARIABLE = {  # shaped as Ray's Application variable; the `model` label of every cbserve series
    "allValue": ".*", "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
    "datasource": "${datasource}", "definition": "label_values(ray_cbserve_replica_ready{}, model)",
    "hide": 0, "includeAll": True, "label": "Model", "multi": True, "name": "Model", "options": [],
    "query": {"query": "label_values(ray_cbserve_replica_ready{}, model)",
              "refId": "Prometheus-Instance-Variable-Query"},
    "refresh": 1, "regex": "", "skipUrlSync": False, "sort": 1, "type": "query",
}


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str
    targets: tuple[tuple[str, str], ...]  # (PromQL, legend)
    description: str = ""


def _quantiles(metric: str, by: str = "priority") -> tuple[tuple[str, str], ...]:
    return tuple(
        (f"histogram_quantile({q}, sum by ({by}, le) (rate({metric}_bucket{{{APP}}}[$__rate_interval])))",
         f"p{round(q * 100)} {{{{{by}}}}}")
        for q in (0.5, 0.99))


def _attainment(objective: str) -> str:
    """Met / finished; a class none of whose requests met the objective has no `met` series."""
    met, finished = (f'sum by (priority) (increase(ray_cbserve_slo_requests_total{{{APP}, objective="{objective}"'
                     f'{verdict}}}[$__rate_interval]))' for verdict in (', verdict="met"', ""))
    return f"({met} or 0 * {finished}) / {finished}"


ROWS: tuple[tuple[str, tuple[Panel, ...]], ...] = (
    ("cbserve: admission and SLO by priority class", (
        Panel("Admission queue depth", "short", (
            (f"sum by (priority) (ray_cbserve_router_queue_depth{{{APP}}})", "priority {{priority}}"),),
            "Requests the router holds until a replica has room, per priority class."),
        Panel("Admission wait", "s", _quantiles("ray_cbserve_router_admission_wait_s"),
              "From arrival at the router to dispatch to a replica."),
        Panel("Rejections", "reqps", (
            (f"sum by (reason) (rate(ray_cbserve_router_rejections_total{{{APP}}}[$__rate_interval]))",
             "{{reason}}"),), "Requests refused by the router (429/413), by reason."),
        Panel("SLO attainment", "percentunit", (
            (_attainment("all"), "priority {{priority}}"),
            (_attainment("ttft"), "priority {{priority}} TTFT"),
            (_attainment("tpot"), "priority {{priority}} TPOT")),
            "Share of finished requests that met their class's objectives."),
        Panel("Goodput", "reqps", (
            (f"sum by (priority) (ray_cbserve_goodput_rps{{{APP}}})", "priority {{priority}}"),),
            "Requests per second that met every objective of their class (last minute)."),
        Panel("Latency objectives", "s", (
            (f"max by (priority, objective) (ray_cbserve_slo_objective_s{{{APP}}})",
             "priority {{priority}} {{objective}}"),)),
    )),
    ("cbserve: engine", (
        Panel("Requests in the engine", "short", (
            (f"sum by (replica) (ray_cbserve_replica_num_running{{{APP}}})", "running {{replica}}"),
            (f"sum by (replica) (ray_cbserve_replica_num_waiting{{{APP}}})", "waiting {{replica}}"),
            (f"sum by (replica) (ray_cbserve_engine_num_swapped{{{APP}}})", "swapped {{replica}}"))),
        Panel("Batch per step", "short", (
            (f"avg by (replica) (ray_cbserve_engine_batch_size{{{APP}}})", "requests {{replica}}"),
            (f"avg by (replica) (ray_cbserve_engine_batch_tokens{{{APP}}})", "tokens {{replica}}"))),
        Panel("KV cache usage", "percentunit", (
            (f"max by (replica) (ray_cbserve_replica_kv_usage{{{APP}}})", "{{replica}}"),
            (f"avg by (replica) (ray_cbserve_engine_prefix_cache_hit_rate{{{APP}}})",
             "prefix-cache hit rate {{replica}}"))),
        Panel("Preemptions and swaps", "ops", (
            (f"sum by (replica) (rate(ray_cbserve_engine_num_preemptions_recompute{{{APP}}}[$__rate_interval]))",
             "recompute {{replica}}"),
            (f"sum by (replica) (rate(ray_cbserve_engine_num_preemptions_swap{{{APP}}}[$__rate_interval]))",
             "swap {{replica}}"),
            (f"sum by (replica) (rate(ray_cbserve_engine_num_blocks_swapped_out{{{APP}}}[$__rate_interval]))",
             "blocks out {{replica}}"),
            (f"sum by (replica) (rate(ray_cbserve_engine_num_blocks_swapped_in{{{APP}}}[$__rate_interval]))",
             "blocks in {{replica}}")),
            "Per second. The engine's counts are gauges that grow until it restarts; rate() reads "
            "them as counters."),
        Panel("Step time", "s", (
            (f"avg by (replica) (ray_cbserve_engine_step_latency_s{{{APP}}})", "step {{replica}}"),
            (f"avg by (replica) (ray_cbserve_engine_scheduler_overhead_s{{{APP}}})", "scheduler {{replica}}"))),
        Panel("Tokens", "short", (
            (f"sum by (priority) (rate(ray_cbserve_generation_tokens_total{{{APP}}}[$__rate_interval]))",
             "generated/s priority {{priority}}"),
            (f"sum by (priority) (rate(ray_cbserve_prompt_tokens_total{{{APP}}}[$__rate_interval]))",
             "prompt/s priority {{priority}}"))),
        Panel("Speculative decoding", "short", (
            (f"avg by (replica) (ray_cbserve_engine_spec_acceptance_rate{{{APP}}})", "acceptance rate {{replica}}"),
            (f"avg by (replica) (ray_cbserve_engine_spec_mean_accepted_length{{{APP}}})",
             "accepted drafts per step {{replica}}"),
            (f"sum by (replica) (rate(ray_cbserve_engine_num_spec_accepted_tokens{{{APP}}}[$__rate_interval]))",
             "accepted drafts/s {{replica}}")),
            "Draft tokens the target accepted (0 without speculative_config)."),
        Panel("Replicas ready", "short", (
            (f"sum (ray_cbserve_replica_ready{{{APP}}})", "ready"),
            (f"count by (quantization, dtype, device) (ray_cbserve_engine_info{{{APP}}})",
             "{{quantization}} {{dtype}} {{device}}")),
            "Engines taking requests, and how they compute."),
        Panel("Quantization", "short", (
            (f"avg by (replica) (ray_cbserve_model_weight_bytes_per_token{{{APP}}}) / 1e6",
             "MB read per decode step {{replica}}"),
            (f"avg by (replica) (ray_cbserve_model_top1_agreement{{{APP}}})", "top-1 agreement {{replica}}"),
            (f"avg by (replica) (ray_cbserve_model_perplexity_increase{{{APP}}})",
             "perplexity increase {{replica}}")),
            "The start-up check against fp32 on the shipped text (fp32 itself: 1 and 0)."),
    )),
    ("cbserve: latency by priority class", (
        Panel("Time to first token", "s", _quantiles("ray_cbserve_ttft_s"), "From arrival at the router."),
        Panel("Time per output token", "s", _quantiles("ray_cbserve_tpot_s")),
        Panel("Request latency", "s", _quantiles("ray_cbserve_e2e_latency_s")),
    )),
)


def _panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    return {
        "id": panel_id, "type": "timeseries", "title": panel.title, "description": panel.description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"x": x, "y": y, "w": 8, "h": 8},
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "options": {"legend": {"displayMode": "table", "placement": "bottom", "calcs": ["lastNotNull", "max"]}},
        "targets": [{"expr": expr, "legendFormat": legend, "refId": chr(ord("A") + i),
                     "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                    for i, (expr, legend) in enumerate(panel.targets)],
    }


def _ray_serve_dashboard() -> dict[str, Any]:
    from ray.dashboard.modules.metrics.grafana_dashboard_factory import generate_serve_grafana_dashboard

    content, _ = generate_serve_grafana_dashboard()
    return json.loads(content)


def build_dashboard() -> dict[str, Any]:
    """Ray's Serve dashboard with the cbserve rows appended below its panels."""
    dashboard = _ray_serve_dashboard()
    panels = dashboard["panels"]
    y = max((p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels), default=0)
    panel_id = max((p.get("id", 0) for p in panels), default=0)
    for title, row in ROWS:
        panel_id += 1
        panels.append({"id": panel_id, "type": "row", "title": title, "collapsed": False,
                       "gridPos": {"x": 0, "y": y, "w": 24, "h": 1}, "panels": []})
        y += 1
        for i, panel in enumerate(row):
            panel_id += 1
            panels.append(_panel_json(panel, panel_id, 8 * (i % 3), y + 8 * (i // 3)))
        y += 8 * ((len(row) + 2) // 3)
    dashboard["templating"]["list"].append(MODEL_VARIABLE)
    dashboard.update(uid=DASHBOARD_UID, title="cbserve", id=None, tags=["cbserve", "ray", "serve"],
                     version=0)
    dashboard.pop("rayMeta", None)
    return dashboard


def expressions(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression of the dashboard's panels and variables."""
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", []) if t.get("expr")]
    for variable in dashboard.get("templating", {}).get("list", []):
        query = variable.get("query")
        if isinstance(query, dict):
            query = query.get("query")
        if variable.get("type") == "query" and query:
            exprs.append(query)
    return exprs


CBSERVE_METRIC = re.compile(r"\bray_cbserve_[a-z0-9_]+")


def provision(api: Any, prometheus_url: str) -> dict[str, str]:
    """Creates or updates the Prometheus datasource, the `cbserve` folder and the dashboard in the
    Grafana behind `api` (a grafana_client.GrafanaApi). Returns the uids and the dashboard's URL."""
    from grafana_client.client import GrafanaClientError

    def missing(call, *args) -> bool:
        try:
            call(*args)
        except GrafanaClientError as e:
            if e.status_code == 404:
                return True
            raise
        return False

    datasource = {"uid": DATASOURCE_UID, "name": "cbserve Prometheus", "type": "prometheus",
                  "access": "proxy", "url": prometheus_url, "isDefault": False,
                  "jsonData": {"httpMethod": "POST", "timeInterval": "10s"}}
    if missing(api.datasource.get_datasource_by_uid, DATASOURCE_UID):
        api.datasource.create_datasource(datasource)
    else:
        api.datasource.update_datasource_by_uid(DATASOURCE_UID, datasource)
    if missing(api.folder.get_folder, FOLDER_UID):
        api.folder.create_folder("cbserve", uid=FOLDER_UID)

    dashboard = build_dashboard()
    for variable in dashboard["templating"]["list"]:
        if variable.get("type") == "datasource":
            variable["current"] = {"text": datasource["name"], "value": DATASOURCE_UID}
    saved = api.dashboard.update_dashboard({"dashboard": dashboard, "folderUid": FOLDER_UID, "overwrite": True,
                                            "message": "provisioned by cluster.grafana"})
    return {"datasource": DATASOURCE_UID, "folder": FOLDER_UID, "dashboard": DASHBOARD_UID,
            "url": saved.get("url", "")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m cluster.grafana", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the dashboard JSON here instead of provisioning")
    parser.add_argument("--grafana-url", help="e.g. http://grafana:3000")
    parser.add_argument("--prometheus-url", default="http://prometheus:9090",
                        help="the Prometheus Grafana should query (as Grafana's server reaches it)")
    parser.add_argument("--token", default=os.environ.get("GRAFANA_TOKEN"),
                        help="a service-account token (default: $GRAFANA_TOKEN); else --user/--password")
    parser.add_argument("--user", default=os.environ.get("GRAFANA_USER", "admin"))
    parser.add_argument("--password", default=os.environ.get("GRAFANA_PASSWORD", "admin"))
    args = parser.parse_args(argv)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(build_dashboard(), f, indent=1)
        return
    if not args.grafana_url:
        parser.error("give --grafana-url to provision, or --out to write the JSON")
    from grafana_client import GrafanaApi

    api = GrafanaApi.from_url(args.grafana_url, credential=args.token or (args.user, args.password))
    print(json.dumps(provision(api, args.prometheus_url)))


if __name__ == "__main__":
    main()
