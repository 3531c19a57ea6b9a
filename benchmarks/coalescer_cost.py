"""What the engine replica's stream coalescer (`serve_app.coalescer.StreamCoalescer`) costs its event
loop an engine output: one request's stream of `--outputs` outputs, each a pass of the loop after the
last, under a clock that puts the reads `--gap` flush intervals apart (1 or more: every output sent
at once, as the engine's own outputs, paced at the interval, mostly come; 0.6: every other one held
until the next). Process CPU time an output, in microseconds, medians of `--repeats`.
`--against FILE` measures another coalescer.py beside it (an earlier tree's, from `git show`),
the two alternated.

    python benchmarks/coalescer_cost.py [--gap 2] [--outputs 20000] [--repeats 5] [--against OLD.py] [--json OUT]
"""
import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.quantization import cpu_features  # noqa: E402
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput  # noqa: E402
from serve_app.coalescer import StreamCoalescer  # noqa: E402

INTERVAL_S = 0.1  # the GPU config's stream_flush_interval_s


def _load(path: str) -> type:
    spec = importlib.util.spec_from_file_location("coalescer_against", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.StreamCoalescer


class _Clock:
    """Advances `gap` flush intervals a reading."""

    def __init__(self, gap: float):
        self.now, self.step = 0.0, gap * INTERVAL_S

    def __call__(self) -> float:
        self.now += self.step
        return self.now


async def _source(outputs: list[RequestOutput]):
    for output in outputs:
        await asyncio.sleep(0)  # the next output arrives later
        yield output


async def _cost_us(cls: type, outputs: list[RequestOutput], gap: float) -> tuple[float, int]:
    coalescer = cls(INTERVAL_S, clock=_Clock(gap))
    start = time.process_time()
    chunks = 0
    async for _ in coalescer.coalesce(_source(outputs)):
        chunks += 1  # sent on, as the replica puts each in an outbox
    return (time.process_time() - start) / len(outputs) * 1e6, chunks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gap", type=float, default=2.0, help="reads this many flush intervals apart")
    p.add_argument("--outputs", type=int, default=20000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--against", default=None, help="another coalescer.py to measure beside this tree's")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    n = args.outputs
    outputs = [RequestOutput("r", None, [1, 2], [CompletionOutput(0, " w", [i], None)], i == n - 1,
                             RequestMetrics(0.0)) for i in range(n)]
    kinds = {"this tree": StreamCoalescer} | ({args.against: _load(args.against)} if args.against else {})
    costs: dict[str, list[float]] = {name: [] for name in kinds}
    chunks: dict[str, int] = {}
    for _ in range(args.repeats):
        for name, cls in kinds.items():
            us, chunks[name] = asyncio.run(_cost_us(cls, outputs, args.gap))
            costs[name].append(us)
    print(cpu_features())
    print(f"{n} outputs, reads {args.gap} flush intervals apart")
    for name in kinds:
        print(f"{name}: {statistics.median(costs[name]):.2f} us an output (median of {args.repeats}: "
              f"{', '.join(f'{c:.2f}' for c in costs[name])}), {chunks[name]} chunks")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_features(), "outputs": n, "gap": args.gap, "us_per_output": costs,
                       "chunks": chunks}, f, indent=1)


if __name__ == "__main__":
    main()
