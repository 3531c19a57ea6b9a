"""The engine process's host work per step at a full batch, on the CPU: what a GPU's decode step
waits for once the step itself runs in a CUDA graph (on an H100, 5.5 ms of a 256-row step of
8.7 ms, BENCHMARKS.md).

The engine is built from `configs/serve-gpu.yaml`'s engine arguments (priority policy, prefix
caching, 256 rows, async scheduling) on the CPU, with a Llama of one layer of width 64 and a
4,096-word vocabulary (one word per id, as cuda_engine.py's), so the forward is small; on the
CPU, a larger vocabulary's logits are freed and mapped again every step, time no GPU spends.
R requests (`--prompt` tokens each, 128 by default; a longer context is a wider block table)
decode together, driven by the engine process's own loop (`engine_core.StepLoop`) at the config's
stream flush interval, each emit pickled as the engine process sends it. Per step, means over
`--steps` steps (garbage collection's pauses are rare and long, so medians would hide them): the
loop's wall time; the forward (the model's call) and the greedy argmax, both computed on the CPU
here and queued on a GPU; the host work (the rest); its parts (each timed around its call); the
garbage collector's pauses by generation. Repeated `--repeats` times in one process. `--profile`:
then the Python functions that take the host's time (cProfile, `--steps` more steps).
`--prefill P`: a request with a P-token prompt and one token to generate arrives every step, as
the engine process receives requests (an AddRequest command), so every step is a mixed one, the
steady state of a server whose requests keep arriving (`--rows 255`: room for it in the batch).

    python benchmarks/investigations/host_step.py [--rows 256] [--prompt 128] [--prefill 0] [--steps 200]
        [--repeats 3] [--profile] [--json OUT]
"""
import argparse
import cProfile
import gc
import io
import itertools
import json
import os
import pickle
import pstats
import statistics
import sys
import tempfile
import time

import torch
import yaml

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, _ROOT)
from benchmarks.cuda_engine import SHAPES, shaped_model  # noqa: E402
from benchmarks.investigations.cuda_step import timed_calls  # noqa: E402
from benchmarks.quantization import cpu_features  # noqa: E402
from benchmarks.workload import random_prompt  # noqa: E402
from engine import SamplingParams  # noqa: E402
from engine.engine_core import AddRequest, StepLoop  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402

TINY = dict(SHAPES["smollm2-135m"], vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2)
WARMUP_STEPS = 20
ARRIVAL = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
ARRIVALS = itertools.count()


def served_engine_args() -> tuple[dict, float]:
    """The GPU config's engine arguments, on the CPU in fp32 (unquantized, as on a GPU); its stream
    flush interval."""
    with open(os.path.join(_ROOT, "configs", "serve-gpu.yaml")) as f:
        engine = yaml.safe_load(f)["applications"][0]["args"]["engine"]
    return dict(engine["engine_args"], device="cpu", dtype="float32", quantization="none", async_scheduling=True), \
        engine["stream_flush_interval_s"]


class GCPauses:
    """The garbage collector's pause time by generation, while installed."""

    def __init__(self):
        self.seconds: dict[int, float] = {}
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            generation = info["generation"]
            self.seconds[generation] = self.seconds.get(generation, 0.0) + time.perf_counter() - self._start


def step_parts(eng: LLMEngine) -> list[tuple[object, str, str]]:
    """The step's parts timed (owner, attribute, name shown)."""
    import engine.runner.model_runner as runner_module
    import engine.sampler as sampler_module
    return [(eng, "step", "step"), (eng.scheduler, "schedule", "schedule"),
            (eng.scheduler, "schedule_ahead", "schedule ahead"),
            (eng.runner, "launch", "runner launch"), (runner_module, "build_inputs", "build inputs"),
            (eng.runner, "model", "forward"), (eng.runner.sampler, "launch", "sampler launch"),
            (sampler_module, "greedy_tokens", "argmax"), (eng.runner, "collect", "collect"),
            (eng.scheduler, "update_from_output", "update"), (eng.output_processor, "process", "output processing")]


def measure(eng: LLMEngine, flush_interval_s: float, steps: int, prefill: int = 0) -> dict:
    """Runs `steps` iterations of the engine process's loop, a request of `prefill` prompt
    tokens arriving at each where that is set; ms per step of each part."""
    sink: dict[str, float] = {"emit (pickled)": 0.0}
    sent = [0]

    def emit(outputs) -> None:
        t0 = time.perf_counter()
        sent[0] += len(pickle.dumps(outputs, protocol=pickle.HIGHEST_PROTOCOL))
        sink["emit (pickled)"] += time.perf_counter() - t0

    remaining = [steps]

    def receive(timeout: float) -> list | None:
        remaining[0] -= 1
        if remaining[0] < 0:
            return None
        if not prefill:
            return []
        n = next(ARRIVALS)
        return [AddRequest(f"arrival-{n}", random_prompt(prefill, TINY["vocab_size"], seed=n), ARRIVAL)]

    loop = StepLoop(eng, emit, flush_interval_s)
    steps_ahead = eng.get_stats().num_steps_ahead
    pauses = GCPauses()
    gc.callbacks.append(pauses)
    try:
        with timed_calls(step_parts(eng), sink):
            t0 = time.perf_counter()
            loop.run(receive)
            wall = time.perf_counter() - t0
    finally:
        gc.callbacks.remove(pauses)
    ms = {name: seconds / steps * 1e3 for name, seconds in sink.items()}
    ms["wall"] = wall / steps * 1e3
    ms["host"] = ms["wall"] - ms["forward"] - ms["argmax"]
    ms["rest of the step"] = ms["step"] - sum(ms[name] for name in (
        "schedule", "schedule ahead", "runner launch", "collect", "update", "output processing"))
    ms["rest of the runner launch"] = ms["runner launch"] - ms["build inputs"] - ms["forward"] - ms["sampler launch"]
    ms["loop"] = ms["wall"] - ms["step"] - ms["emit (pickled)"]
    for generation, seconds in sorted(pauses.seconds.items()):
        ms[f"gc gen{generation}"] = seconds / steps * 1e3
    ms["bytes sent"] = sent[0] / steps
    ms["steps launched ahead"] = (eng.get_stats().num_steps_ahead - steps_ahead) / steps
    return ms


def profile(eng: LLMEngine, flush_interval_s: float, steps: int, prefill: int) -> str:
    python = cProfile.Profile()
    python.enable()
    measure(eng, flush_interval_s, steps, prefill)
    python.disable()
    text = io.StringIO()
    pstats.Stats(python, stream=text).sort_stats("tottime").print_stats(30)
    return text.getvalue()


def run(rows: int, prefill: int, steps: int, profiled: bool, prompt: int = 128) -> dict:
    args, flush_interval_s = served_engine_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = shaped_model(tmp, TINY, device="cpu", dtype=torch.float32)
        eng = LLMEngine.from_engine_args(model, **args)
        warmup = WARMUP_STEPS + rows * prompt // args["max_num_batched_tokens"]  # the prefills, and the batch settled
        params = SamplingParams(max_tokens=(2 + profiled) * steps + warmup + 8, temperature=0, ignore_eos=True)
        for row in range(rows):
            eng.add_request(f"r{row}", random_prompt(prompt, TINY["vocab_size"], seed=row), params)
        measure(eng, flush_interval_s, warmup)
        result = measure(eng, flush_interval_s, steps, prefill)
        result["rows"] = len(eng.scheduler.running)
        if profiled:
            print(profile(eng, flush_interval_s, steps, prefill), flush=True)
        return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--prefill", type=int, default=0, help="a request of this many prompt tokens arrives every step")
    ap.add_argument("--prompt", type=int, default=128, help="each decoding request's prompt tokens")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="then list the host's Python functions by time")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the forward's)")
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(cpu_features(), flush=True)
    runs = []
    for repeat in range(args.repeats):
        runs.append(run(args.rows, args.prefill, args.steps, args.profile, args.prompt))
        print(f"run {repeat + 1}:", json.dumps({k: round(v, 3) for k, v in runs[-1].items()}), flush=True)
    medians = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    print("median:", json.dumps({k: round(v, 3) for k, v in medians.items()}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_features(), "runs": runs, "median": medians}, f, indent=2)


if __name__ == "__main__":
    main()
