"""What `make serve`'s graph costs a single stream: the engine beside the idle graph, the graph's
processes running or stopped, and the same stream served through HTTP, in one launch.

One engine process, built from the serve config's engine args, decodes one stream at a time
(`--prompt-len` prompt tokens, `--output-len` new tokens) while the config's graph is up and idle
(serve_bench.launched_app). Before each decode the graph's processes are left running, or
SIGSTOPped: all of them, or one group (`--groups`: Serve's controller, its proxy, the replicas
with their engine processes, the GCS with the raylet, Ray's other daemons). In the `http` state
that engine waits and the app serves the stream instead (a streaming completion, TPOT taken by
the client as serve_bench takes it). The states take turns within each round, in reverse order every other round, so the
host's drift falls on each alike; one launch and one engine process per side, so neither
start-up nor a process's luck differs between states.

Per state: the median over rounds of each round's median ms per token, the decoding engine's
involuntary context switches per token (a core taken from the forward), and the speed against
the all-stopped state, the engine alone on the machine. `running` is the floor Ray's and Serve's
idle processes leave a single stream; `http` is what a client gets (serve_bench's single-stream
"HTTP / alone", measured without a launch or a process between the two).

    RAY_TMPDIR=$(mktemp -d) RAY_AUTH_MODE=disabled .venv/bin/python benchmarks/idle_graph.py \
        --rounds 8 --groups controller,proxy,replicas,ray,daemons --json idle_graph.json

Only processes this benchmark started are stopped, and each is resumed after its decode and on
any exit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import signal
import statistics
import sys
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks import serve_bench  # noqa: E402
from benchmarks.workload import random_prompt, warmup_prompts  # noqa: E402

RUNNING, STOPPED, HTTP = "running", "stopped", "http"
GROUPS = ("controller", "proxy", "replicas", "ray", "daemons")


def group_of(cmdline: str) -> str:
    """controller, proxy: Serve's; replicas: Serve's replica actors and their engine processes;
    ray: the GCS and the raylet; daemons: Ray's other processes (dashboard, its agents, the log and
    autoscaler monitors)."""
    if cmdline.startswith("ray::ServeController"):
        return "controller"
    if cmdline.startswith("ray::ProxyActor"):
        return "proxy"
    if cmdline.startswith("ray::ServeReplica") or "engine.engine_core" in cmdline:
        return "replicas"
    if "gcs_server" in cmdline or "raylet/raylet" in cmdline:
        return "ray"
    return "daemons"


def involuntary_switches(pid: int) -> int:
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/status") as f:
            total += sum(int(line.split()[1]) for line in f if line.startswith("nonvoluntary_ctxt_switches"))
    return total


def decode_loop(conn: Connection, model: str | None, engine_args: dict[str, Any], prompt_len: int,
                output_len: int) -> None:
    """The engine's process: one stream per message received, answering (ms per token, the
    process's involuntary context switches during it)."""
    from engine import LLM, SamplingParams

    llm = LLM(model=model, **engine_args)
    llm.generate(warmup_prompts(), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    conn.send("ready")
    seed = 0
    while conn.recv() is not None:
        seed += 1  # a new prompt each time: prefix caching must not shorten a prefill
        before = involuntary_switches(os.getpid())
        out = llm.generate([random_prompt(prompt_len, seed=seed)], params, use_tqdm=False)[0]
        switches = involuntary_switches(os.getpid()) - before
        tpot = out.metrics.time_per_output_token(len(out.outputs[0].token_ids))
        conn.send((tpot * 1e3, switches))


def http_decode(base_url: str, model: str, prompt: list[int], output_len: int) -> float:
    """ms per token of one streamed completion, as the client sees it."""
    import asyncio

    import aiohttp

    async def one() -> serve_bench.RequestResult:
        res = serve_bench.RequestResult(0, len(prompt), output_len, 0.0)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            await serve_bench.stream_request(session, base_url + "/completions", model, prompt, output_len, res,
                                             time.perf_counter(), {})
        return res

    res = asyncio.run(one())
    if not res.ok or res.tpot_s is None or res.output_tokens != output_len:
        raise RuntimeError(f"the served stream failed: {res.error or res.output_tokens}")
    return res.tpot_s * 1e3


@contextlib.contextmanager
def stopped(processes: list[Any]) -> Iterator[None]:
    import psutil

    done = []
    try:
        for p in processes:
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGSTOP)
                done.append(p)
        yield
    finally:
        for p in done:
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGCONT)


def summarize(samples: dict[str, list[list[tuple[float, int]]]], output_len: int) -> dict[str, dict[str, Any]]:
    """Per state: each round's median ms/token, their median, switches per token, and the
    all-stopped time over this state's."""
    rows = {}
    for state, runs in samples.items():
        per_round = [statistics.median(ms for ms, _ in r) for r in runs]
        rows[state] = {"ms_per_token": statistics.median(per_round), "rounds": per_round,
                       "involuntary_switches_per_token": statistics.median(s for r in runs for _, s in r) / output_len}
    floor = rows.get(STOPPED, {}).get("ms_per_token")
    for row in rows.values():
        row["speed_vs_stopped"] = floor / row["ms_per_token"] if floor else None
    return rows


def markdown(rows: dict[str, dict[str, Any]]) -> str:
    lines = ["| graph's processes | ms / token (median of rounds) | rounds | involuntary switches / token "
             "| speed against all stopped |", "|---|---:|---|---:|---:|"]
    for state, r in rows.items():
        ratio = f"{r['speed_vs_stopped']:.3f}" if r["speed_vs_stopped"] else "-"
        lines.append(f"| {state} | {r['ms_per_token']:.3f} | {' / '.join(f'{x:.2f}' for x in r['rounds'])} "
                     f"| {r['involuntary_switches_per_token']:.2f} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:

    from benchmarks.quantization import cpu_features

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=serve_bench.DEFAULT_CONFIG)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--runs-per-state", type=int, default=3, help="decodes per state in a round")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--groups", default="", help="comma-separated groups to stop one at a time: " + ", ".join(GROUPS))
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    groups = [g for g in args.groups.split(",") if g]
    unknown = set(groups) - set(GROUPS)
    if unknown:
        p.error(f"unknown groups: {sorted(unknown)}")
    states = [RUNNING, STOPPED, HTTP] + [f"{g} stopped" for g in groups]
    print(f"CPU: {cpu_features()}; {os.cpu_count()} cores", flush=True)

    samples: dict[str, list[list[tuple[float, int]]]] = {s: [] for s in states}
    with serve_bench.launched_app(args.config, None, None, args.startup_timeout) as (base_url, cfg):
        graph = {proc: " ".join(proc.cmdline()) for proc in serve_bench._ray_descendants()}
        served = [proc for proc, cmdline in graph.items() if "engine.engine_core" in cmdline]
        http_seed = 10**6  # apart from the engine process's prompts

        def serve_one() -> tuple[float, int]:
            nonlocal http_seed
            http_seed += 1
            before = sum(involuntary_switches(proc.pid) for proc in served)
            ms = http_decode(base_url, cfg.engine.model_name, random_prompt(args.prompt_len, seed=http_seed),
                             args.output_len)
            return ms, sum(involuntary_switches(proc.pid) for proc in served) - before

        serve_one()  # the ingress's first request loads its tokenizer, once
        here, there = multiprocessing.get_context("spawn").Pipe()
        engine = multiprocessing.get_context("spawn").Process(
            target=decode_loop, args=(there, cfg.engine.model, cfg.engine.engine_args.as_kwargs(),
                                      args.prompt_len, args.output_len), daemon=True)
        engine.start()
        try:
            if here.recv() != "ready":
                raise RuntimeError("the engine process did not start")
            members: dict[str, list[Any]] = {RUNNING: [], STOPPED: list(graph)}
            for proc, cmdline in graph.items():
                members.setdefault(f"{group_of(cmdline)} stopped", []).append(proc)
            for rnd in range(args.rounds):
                for state in states if rnd % 2 == 0 else states[::-1]:
                    runs = []
                    with stopped(members.get(state, [])):
                        for _ in range(args.runs_per_state):
                            if state == HTTP:
                                runs.append(serve_one())
                            else:
                                here.send(True)
                                runs.append(here.recv())
                    samples[state].append(runs)
                    serve_bench.log(f"round {rnd} {state}: {' '.join(f'{ms:.3f}' for ms, _ in runs)} ms/token")
            here.send(None)
        finally:
            engine.join(30)
            if engine.is_alive():
                engine.kill()
    rows = summarize(samples, args.output_len)
    print(markdown(rows), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_features(), "config": args.config, "prompt_len": args.prompt_len,
                       "output_len": args.output_len, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                       "states": rows, "samples": samples}, f, indent=1)
        serve_bench.log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
