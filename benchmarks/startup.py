"""Start-up on the user's model: cbserve beside llama.cpp's server on the same GGUF files (CPU).

Per file and round (cbserve and llama.cpp alternated):
- offline: a process running `LLM(model=FILE)`, then one greedy 8-token answer: seconds from the
  process's start to ready and to the answer, and its peak resident memory; `cold` on a cache
  holding only the compiled kernels (the file's metadata converted on the way), then `warm`;
- served: `python -m serve_app.launch` on configs/serve.yaml with the model set, as `make serve`
  starts it: seconds to the first answer (Ray and Serve included), cold then warm;
- llama.cpp: `llama-server -m FILE -t 2`: seconds to its first answer and its peak memory;
- two engines on the file at once, each ready: what each holds beside the file's pages they share
  (Private_Clean + Private_Dirty of /proc/PID/smaps_rollup), the KV pool included.
The KV pool is the default 1 GiB. The OS page cache keeps the file between starts (as on a node
that served it before); `cold` is cbserve's own cache.

    python benchmarks/startup.py --models /tmp/b1b/model-Q4_K_M.gguf,... --llama-server BIN --rounds 3 \\
        [--json startup.json]
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.quantization import cpu_features  # noqa: E402
from benchmarks.serve_bench import wait_healthy  # noqa: E402
from engine.cache_dir import CACHE_ENV, cache_dir  # noqa: E402

OFFLINE = """
import json, sys, time
started = float(sys.argv[2])
from engine import LLM, SamplingParams
llm = LLM(model=sys.argv[1])
ready = time.time() - started
llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
print(json.dumps({"ready_s": ready, "answer_s": time.time() - started}), flush=True)
if len(sys.argv) > 3:  # held: the parent reads this process's memory, then closes stdin
    sys.stdin.read()
"""


def fresh_cache() -> dict[str, str]:
    """An environment whose cbserve cache holds this machine's compiled kernels and nothing else
    (removed when this process exits)."""
    root = Path(tempfile.mkdtemp(prefix="cbserve-cache-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    (root / "kernels").symlink_to(cache_dir("kernels"))
    return os.environ | {CACHE_ENV: str(root)}


def offline(path: str, env: dict[str, str]) -> dict[str, float]:
    child = subprocess.Popen([sys.executable, "-c", OFFLINE, path, str(time.time())], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    out = child.stdout.read()
    peak = reap(child)
    return json.loads(out.strip().splitlines()[-1]) | {"peak_gb": peak}


def reap(child: subprocess.Popen) -> float:
    """Waits for the child; its peak resident memory, GB (ru_maxrss)."""
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode not in (0, -signal.SIGTERM):
        raise RuntimeError(f"{child.args[:3]} exited with {child.returncode}")
    return usage.ru_maxrss / 1e6


def private_gb(pid: int) -> float:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:])
    return sum(int(fields[k].split()[0]) for k in ("Private_Clean", "Private_Dirty")) / 1e6


def two_engines(path: str) -> list[float]:
    """Each of two engines' memory beside the pages they share, both ready on the same file."""
    children = []
    for _ in range(2):
        child = subprocess.Popen([sys.executable, "-c", OFFLINE, path, str(time.time()), "hold"], cwd=ROOT,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        child.stdout.readline()  # ready and answered
        children.append(child)
    held = [private_gb(child.pid) for child in children]
    for child in children:
        child.stdin.close()
        reap(child)
    return held


def served(path: str, env: dict[str, str], timeout_s: float) -> float:
    """Seconds from the launcher's start to its first answer, with the model set in configs/serve.yaml."""
    config = yaml.safe_load((ROOT / "configs" / "serve.yaml").read_text())
    config["applications"][0]["args"]["engine"]["model"] = path
    directory = Path(tempfile.mkdtemp(prefix="cbserve-startup-"))
    (directory / "serve.yaml").write_text(yaml.safe_dump(config))
    env = {k: v for k, v in env.items() if not k.startswith("RAY_")} | {"RAY_TMPDIR": str(directory)}
    start = time.monotonic()
    launcher = subprocess.Popen([sys.executable, "-m", "serve_app.launch", str(directory / "serve.yaml")], cwd=ROOT,
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def alive() -> None:
        if launcher.poll() is not None:
            raise RuntimeError(f"the launcher exited with {launcher.returncode}")

    try:
        wait_healthy("http://127.0.0.1:8000", timeout_s, alive, poll_s=0.05)
        httpx.post("http://127.0.0.1:8000/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                   timeout=120).raise_for_status()
        return time.monotonic() - start
    finally:
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(120)
        shutil.rmtree(directory, ignore_errors=True)


def llama_server(binary: str, path: str, timeout_s: float) -> dict[str, float]:
    start = time.monotonic()
    server = subprocess.Popen([binary, "-m", path, "--port", "8090", "-t", "2", "-c", "4096", "--no-webui"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy("http://127.0.0.1:8090", timeout_s, poll_s=0.05)
        httpx.post("http://127.0.0.1:8090/completion", json={"prompt": "Hi", "n_predict": 2},
                   timeout=120).raise_for_status()
        answer = time.monotonic() - start
    finally:
        server.send_signal(signal.SIGTERM)
        peak = reap(server)
    return {"answer_s": answer, "peak_gb": peak}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", required=True, help="GGUF files, comma-separated")
    p.add_argument("--llama-server", help="llama.cpp's llama-server binary")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--no-serve", action="store_true", help="offline and llama.cpp only")
    p.add_argument("--json")
    args = p.parse_args()
    print(f"CPU: {cpu_features()}; {os.cpu_count()} cores", flush=True)
    results = {}
    for path in args.models.split(","):
        runs: dict[str, list] = {}
        for r in range(args.rounds):
            steps = [("cbserve", None), ("llama.cpp", None)]
            for name, _ in steps if r % 2 == 0 else steps[::-1]:
                if name == "llama.cpp" and args.llama_server:
                    runs.setdefault("llama.cpp", []).append(llama_server(args.llama_server, path, args.timeout))
                elif name == "cbserve":
                    env = fresh_cache()
                    runs.setdefault("offline cold", []).append(offline(path, env))
                    runs.setdefault("offline warm", []).append(offline(path, env))
                    if not args.no_serve:
                        env = fresh_cache()
                        runs.setdefault("served cold", []).append({"answer_s": served(path, env, args.timeout)})
                        runs.setdefault("served warm", []).append({"answer_s": served(path, env, args.timeout)})
            print(f"{Path(path).name} round {r + 1}: {json.dumps({k: v[-1] for k, v in runs.items()})}", flush=True)
        runs["two engines private_gb"] = [two_engines(path)]
        medians = {kind: {key: statistics.median(run[key] for run in rs) for key in rs[0]}
                   for kind, rs in runs.items() if isinstance(rs[0], dict)}
        medians["two engines private_gb"] = runs["two engines private_gb"][0]
        results[path] = {"size_gb": os.path.getsize(path) / 1e9, "runs": runs, "medians": medians}
        print(f"{Path(path).name} ({results[path]['size_gb']:.2f} GB) medians: {json.dumps(medians)}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_features(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
