"""`make serve`'s start-up: from the launcher's start to the first completion, and where it goes.

Each round starts `python -m serve_app.launch configs/serve.yaml` as `make serve` does (its own
session, a fresh RAY_TMPDIR), polls `/health` every 20 ms, then sends two completions of two
tokens: the first one's answer is the start-up; the second shows what the first paid for work
left to it. The phases come from Serve's own logs: the controller up (Ray started), the app built
(its import path run), the engine replica initializing and initialized (its engine process
spawned, loaded and ready).

`--baseline REV` alternates with a git worktree of REV (A B B A ...), run from there (its
directory first on PYTHONPATH, so Ray's workers and the engine process import its code). Each
tree's `make install` model step (`python -m engine.model_setup`) runs first, so no start times
or scores `auto`. `--install-beside N` runs that step as a first `make install` does, on a
cache with no decision or quality figures yet (the compiled kernels and the converted model
linked in), beside N processes spinning on the CPU: the starts then show what a first start
after an install on a busy machine takes.

    python benchmarks/startup.py --rounds 5 [--baseline HEAD~3] [--install-beside 2] [--json startup.json]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.quantization import cpu_features  # noqa: E402
from benchmarks.serve_bench import wait_healthy  # noqa: E402
from engine.cache_dir import CACHE_ENV, cache_dir  # noqa: E402
from engine.cpu_load import OtherLoad  # noqa: E402

URL = "http://127.0.0.1:8000"
# (phase, Serve log file glob, line pattern): the first matching line's time
PHASES = [("controller up", "controller_*.log", "Controller starting"),
          ("app built", "controller_*.log", "built app"),
          ("replica initializing", "replica_*.log", "Started initializing replica"),
          ("replica initialized", "replica_*.log", "Finished initializing replica")]
_STAMP = re.compile(r"^\w+ (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")


def serve_phases(ray_tmp: Path, started_at: float) -> dict[str, float]:
    """Seconds from `started_at` (a time.time()) to each phase, as Serve logged it."""
    logs = next(ray_tmp.glob("ray/session_*/logs/serve"), None)
    found = {}
    for phase, pattern, text in PHASES:
        for path in sorted(logs.glob(pattern)) if logs else []:
            for line in path.read_text(errors="replace").splitlines():
                stamp = _STAMP.match(line)
                if stamp and text in line:
                    found[phase] = datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() - started_at
                    break
            if phase in found:
                break
    return found


def one_start(tree: Path, pythonpath: str | None, timeout_s: float) -> dict[str, float]:
    """One `make serve` start from `tree`: the phases, /health, and the two completions' times."""
    ray_tmp = Path(tempfile.mkdtemp(prefix="cbserve-startup-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {"RAY_TMPDIR": str(ray_tmp)}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    started_at, start = time.time(), time.monotonic()
    launcher = subprocess.Popen([sys.executable, "-m", "serve_app.launch", "configs/serve.yaml"], cwd=tree, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    def launcher_alive() -> None:
        if launcher.poll() is not None:
            raise RuntimeError(f"the launcher exited with {launcher.returncode}")

    result: dict[str, float] = {}
    try:
        wait_healthy(URL, timeout_s, launcher_alive, poll_s=0.02)
        result["health"] = time.monotonic() - start
        for name in ("first completion", "second completion"):
            sent = time.monotonic()
            httpx.post(f"{URL}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60).raise_for_status()
            result[name] = time.monotonic() - start
            result[f"{name} alone"] = time.monotonic() - sent
        result |= serve_phases(ray_tmp, started_at)
    finally:
        launcher.send_signal(signal.SIGTERM)  # as a service manager stops `make serve`: Ray and the engine exit
        launcher.wait(60)
        time.sleep(3)  # the port and the cores free again
        shutil.rmtree(ray_tmp, ignore_errors=True)
    return result


def prepare(tree: Path, pythonpath: str | None) -> None:
    """The tree's `make install` model step: the embedded model converted, `auto` decided."""
    env = os.environ | ({"PYTHONPATH": pythonpath} if pythonpath else {})
    subprocess.run([sys.executable, "-m", "engine.model_setup"], cwd=tree, env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def fresh_decisions_cache() -> Path:
    """A cache root holding this machine's compiled kernels and converted models, and nothing
    decided or scored yet; made this process's (and so its children's) CBSERVE_CACHE."""
    root = Path(tempfile.mkdtemp(prefix="cbserve-cache-"))
    for kind in ("kernels", "models"):
        cache_dir(kind).mkdir(parents=True, exist_ok=True)
        (root / kind).symlink_to(cache_dir(kind))
    os.environ[CACHE_ENV] = str(root)
    return root


def spinning(count: int) -> list[subprocess.Popen]:
    code = "while True: pass"
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(count)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--baseline", help="git revision to alternate with this tree")
    p.add_argument("--timeout", type=float, default=180.0)
    p.add_argument("--install-beside", type=int, default=0, metavar="N",
                   help="the install step on a cache with nothing decided, beside N spinning processes")
    p.add_argument("--json")
    args = p.parse_args()
    print(f"CPU: {cpu_features()}; {os.cpu_count()} cores")
    trees = {"this tree": (ROOT, None)}
    worktree = None
    if args.baseline:
        worktree = Path(tempfile.mkdtemp(prefix="cbserve-baseline-")) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(worktree), args.baseline], cwd=ROOT, check=True)
        trees = {f"baseline ({args.baseline})": (worktree, str(worktree))} | trees
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    install: dict[str, object] = {}
    try:
        if args.install_beside:
            cache = fresh_decisions_cache()
            spinners = spinning(args.install_beside)
            start = time.monotonic()
            with OtherLoad() as load:
                try:
                    for tree, pythonpath in trees.values():
                        prepare(tree, pythonpath)
                finally:
                    for spinner in spinners:
                        spinner.kill()
                        spinner.wait()
            decisions = [json.loads(p.read_text()) for p in (cache / "decisions").glob("*.json")]
            install = {"beside": args.install_beside, "seconds": time.monotonic() - start, "other_cores": load.cores,
                       "contended_cores": [d.get("contended_cores") for d in decisions]}
            print(f"install step beside {args.install_beside} spinning processes: {install['seconds']:.0f} s, "
                  f"decisions marked with the cores others took: {install['contended_cores']}", flush=True)
        for tree, pythonpath in trees.values():
            prepare(tree, pythonpath)
        for r in range(args.rounds):
            order = list(trees.items()) if r % 2 == 0 else list(trees.items())[::-1]  # neither always goes first
            for name, (tree, pythonpath) in order:
                runs[name].append(one_start(tree, pythonpath, args.timeout))
                print(f"round {r + 1} {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in runs[name][-1].items()),
                      flush=True)
    finally:
        if worktree is not None:
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=ROOT, check=False)
    keys = [phase for phase, _, _ in PHASES] + ["health", "first completion", "first completion alone",
                                                  "second completion alone"]
    medians = {name: {k: statistics.median(run[k] for run in rs) for k in keys if all(k in run for run in rs)}
               for name, rs in runs.items()}
    print(f"\n| seconds, median of {args.rounds} (from the launcher's start; `alone`: that request's own) | "
          + " | ".join(trees) + " |")
    print("|---|" + "---:|" * len(trees))
    for k in keys:
        print(f"| {k} | " + " | ".join(f"{medians[name].get(k, float('nan')):.2f}" for name in trees) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_features(), "baseline": args.baseline, "install": install,
                                               "runs": runs, "medians": medians}, indent=1))


if __name__ == "__main__":
    main()
