"""SLO attainment and goodput per priority class: the rule, the replica's tally, and the
benchmark client's figures agreeing with it on a known workload."""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from conftest import served_local_stack

from serve_app.config import AppConfig
from serve_app.slo import SLOTarget, SLOTracker

sys.path.insert(0, str(Path(__file__).parents[2]))
from benchmarks import serve_bench  # noqa: E402
from benchmarks.workload import Request, Workload  # noqa: E402


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_request_meets_its_slo_only_when_it_meets_every_objective_of_its_class():
    clock = Clock()
    tracker = SLOTracker({0: SLOTarget(ttft_s=1.0, tpot_s=0.2), 1: SLOTarget(ttft_s=10.0)}, window_s=60, clock=clock)
    assert tracker.record(0, 0.5, 0.1, ok=True) == {"ttft": True, "tpot": True, "all": True}
    assert tracker.record(0, 1.5, 0.1, ok=True) == {"ttft": False, "tpot": True, "all": False}
    assert tracker.record(0, 0.5, None, ok=True)["all"]  # one token: no time per token to miss
    assert tracker.record(0, 0.5, 0.1, ok=False) == {"ttft": False, "tpot": False, "all": False}
    assert tracker.record(1, 9.0, 5.0, ok=True) == {"ttft": True, "all": True}
    assert SLOTarget(ttft_s=1.0).objectives() == {"ttft": 1.0}
    assert tracker.record(2, 0.1, 0.1, ok=True) is None  # no objectives for class 2
    clock.now = 30.0
    snap = tracker.snapshot()
    assert snap[0] == {"finished": 4, "met": 2, "met_ttft": 2, "met_tpot": 3, "attainment": 0.5,
                       "goodput_rps": 2 / 60}
    assert snap[1]["attainment"] == 1.0 and 2 not in snap
    clock.now = 61.0  # the window moved past every request: no recent figures, totals stay
    assert tracker.window() == {0: (None, 0.0), 1: (None, 0.0)}
    assert tracker.snapshot()[0]["finished"] == 4


def test_slo_config_is_validated():
    cfg = AppConfig.model_validate({"slo": {"0": {"ttft_s": 1, "tpot_s": 0.2}, 1: {"ttft_s": 10}}})
    assert cfg.slo[0].tpot_s == 0.2 and cfg.slo[1].ttft_s == 10
    for bad in ({0: {"ttft_s": 0}}, {0: {"ttfts": 1}}, {"x": {"ttft_s": 1}}):
        try:
            AppConfig.model_validate({"slo": bad})
        except ValueError:
            continue
        raise AssertionError(f"accepted {bad}")


def test_benchmark_client_and_replicas_agree_on_attainment():
    """Class 0's objectives are generous (all met); class 1's TPOT objective is impossible, so it
    splits the class: its one-token requests (no time per output token) meet it, the rest miss.
    16 streamed requests alternate between the classes. The replicas' tally and serve_bench's
    client-side figures agree request for request."""
    slo = {0: {"ttft_s": 5.0, "tpot_s": 1.0}, 1: {"tpot_s": 1e-6}}
    config = {"engine": {"served_model_name": "fake", "stream_flush_interval_s": 0.0}, "slo": slo}
    workload = Workload([Request(i, [1 + (i + j) % 60 for j in range(4 + i)], 1 if i % 4 == 1 else 4 + i % 8)
                         for i in range(16)])
    with served_local_stack(config, num_replicas=2) as (url, _, replicas):
        args = serve_bench.parse_args(["--base-url", url + "/v1", "--model", "fake", "--warmup", "0",
                                       "--priorities", "0,1", "--num-requests", "16"])
        results, wall, _ = asyncio.run(serve_bench.run_http(args, workload, args.base_url, "fake", None))
        assert all(r.ok for r in results), [r.error for r in results if not r.ok]
        client = serve_bench.slo_summary(results, AppConfig.model_validate({"slo": slo}).slo, wall)
        server: dict[int, dict[str, int]] = {}
        for replica in replicas:
            for priority, row in replica.slo.snapshot().items():
                totals = server.setdefault(priority, dict.fromkeys(("finished", "met", "met_ttft", "met_tpot"), 0))
                for key in totals:
                    totals[key] += row[key]
    assert {p: {k: client[p][k] for k in server[p]} for p in client} == server
    assert server[0] == {"finished": 8, "met": 8, "met_ttft": 8, "met_tpot": 8}
    assert server[1] == {"finished": 8, "met": 4, "met_ttft": 0, "met_tpot": 4}
    assert client[0]["attainment"] == 1.0 and client[1]["attainment"] == 0.5
