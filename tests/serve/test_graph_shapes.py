"""Every shape of the serving graph (docs/DESIGN.md), built by `build_app` from the config, through
each front door that serves it (real Ray Serve, slow): the deployments are the shape's, and one
streamed request comes back whole through each door."""

from __future__ import annotations

import httpx
import pytest
from conftest import fake_serve_app, greedy_text, sse_events
from fake_engine import FakeTokenizer

pytestmark = pytest.mark.slow

# shape -> (config, its deployments, the front doors that serve it)
SHAPES = {
    "colocated": ({"ingress": {"colocated": True}}, {"IngressRouterEngine"}, ("direct", "proxy")),
    "router_in_ingress": ({"engine": {"num_replicas": 2}, "router": {"in_ingress": True}},
                          {"IngressRouter", "EngineReplica"}, ("direct", "proxy")),
    "split": ({"engine": {"num_replicas": 2}, "ingress": {"num_replicas": 2}},
              {"Ingress", "Router", "EngineReplica"}, ("direct", "proxy")),
}


def _streamed(url: str, prompt: str) -> str:
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0,
                                                  "stream": True}, timeout=60)
    assert r.status_code == 200, r.text
    events = sse_events(r.text)
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    return "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])


@pytest.mark.parametrize("shape", SHAPES)
def test_each_graph_shape_streams_through_each_of_its_front_doors(serve_cluster, shape):
    from ray import serve

    config, deployments, doors = SHAPES[shape]
    app = f"shape-{shape.replace('_', '-')}"
    with fake_serve_app(serve_cluster, app, config, step_delay_s=0.005) as url:
        assert set(serve.status().applications[app].deployments) == deployments
        urls = {"proxy": f"{serve_cluster['http']}/{app}"}
        urls["direct"] = url  # the ingress replicas' own port (two share it in the split graph)
        assert urls["proxy"] != url
        for door in doors:
            prompt = f"{shape} through {door}"
            assert _streamed(urls[door], prompt) == greedy_text(FakeTokenizer().encode(prompt), 6), door
