"""Online serving benchmark: replays a seeded workload over HTTP against an OpenAI-compatible server.

Every request is a streaming `/v1/completions` call (token-id prompts by default, `--text-prompts`
for servers that only take text) with `temperature=0`, `ignore_eos=true` and `max_tokens` set, so
each request generates exactly its output length. Arrivals are Poisson at `--rate` req/s
(`inf`: all at t=0, i.e. a saturating burst). The default workload is the offline benchmark's
(benchmarks/workload.py: 64 requests, prompts log-uniform 16-512 tokens, outputs 8-256).

Per request: TTFT (send -> first SSE event carrying a choice, i.e. generated tokens), TPOT
((e2e - TTFT) / (output tokens - 1)), e2e latency, output tokens (the `usage` of the final event,
requested with stream_options.include_usage; else the number of choice events). Aggregates:
p50/p95/p99, output tok/s and total (prompt + output) tok/s over the wall time from the first
arrival to the last completion, error count.

    # against a running server
    nice -n 10 .venv/bin/python benchmarks/serve_bench.py --base-url http://127.0.0.1:8000/v1
    # start our serve app in-process (configs/serve.yaml), bench it, shut it down, then run the
    # same workload through the offline engine.LLM and print HTTP / offline throughput
    nice -n 10 .venv/bin/python benchmarks/serve_bench.py --launch --compare-offline \
        --json serve_bench.json --plot serve_bench.png

`--launch` starts a private local Ray instance (address="local", temp dir from $RAY_TMPDIR or a
fresh mkdtemp, RAY_AUTH_MODE=disabled) and always shuts Serve and Ray down again.

Threads: a Ray worker with num_cpus=k gets OMP_NUM_THREADS=floor(k) (min 1) unless the variable is
already set, so with configs/serve.yaml (num_cpus: 1.0) the engine replica's torch runs 1 thread.
`--launch` probes this and, by default (`--offline-threads match`), runs the offline comparison
with the same torch thread count, so the ratio measures the serving layer, not a thread mismatch.
`--replica-omp-threads N` exports OMP_NUM_THREADS=N to the Ray workers instead.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
import multiprocessing
import os
import platform
import random
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks.workload import Workload, make_workload, parse_engine_args, warmup_prompts  # noqa: E402

DEFAULT_CONFIG = os.path.join(_ROOT, "configs", "serve.yaml")
OFFLINE_RATIO_TARGET = 0.85
DECODE_RATIO_TARGET = 0.9  # single-stream decode through HTTP against the engine alone


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------- #
# workload and arrivals                                                                          #
# --------------------------------------------------------------------------------------------- #


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s after the start) of a Poisson process at `rate` req/s; inf = all at 0."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed + 7919)  # independent of the workload's stream
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


class TextPrompter:
    """Token ids -> text for `--text-prompts`: decoded with a tokenizer when one is given,
    else deterministic pseudo-words (one word per id, so roughly >= the id count in tokens)."""

    def __init__(self, tokenizer: str | None):
        self.tok = None
        if tokenizer:
            from transformers import AutoTokenizer

            from engine.model_loader import default_model_path

            path = default_model_path() if tokenizer == "embedded" else tokenizer
            if path.endswith(".gguf"):
                d, f = os.path.split(os.path.abspath(path))
                self.tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
            else:
                self.tok = AutoTokenizer.from_pretrained(path)

    def __call__(self, ids: list[int]) -> str:
        if self.tok is not None:
            return self.tok.decode(ids)
        return " ".join(f"w{i % 997}" for i in ids)


# --------------------------------------------------------------------------------------------- #
# the HTTP client side                                                                           #
# --------------------------------------------------------------------------------------------- #


@dataclass
class RequestResult:
    index: int
    prompt_len: int  # token ids sent (or the workload's length for text prompts)
    expected_output_len: int
    scheduled_s: float  # arrival offset
    ok: bool = False
    error: str | None = None
    status: int | None = None
    sent_s: float | None = None  # relative to the benchmark start
    ttft_s: float | None = None
    e2e_s: float | None = None
    tpot_s: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None  # from usage
    usage_present: bool = False
    num_events: int = 0  # SSE events with a choice
    finish_reason: str | None = None
    priority: int | None = None  # sent as the request's `priority` (--priorities)


def _usage_tokens(usage: dict[str, Any] | None) -> tuple[int | None, int | None]:
    if not usage:
        return None, None
    return usage.get("prompt_tokens"), usage.get("completion_tokens")


async def _sse_data(response) -> AsyncIterator[str]:
    """The `data:` payloads of an SSE body, as they arrive (split here, not by aiohttp's line
    reader, which refuses lines longer than its buffer: an event with logprobs can be)."""
    pending = b""
    async for piece in response.content.iter_any():
        lines = (pending + piece).split(b"\n")
        pending = lines.pop()
        for line in lines:
            if line.startswith(b"data:"):
                yield line[5:].strip().decode()


async def stream_request(session, url: str, model: str | None, prompt: Any, max_tokens: int,
                         res: RequestResult, t_start: float, extra: dict[str, Any]) -> None:
    body: dict[str, Any] = {
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }
    if model:
        body["model"] = model
    body.update(extra)
    t0 = time.perf_counter()
    res.sent_s = t0 - t_start
    first: float | None = None
    usage = None
    done = False
    try:
        async with session.post(url, json=body) as r:
            res.status = r.status
            if r.status != 200:
                text = (await r.read()).decode("utf-8", "replace")
                res.error = f"HTTP {r.status}: {text[:300]}"
                return
            async for data in _sse_data(r):
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event and event["error"]:
                    res.error = f"stream error: {json.dumps(event['error'])[:300]}"
                    return
                if event.get("usage"):
                    usage = event["usage"]
                choices = event.get("choices") or []
                if choices:
                    if first is None:
                        first = time.perf_counter()
                    res.num_events += 1
                    for c in choices:
                        if c.get("finish_reason"):
                            res.finish_reason = c["finish_reason"]
        t1 = time.perf_counter()
    except Exception as e:  # connection reset, timeout, bad JSON ...
        res.error = f"{type(e).__name__}: {e}"[:300]
        return
    if not done:
        res.error = "stream ended without [DONE]"
        return
    if first is None:
        res.error = "no tokens streamed"
        return
    res.usage_present = usage is not None
    res.prompt_tokens, completion = _usage_tokens(usage)
    res.output_tokens = completion if completion is not None else res.num_events
    res.ttft_s = first - t0
    res.e2e_s = t1 - t0
    if res.output_tokens > 1:
        res.tpot_s = (res.e2e_s - res.ttft_s) / (res.output_tokens - 1)
    res.ok = True


async def _resolve_model(session, base_url: str) -> str | None:
    try:
        async with session.get(base_url.rstrip("/") + "/models") as r:
            r.raise_for_status()
            data = (await r.json()).get("data") or []
        return data[0]["id"] if data else None
    except Exception as e:
        log(f"could not list models ({e!r}); sending no `model`")
        return None


async def run_http(args: argparse.Namespace, wl: Workload, base_url: str, model: str | None,
                   prompter: TextPrompter | None, on_timed_start: Callable[[], None] | None = None
                   ) -> tuple[list[RequestResult], float, str | None]:
    """Warm-up, then the timed replay (`on_timed_start` called between them). Returns
    (results, wall seconds, model).

    The client is aiohttp: httpx's connection pool walks every connection at each request's start
    and end, which in a burst of 256 took 7.5 ms of this process's CPU a request, and the server
    saw none of them before a quarter of a second, a delay the server's figures then carried."""
    import aiohttp

    cap = args.max_concurrency or len(wl)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    extra = json.loads(args.extra_body) if args.extra_body else {}
    url = base_url.rstrip("/") + "/completions"
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30.0, sock_read=args.request_timeout)
    connector = aiohttp.TCPConnector(limit=cap + 4)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as session:
        # Always asked, so the client's first connection is made here and not in the first timed request.
        listed = await _resolve_model(session, base_url)
        if model is None:
            model = listed
            log(f"model: {model!r}")

        def prompt_of(ids: list[int]) -> Any:
            return prompter(ids) if prompter is not None else list(ids)

        # warm-up (not timed): distinct prompts, so prefix caching cannot help the measured run
        for i, ids in enumerate(warmup_prompts(args.warmup)):
            w = RequestResult(-1 - i, len(ids), 4, 0.0)
            await stream_request(session, url, model, prompt_of(ids), 4, w, time.perf_counter(), extra)
            if not w.ok:
                raise RuntimeError(f"warm-up request failed: {w.error}")
        await asyncio.sleep(args.idle_s)

        offsets = arrival_offsets(len(wl), args.rate, args.seed)
        results = [RequestResult(r.index, r.prompt_len, r.output_len, off,
                                 priority=args.priorities[i % len(args.priorities)] if args.priorities else None)
                   for i, (r, off) in enumerate(zip(wl.requests, offsets))]
        sem = asyncio.Semaphore(cap)
        if on_timed_start is not None:
            on_timed_start()
        t_start = time.perf_counter()

        async def launch(req, res: RequestResult) -> None:
            delay = res.scheduled_s - (time.perf_counter() - t_start)
            if delay > 0:
                await asyncio.sleep(delay)
            body = extra if res.priority is None else extra | {"priority": res.priority}
            async with sem:
                await stream_request(session, url, model, prompt_of(req.prompt_token_ids),
                                     req.output_len, res, t_start, body)

        await asyncio.gather(*(launch(r, res) for r, res in zip(wl.requests, results)))
        wall = time.perf_counter() - t_start
    return results, wall, model


# --------------------------------------------------------------------------------------------- #
# statistics                                                                                     #
# --------------------------------------------------------------------------------------------- #


def _pcts(values: list[float]) -> dict[str, float | None]:
    import numpy as np

    if not values:
        return {"mean": None, "p50": None, "p95": None, "p99": None, "max": None}
    a = np.asarray(values, dtype=float)
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
            "p95": float(np.percentile(a, 95)), "p99": float(np.percentile(a, 99)),
            "max": float(a.max())}


def summarize(results: list[RequestResult], wall: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len
                        for r in ok)
    mismatched = [r.index for r in ok if r.output_tokens != r.expected_output_len]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = (r.error or "?")[:120]
            errors[key] = errors.get(key, 0) + 1
    return {
        "num_requests": len(results),
        "num_ok": len(ok),
        "num_errors": len(results) - len(ok),
        "errors": errors,
        "wall_s": wall,
        "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens,
        "output_len_mismatches": mismatched,
        "usage_reported": sum(r.usage_present for r in ok),
        "request_throughput": len(ok) / wall if wall > 0 else None,
        "output_tps": out_tokens / wall if wall > 0 else None,
        "total_tps": (out_tokens + prompt_tokens) / wall if wall > 0 else None,
        "ttft_s": _pcts([r.ttft_s for r in ok if r.ttft_s is not None]),
        # a burst's intake: how long after the run began any request got its first token
        "first_token_s": min((r.sent_s + r.ttft_s for r in ok if r.ttft_s is not None), default=None),
        "tpot_s": _pcts([r.tpot_s for r in ok if r.tpot_s is not None]),
        "e2e_s": _pcts([r.e2e_s for r in ok if r.e2e_s is not None]),
        "mean_events_per_request": (sum(r.num_events for r in ok) / len(ok)) if ok else None,
    }


def slo_summary(results: list[RequestResult], targets: dict[int, Any], wall: float) -> dict[int, dict[str, Any]]:
    """Per priority class, client-side, by the replicas' own rule and tally (serve_app.slo): requests
    finished, met (every objective), met per objective, attainment, goodput (met per second of
    the run: one window as long as the run)."""
    from serve_app.slo import SLOTracker

    tracker = SLOTracker(targets, window_s=wall, clock=lambda: 0.0)
    for r in results:
        tracker.record(r.priority or 0, r.ttft_s, r.tpot_s, r.ok)
    return tracker.snapshot()


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:.1f}"


def markdown(summary: dict[str, Any], meta: dict[str, Any], offline: dict[str, Any] | None) -> str:
    s = summary
    lines = [
        f"### serve_bench: {meta['num_requests']} requests, rate {meta['rate']} req/s, "
        f"seed {meta['seed']}, {meta['base_url']} ({meta['model']})",
        "",
        f"workload: {meta['workload']}",
        "",
        "| metric | mean | p50 | p95 | p99 | max |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, key in (("TTFT (ms)", "ttft_s"), ("TPOT (ms/token)", "tpot_s"),
                      ("e2e latency (ms)", "e2e_s")):
        p = s[key]
        lines.append(f"| {name} | {_ms(p['mean'])} | {_ms(p['p50'])} | {_ms(p['p95'])} | "
                     f"{_ms(p['p99'])} | {_ms(p['max'])} |")
    lines += [
        "",
        "| throughput | value |",
        "|---|---:|",
        f"| wall time (s) | {s['wall_s']:.2f} |",
        f"| first token of the run (ms) | {_ms(s['first_token_s'])} |",
        f"| requests ok / errors | {s['num_ok']} / {s['num_errors']} |",
        f"| request throughput (req/s) | {s['request_throughput']:.2f} |",
        f"| output tokens | {s['output_tokens']} |",
        f"| output tok/s | {s['output_tps']:.1f} |",
        f"| total (prompt+output) tok/s | {s['total_tps']:.1f} |",
        f"| output length mismatches | {len(s['output_len_mismatches'])} |",
    ]
    if offline is not None:
        if offline.get("error"):
            lines.append(f"| offline LLM | {offline['error']} |")
        else:
            ratio = offline.get("ratio_http_over_offline")
            flag = "" if ratio is None else ("  (meets target)" if ratio >= OFFLINE_RATIO_TARGET
                                             else "  (BELOW target)")
            lines += [
                f"| offline LLM wall (s) | {offline['wall_s']:.2f} |",
                f"| offline LLM output tok/s ({offline['torch_num_threads']} torch threads) | "
                f"{offline['output_tps']:.1f} |",
                f"| HTTP / offline output tok/s (target >= {OFFLINE_RATIO_TARGET}) | "
                f"{ratio:.3f}{flag} |",
            ]
            http_tpot, offline_tpot = s["tpot_s"]["p50"], (offline.get("tpot_s") or {}).get("p50")
            if http_tpot and offline_tpot:
                lines += [
                    f"| offline TTFT p50 (ms), TPOT p50 (ms/token) | {offline['ttft_s']['p50'] * 1e3:.1f}, "
                    f"{offline_tpot * 1e3:.2f} |",
                    f"| decode speed HTTP / offline (offline TPOT p50 / HTTP TPOT p50; single stream target >= "
                    f"{DECODE_RATIO_TARGET}) | {offline_tpot / http_tpot:.3f} |",
                ]
    if s["errors"]:
        lines += ["", "errors:"] + [f"- {n} x {e}" for e, n in s["errors"].items()]
    return "\n".join(lines)


def offline_beside_table(summary: dict[str, Any], beside: dict[str, Any], alone: dict[str, Any] | None) -> str:
    """The engine alone, the engine beside the idle app, and HTTP: the share Ray's idle processes
    take (beside / alone) apart from the share serving the requests takes (HTTP / beside)."""
    rows = [("offline, beside the idle app", beside)]
    if alone and not alone.get("error"):
        rows.insert(0, ("offline, alone", alone))
    lines = ["", "| run | output tok/s | TTFT p50 ms | TPOT p50 ms | HTTP / this (output tok/s) | "
                 "HTTP / this (decode: TPOT ratio) |", "|---|---:|---:|---:|---:|---:|"]
    http_tpot = summary["tpot_s"]["p50"]
    for name, run in rows + [("HTTP", {"output_tps": summary["output_tps"], "ttft_s": summary["ttft_s"],
                                       "tpot_s": summary["tpot_s"]})]:
        tpot = run["tpot_s"]["p50"]
        lines.append(f"| {name} | {run['output_tps']:.1f} | {run['ttft_s']['p50'] * 1e3:.1f} | "
                     f"{tpot * 1e3:.2f} | {summary['output_tps'] / run['output_tps']:.3f} | "
                     f"{tpot / http_tpot if http_tpot and tpot else float('nan'):.3f} |")
    return "\n".join(lines)


def plot_cdfs(results: list[RequestResult], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    ok = [r for r in results if r.ok]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in ((axes[0], "ttft_s", "TTFT"), (axes[1], "e2e_s", "end-to-end latency")):
        vals = np.sort([getattr(r, key) for r in ok if getattr(r, key) is not None])
        if len(vals):
            y = np.arange(1, len(vals) + 1) / len(vals)
            ax.step(vals, y, where="post")
            for q, ls in ((0.5, ":"), (0.95, "--"), (0.99, "-.")):
                v = float(np.percentile(vals, 100 * q))
                ax.axvline(v, color="gray", ls=ls, lw=0.8, label=f"p{int(q * 100)} {v:.2f}s")
            ax.legend(loc="lower right", fontsize=8)
        ax.set_xlabel(f"{label} (s)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.set_title(f"{label} CDF")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------- #
# --launch: our serve app in-process                                                             #
# --------------------------------------------------------------------------------------------- #


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def _http_options(config_path: str) -> dict[str, Any]:
    import yaml

    with open(config_path) as f:
        data = yaml.safe_load(f) or {}
    return dict(data.get("http_options") or {})


def _ray_descendants() -> list[Any]:
    """Our Ray processes (children of this driver), as psutil.Process objects."""
    import psutil

    try:
        return psutil.Process().children(recursive=True)
    except Exception:
        return []


def _proc_label(p: Any) -> str:
    try:
        cmd = " ".join(p.cmdline())
    except Exception:
        return "?"
    if "engine.engine_core" in cmd:
        return "EngineProcess"  # a replica's step loop (engine_process=True)
    for key in ("EngineReplica", "IngressRouterEngine", "IngressRouter", "Router", "Ingress", "ProxyActor",
                "ServeController"):
        if key in cmd:
            return key
    if "haproxy" in cmd:
        return "HAProxy"  # the front door of RAY_SERVE_ENABLE_HA_PROXY
    return "other_ray"


def cost_table(cpu_s: dict[str, float], output_tokens: int, num_requests: int,
               offline: dict[str, Any] | None) -> str:
    """CPU-seconds per 1,000 output tokens and per request in each serving process, and the
    offline engine's beside them: the serving cost as a figure to plan with."""
    lines = ["| process | CPU-s | per 1,000 output tokens | per request |", "|---|---:|---:|---:|"]
    rows = sorted(cpu_s.items(), key=lambda kv: -kv[1])
    if offline and offline.get("cpu_s") is not None:
        rows.append(("offline engine (same workload)", offline["cpu_s"]))
    for name, seconds in rows:
        lines.append(f"| {name} | {seconds:.2f} | {1000 * seconds / max(output_tokens, 1):.3f} | "
                     f"{seconds / max(num_requests, 1):.3f} |")
    serving = sum(v for k, v in cpu_s.items() if k not in ("EngineProcess", "bench_client+driver"))
    lines.append(f"| serving processes (all but the engine process and the client) | {serving:.2f} | "
                 f"{1000 * serving / max(output_tokens, 1):.3f} | {serving / max(num_requests, 1):.3f} |")
    if offline and offline.get("cpu_s") is not None:
        # if the engine needed only its offline CPU and every other process what it took here,
        # the machine's cores could run the HTTP workload no faster than this
        others = sum(v for k, v in cpu_s.items() if k != "EngineProcess")
        cores = os.cpu_count() or 1
        ceiling = offline["wall_s"] * cores / (offline["cpu_s"] + others)
        lines.append(f"\nHTTP / offline ceiling on {cores} cores with these processes' CPU: {min(ceiling, 1.0):.3f} "
                     f"(offline wall x cores / (offline engine CPU-s + the others' CPU-s); meaningful when CPU-bound)")
    return "\n".join(lines)


def probe_replica_threads(num_cpus: float) -> dict[str, Any]:
    """What torch sees inside a Ray actor with the replica's num_cpus: Ray sets OMP_NUM_THREADS to
    floor(num_cpus) (at least 1) in workers unless it is already set, and torch sizes its
    intra-op pool from it."""
    import ray

    @ray.remote(num_cpus=num_cpus)
    class _Probe:
        def threads(self) -> tuple[str | None, int]:
            import torch

            return os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads()

    try:
        a = _Probe.remote()
        omp, n = ray.get(a.threads.remote(), timeout=120)
        ray.kill(a)
        return {"num_cpus": num_cpus, "OMP_NUM_THREADS": omp, "torch_num_threads": n}
    except Exception as e:
        return {"num_cpus": num_cpus, "error": repr(e)}


def cpu_snapshot() -> dict[str, float]:
    """CPU seconds (user+sys) per process role for this driver and its Ray descendants."""
    import psutil

    out: dict[str, float] = {}
    me = psutil.Process()
    for p, label in [(me, "bench_client+driver")] + [(p, _proc_label(p)) for p in _ray_descendants()]:
        try:
            t = p.cpu_times()
            out[label] = out.get(label, 0.0) + t.user + t.system
        except Exception:
            pass
    return out


def load_app_config(config_path: str, engine_overrides: dict[str, Any]) -> Any:
    """The serve config, with `--engine-arg` values over the engine_args of each model it serves."""
    from serve_app.config import AppConfig, load_config

    cfg = load_config(config_path)
    if not engine_overrides:
        return cfg
    data = cfg.model_dump(exclude_unset=True)
    for engine in data["models"] if data.get("models") else [data.setdefault("engine", {})]:
        engine["engine_args"] = engine.get("engine_args", {}) | engine_overrides
    return AppConfig.model_validate(data)


@contextlib.contextmanager
def launched_app(config_path: str, host: str | None, port: int | None, startup_timeout: float,
                 omp_threads: int | None = None, info: dict[str, Any] | None = None,
                 engine_overrides: dict[str, Any] | None = None,
                 front_door: str | None = None) -> Iterator[tuple[str, Any]]:
    """Starts a private Ray + Serve with serve_app.app.build_app(config); yields (base_url, cfg).

    `omp_threads`: OMP_NUM_THREADS exported to the Ray processes (not to this one), overriding
    Ray's floor(num_cpus) default for the engine replica's torch threads. `front_door`: "direct"
    (every ingress replica serving `port` itself, Serve's proxy on a free port) or "proxy" (Serve's
    proxy on `port`); None: "direct", as `make serve` chooses for one application
    (serve_app/launch.py). Serve's pace and event loops are `make serve`'s (serve_app.launch.serve_env)
    where the environment does not set them."""
    from serve_app.config import SharedPortConfig
    from serve_app.launch import serve_env, shared_port_options

    cfg = load_app_config(config_path, engine_overrides or {})
    http = _http_options(config_path)
    host = host or http.get("host", "127.0.0.1")
    if port is None:
        port = int(http.get("port", 8000))
        if not _port_free(host, port):
            new = _free_port(host)
            log(f"port {port} is busy; using {new}")
            port = new
    tmp = os.environ.get("RAY_TMPDIR") or tempfile.mkdtemp(prefix="rsb-")
    os.environ["RAY_TMPDIR"] = tmp
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_SERVE_LOG_TO_STDERR", "0")
    os.environ.update(serve_env())
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [_ROOT, os.environ.get("PYTHONPATH")] if p)
    front_door = front_door or "direct"
    proxy_port = port
    if front_door == "direct":
        shared = SharedPortConfig.model_validate(shared_port_options(http | {"host": host, "port": port}))
        cfg = cfg.model_copy(update={"ingress": cfg.ingress.model_copy(update={"shared_port": shared})})
        proxy_port = _free_port(host)
    if info is not None:
        info["front_door"] = front_door
    need = (sum(m.num_cpus * max(m.num_replicas, m.autoscaling.max_replicas if m.autoscaling else 0)
                for m in cfg.served_models)
            + cfg.router.num_cpus + cfg.ingress.num_cpus * cfg.ingress.num_replicas)
    num_cpus = max(os.cpu_count() or 1, math.ceil(need + 0.5))
    import ray
    from ray import serve

    from serve_app.app import build_app

    log(f"starting Ray (address=local, num_cpus={num_cpus}, temp dir {tmp}) ...")
    t0 = time.perf_counter()
    saved_omp = os.environ.get("OMP_NUM_THREADS")
    if omp_threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(omp_threads)  # inherited by raylet -> workers
    try:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, _temp_dir=tmp,
                 log_to_driver=False, configure_logging=False)
    finally:
        if saved_omp is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved_omp
    try:
        if info is not None:
            info["replica_threads_probe"] = probe_replica_threads(cfg.served_models[0].num_cpus)
            log(f"torch threads in a Ray actor like the replica: {info['replica_threads_probe']}")
        serve.start(http_options={"host": host, "port": proxy_port})
        serve.run(build_app(cfg), name="cbserve", route_prefix="/", blocking=False)
        base = f"http://{host}:{port}"
        wait_healthy(base, startup_timeout, poll_s=0.5)
        log(f"serve app healthy at {base} after {time.perf_counter() - t0:.1f}s")
        yield base + "/v1", cfg
    finally:
        log("shutting down Serve and Ray ...")
        try:
            serve.shutdown()
        except Exception:
            traceback.print_exc()
        ray.shutdown()


STEP_FIGURES = ("num_steps", "num_decode_only_steps", "decode_only_rows", "decode_only_steps_s", "mixed_steps_s",
                "num_steps_ahead")


def step_figures(stats: list[Any]) -> dict[str, float]:
    """Engines' step counts and times so far (EngineStats: decode-only steps, which CUDA runs in
    its decode graphs, their rows, the others, and the steps launched ahead), summed."""
    return {name: sum(getattr(s, name) for s in stats) for name in STEP_FIGURES}


def steps_between(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before[name] for name in STEP_FIGURES}


@functools.cache
def _handle_loop() -> asyncio.AbstractEventLoop:
    """An event loop running on a thread of its own for this process's Serve handles: the caller
    may be on a loop, where Serve's handles do not block, and with Serve's router on the caller's
    loop (`make serve`'s setting) a handle needs a loop that outlives each call."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name="serve-handles", daemon=True).start()
    return loop


def served_step_figures(cfg: Any, app: str = "cbserve") -> dict[str, float]:
    """`step_figures` of every engine replica of the app."""
    from ray import serve

    async def ask() -> list[Any]:
        handle = serve.get_deployment_handle("IngressRouterEngine" if cfg.colocated else "EngineReplica", app)
        return await handle.broadcast("engine_stats").results_async()

    return step_figures(asyncio.run_coroutine_threadsafe(ask(), _handle_loop()).result())


def steps_line(steps: dict[str, float]) -> str:
    decode_only = steps["num_decode_only_steps"]
    mixed = steps["num_steps"] - decode_only
    each = (f" ({steps['decode_only_rows'] / decode_only:.1f} rows, "
            f"{1e3 * steps['decode_only_steps_s'] / decode_only:.2f} ms each)") if decode_only else ""
    return (f"{steps['num_steps']:.0f} steps: {decode_only:.0f} decode-only{each} in "
            f"{steps['decode_only_steps_s']:.2f} s, {mixed:.0f} others in {steps['mixed_steps_s']:.2f} s; "
            f"{steps['num_steps_ahead']:.0f} launched ahead")


# --------------------------------------------------------------------------------------------- #
# --compare-offline                                                                              #
# --------------------------------------------------------------------------------------------- #


def wait_healthy(url: str, timeout_s: float, still_starting: Callable[[], None] | None = None,
                 poll_s: float = 0.05) -> float:
    """Seconds until the app's /health answers 200 (an engine replica is ready), tried every
    `poll_s`. `still_starting`: called before each try; raises when the server cannot come up any more."""
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if still_starting is not None:
            still_starting()
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    raise TimeoutError(f"{url} not healthy within {timeout_s} s")


def offline_wave(num_requests: int, max_concurrency: int | None, max_num_seqs: int) -> int:
    """Requests the offline run submits at a time: all of them, or waves of the client's in-flight
    cap where that is below the engine's batch (one at a time with 1, the single-stream case). A
    client that keeps at least a full batch in flight is matched by the engine's own queue, which
    starts a request as soon as one ends, as the served engine does; waves would idle the batch's
    rows while each wave's longest request finishes."""
    if max_concurrency and max_concurrency < max_num_seqs:
        return max_concurrency
    return num_requests


def run_offline(wl: Workload, model: str | None, engine_args: dict[str, Any],
                threads: int | None = None, max_concurrency: int | None = None) -> dict[str, Any]:
    """run_offline_here in a process of its own, as the served engine's step loop runs
    (`engine_process`), apart from this process's Ray driver and its threads: beside them an engine
    here once decoded at half speed (BENCHMARKS.md, "Serving over HTTP")."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(run_offline_here, (wl, model, engine_args, threads, max_concurrency))


def run_offline_here(wl: Workload, model: str | None, engine_args: dict[str, Any],
                     threads: int | None = None, max_concurrency: int | None = None) -> dict[str, Any]:
    """The workload through engine.LLM, submitted as `offline_wave` says. Reports the engine's own
    TTFT and TPOT."""
    import torch

    from engine import LLM, SamplingParams

    if threads is not None:
        torch.set_num_threads(threads)

    t0 = time.perf_counter()
    llm = LLM(model=model, **engine_args)
    log(f"offline LLM(model={model!r}, {engine_args}) ready in {time.perf_counter() - t0:.1f}s")
    warm = warmup_prompts()
    llm.generate([list(p) for p in warm],
                 [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True) for _ in warm],
                 use_tqdm=False)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in wl.output_lens]
    prompts = [list(p) for p in wl.prompts]
    wave = offline_wave(len(prompts), max_concurrency, llm.engine.config.scheduler.max_num_seqs)
    steps0 = step_figures([llm.engine.get_stats()])
    t0, cpu0 = time.perf_counter(), time.process_time()
    outs = []
    for i in range(0, len(prompts), wave):
        outs += llm.generate(prompts[i:i + wave], params[i:i + wave], use_tqdm=False)
    wall, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    steps = steps_between(steps0, step_figures([llm.engine.get_stats()]))
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    mism = [i for i, (o, n) in enumerate(zip(outs, wl.output_lens))
            if len(o.outputs[0].token_ids) != n]
    del llm
    return {"wall_s": wall, "cpu_s": cpu_s, "torch_num_threads": torch.get_num_threads(),
            "output_tokens": out_tokens, "output_tps": out_tokens / wall,
            "total_tps": (out_tokens + wl.num_prompt_tokens) / wall,
            "output_len_mismatches": mism, "engine_args": engine_args, "model": model, "engine_steps": steps,
            "ttft_s": _pcts([o.metrics.ttft for o in outs if o.metrics.ttft is not None]),
            "tpot_s": _pcts([t for o in outs
                             if (t := o.metrics.time_per_output_token(len(o.outputs[0].token_ids))) is not None])}


# --------------------------------------------------------------------------------------------- #
# main                                                                                           #
# --------------------------------------------------------------------------------------------- #


def _range(s: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in s.split(","))
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"need 1 <= lo <= hi, got {s!r}")
    return lo, hi


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", default=None,
                   help="`model` field; default: the launched app's name, else /v1/models' first")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--rate", type=float, default=float("inf"),
                   help="Poisson arrival rate in req/s; inf (default) = all at once")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-len-range", type=_range, default=(16, 512), metavar="LO,HI")
    p.add_argument("--output-len-range", type=_range, default=(8, 256), metavar="LO,HI")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="in-flight cap (default: --num-requests)")
    p.add_argument("--text-prompts", action="store_true",
                   help="send text prompts instead of token ids")
    p.add_argument("--tokenizer", default=None,
                   help="with --text-prompts: decode the ids with this HF tokenizer "
                        "(path, .gguf, or 'embedded'); default: pseudo-words")
    p.add_argument("--extra-body", default=None, help="JSON merged into every request body")
    p.add_argument("--priorities", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   metavar="P,Q,...", help="request i is sent with priority P[i mod len]")
    p.add_argument("--slo", default=None, metavar="JSON",
                   help='objectives per class, as the app config\'s `slo`: {"0": {"ttft_s": 1, "tpot_s": 0.2}}; '
                        "reports attainment and goodput per class"),
    p.add_argument("--warmup", type=int, default=2, help="untimed warm-up requests")
    p.add_argument("--idle-s", type=float, default=0.0,
                   help="seconds idle between the warm-up and the timed run: a burst after a quiet spell "
                        "(the engine replicas' stream channels end after 2 s idle)")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--launch", action="store_true",
                   help="start serve_app in-process from --config, bench it, shut it down")
    p.add_argument("--config", default=DEFAULT_CONFIG, help="serve YAML (or bare AppConfig YAML)")
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="--launch / --compare-offline: override one of the config's engine_args")
    p.add_argument("--host", default=None, help="--launch: HTTP host (default: the config's)")
    p.add_argument("--port", type=int, default=None,
                   help="--launch: HTTP port (default: the config's, or a free one if busy)")
    p.add_argument("--front-door", choices=["direct", "proxy"], default=None,
                   help="--launch: the ingress replicas serving --port themselves, or Serve's proxy "
                        "(default: direct, as `make serve` chooses)")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--replica-omp-threads", type=int, default=None,
                   help="--launch: export OMP_NUM_THREADS=N to the Ray workers (default: Ray's "
                        "floor(num_cpus), which caps the replica's torch threads)")
    p.add_argument("--compare-offline", action="store_true",
                   help="afterwards run the workload through engine.LLM with the config's engine "
                        "args and report HTTP / offline output throughput")
    p.add_argument("--offline-beside-app", action="store_true",
                   help="--launch: also run the offline comparison while the app is up and idle, before "
                        "shutting it down: what Ray's and Serve's idle processes alone cost the engine")
    p.add_argument("--offline-threads", default="match",
                   help="torch threads for the offline run: an int, 'default' (torch's own), or "
                        "'match' (default): the replica's torch threads when --launch probed "
                        "them, else torch's own")
    p.add_argument("--json", default=None, help="write results here")
    p.add_argument("--plot", default=None, help="write a TTFT / e2e latency CDF PNG here")
    args = p.parse_args(argv)
    if args.offline_threads not in ("match", "default") and not args.offline_threads.isdigit():
        p.error("--offline-threads: an int, 'match' or 'default'")
    if args.rate <= 0:
        p.error("--rate must be > 0 (inf = all at once)")
    if args.num_requests < 1:
        p.error("--num-requests must be >= 1")
    return args


def _offline_threads(args: argparse.Namespace, extra: dict[str, Any]) -> int | None:
    if args.offline_threads == "match":
        return (extra.get("replica_threads_probe") or {}).get("torch_num_threads")
    return None if args.offline_threads == "default" else int(args.offline_threads)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    wl = make_workload(args.num_requests, args.prompt_len_range, args.output_len_range,
                       seed=args.seed)
    log(f"workload: {wl.describe()}")
    prompter = TextPrompter(args.tokenizer) if args.text_prompts else None
    meta: dict[str, Any] = {
        "num_requests": len(wl), "rate": "inf" if math.isinf(args.rate) else args.rate,
        "seed": args.seed, "workload": wl.describe(), "text_prompts": args.text_prompts,
        "warmup": args.warmup, "idle_s": args.idle_s,
        "launch": args.launch, "replica_omp_threads": args.replica_omp_threads,
        "config": args.config if args.launch or args.compare_offline else None,
        "engine_overrides": parse_engine_args(args.engine_arg),
        "host": platform.node(), "cpu_count": os.cpu_count(),
        "loadavg_start": list(os.getloadavg()), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    cfg = None
    extra: dict[str, Any] = {}
    if args.launch:
        with launched_app(args.config, args.host, args.port, args.startup_timeout,
                          args.replica_omp_threads, extra, parse_engine_args(args.engine_arg),
                          args.front_door) as (base, cfg):
            model = args.model or cfg.served_models[0].model_name
            cpu0: dict[str, float] = {}  # after the warm-up: first requests' one-time costs are not the serving cost
            steps0: dict[str, float] = {}

            def timed_start() -> None:
                steps0.update(served_step_figures(cfg))
                cpu0.update(cpu_snapshot())

            results, wall, model = asyncio.run(run_http(args, wl, base, model, prompter, timed_start))
            cpu1 = cpu_snapshot()
            extra["cpu_s_during_run"] = {k: round(v - cpu0.get(k, 0.0), 2) for k, v in cpu1.items()}
            extra["engine_steps_during_run"] = steps_between(steps0, served_step_figures(cfg))
            meta["base_url"] = base
            if args.offline_beside_app:
                log("offline LLM on the same workload, beside the idle app ...")
                first = cfg.served_models[0]
                extra["offline_beside_app"] = run_offline(wl, first.model, first.engine_args.as_kwargs(),
                                                          _offline_threads(args, extra), args.max_concurrency)
    else:
        results, wall, model = asyncio.run(run_http(args, wl, args.base_url, args.model, prompter))
        meta["base_url"] = args.base_url
    meta["model"] = model
    meta["loadavg_end_http"] = list(os.getloadavg())
    summary = summarize(results, wall)
    if args.slo:
        from serve_app.config import AppConfig

        targets = AppConfig.model_validate({"slo": json.loads(args.slo)}).slo
        summary["slo"] = slo_summary(results, targets, wall)

    def report(offline: dict[str, Any] | None) -> None:
        print(markdown(summary, meta, offline), flush=True)
        for priority, row in sorted(summary.get("slo", {}).items()):
            print(f"SLO class {priority}: {row['met']}/{row['finished']} met (ttft {row['met_ttft']}, tpot "
                  f"{row['met_tpot']}), attainment {row['attainment']:.3f}, goodput {row['goodput_rps']:.2f} req/s")
        if extra.get("cpu_s_during_run"):
            print("\nCPU during the HTTP run:\n" + cost_table(extra["cpu_s_during_run"], summary["output_tokens"],
                                                              summary["num_ok"], offline))
        if extra.get("engine_steps_during_run"):
            print("\nThe served engine's steps during the HTTP run: " + steps_line(extra["engine_steps_during_run"]))
        if offline and offline.get("engine_steps"):
            print("The offline engine's steps: " + steps_line(offline["engine_steps"]))
        beside = extra.get("offline_beside_app")
        if beside:
            print(offline_beside_table(summary, beside, offline))
        if extra.get("replica_threads_probe"):
            print(f"torch threads in a Ray actor with the replica's num_cpus: "
                  f"{extra['replica_threads_probe']}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "summary": summary, "offline": offline, **extra,
                           "requests": [asdict(r) for r in results]}, f, indent=1, default=str)
            log(f"wrote {args.json}")

    if args.plot:
        plot_cdfs(results, args.plot,
                  f"{len(wl)} requests, rate {meta['rate']} req/s, seed {args.seed} - "
                  f"{meta['base_url']}")
        log(f"wrote {args.plot}")
    offline = None
    if args.compare_offline:
        # the HTTP figures first (and on disk), in case the offline run is cut short
        report({"error": "offline run not finished"})
        if cfg is None:
            cfg = load_app_config(args.config, parse_engine_args(args.engine_arg))
        log("offline LLM on the same workload ...")
        try:
            offline = run_offline(wl, cfg.served_models[0].model, cfg.served_models[0].engine_args.as_kwargs(),
                                  _offline_threads(args, extra), args.max_concurrency)
            offline["ratio_http_over_offline"] = (summary["output_tps"] / offline["output_tps"]
                                                  if summary["output_tps"] else None)
            offline["ratio_target"] = OFFLINE_RATIO_TARGET
            if not math.isinf(args.rate):
                offline["note"] = ("HTTP run was rate-limited; the ratio is only meaningful "
                                   "for --rate inf")
        except Exception as e:
            traceback.print_exc()
            offline = {"error": repr(e)}
        meta["loadavg_end_offline"] = list(os.getloadavg())
        print()
    report(offline)
    return 0 if summary["num_errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
