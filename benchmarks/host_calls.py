"""Single calls of the engine process's per-step host work, each timed alone on a steady batch of
decodes: finer than host_step.py's step parts, whose step-to-step noise on a shared machine
(a tenth) hides a change of a few percent of the step.

The engine of host_step.py (`configs/serve-gpu.yaml`'s engine arguments on the CPU, a one-layer
Llama of width 64), `--rows` requests decoding together after the prefills settled, then, on the
step launched ahead: the KV manager's `allocate_slots` for two tokens of every running request
(what scheduling ahead asks; repeated calls find the blocks there), `schedule_ahead`, the
runner's `build_inputs`, and the sampler's pass over the rows' kinds. Microseconds a call, the
least of `--repeats` runs of `--number` calls each.

    python benchmarks/host_calls.py [--rows 256] [--number 200] [--repeats 7] [--json OUT]
"""
import argparse
import json
import os
import sys
import tempfile
import timeit

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.cuda_engine import shaped_model  # noqa: E402
from benchmarks.host_step import TINY, WARMUP_STEPS, measure, served_engine_args  # noqa: E402
from benchmarks.quantization import cpu_features  # noqa: E402
from benchmarks.workload import random_prompt  # noqa: E402
from engine import SamplingParams  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.runner.inputs import build_inputs  # noqa: E402
from engine.sampler import _RowKinds  # noqa: E402


def timed_calls(rows: int, number: int, repeats: int) -> dict[str, float]:
    args, flush_interval_s = served_engine_args()
    with tempfile.TemporaryDirectory() as tmp:
        eng = LLMEngine.from_engine_args(shaped_model(tmp, TINY, device="cpu", dtype=torch.float32), **args)
        params = SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True)
        for row in range(rows):
            eng.add_request(f"r{row}", random_prompt(128, TINY["vocab_size"], seed=row), params)
        measure(eng, flush_interval_s, WARMUP_STEPS + rows * 128 // args["max_num_batched_tokens"])
        out = eng._ahead.out  # a step of decodes launched ahead, as most steps are
        scheduler, kv = eng.scheduler, eng.scheduler.kv
        requests = [item.request for item in out.scheduled]

        def allocate() -> None:
            for request in requests:
                kv.allocate_slots(request, 2)

        calls = {f"allocate_slots x{len(requests)}": allocate,
                 "schedule_ahead": lambda: scheduler.schedule_ahead(out),
                 "build_inputs": lambda: build_inputs(out.scheduled, kv.block_size, torch.device("cpu")),
                 "sampler row kinds": lambda: _RowKinds.of(requests)}
        return {name: min(timeit.repeat(call, number=number, repeat=repeats)) / number * 1e6
                for name, call in calls.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--number", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(cpu_features(), flush=True)
    us = timed_calls(args.rows, args.number, args.repeats)
    print(json.dumps({name: round(value, 1) for name, value in us.items()}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_features(), "rows": args.rows, "us": us}, f, indent=2)


if __name__ == "__main__":
    main()
