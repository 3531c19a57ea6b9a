"""The engine replicas' autoscaling policy: Serve's default rule on the requests inside them.

Serve's default policy scales on the calls ongoing at a deployment's replicas. An ingress sends a
replica the requests that come together in one call (serve_app.replicas), and their chunks come
over one channel a caller, so Serve's count is of channels, not requests. Each replica reports the requests inside it
(`EngineReplica.record_autoscaling_stats`), and this policy applies the default rule to those:
as many replicas as the requests inside them and the calls queued at Serve's handles, over
`target_ongoing_requests`. Serve applies the rest of the autoscaling config around it (bounds,
scaling factors, up- and downscale delays).
"""

from __future__ import annotations

from typing import Any

LIVE_REQUESTS = "live_requests"
POLICY = "serve_app.autoscaling:live_requests_policy"


def live_requests_policy(ctx: Any) -> tuple[float, dict[str, Any]]:
    """`ctx`: Serve's AutoscalingContext. Until some replica has reported, Serve's own count."""
    if ctx.current_num_replicas == 0:
        return ctx.target_num_replicas, {}
    live = (ctx.aggregated_metrics or {}).get(LIVE_REQUESTS) or {}
    if live:
        demand = sum(live.values()) + (ctx.total_queued_requests or 0.0)
    else:
        demand = ctx.total_num_requests
    return demand / ctx.config.get_target_ongoing_requests(), {}
