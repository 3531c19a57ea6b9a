"""What a streamed response costs the ingress's event loop beside its events: the app's SSE
response class (`serve_app.jobs.EventStreamResponse`, whose client's disconnect is watched by one
task) against the same class watched as Starlette's `StreamingResponse` watches (an anyio task
group, under uvicorn's ASGI spec version 2.3).

N responses at once, each of `--pieces` body messages over a send that returns at once, a client
that stays to the end; process CPU time a response, in microseconds, medians of `--repeats`,
the two alternated.

    python benchmarks/sse_response.py [--responses 2000] [--pieces 4] [--repeats 5] [--json OUT]
"""
import argparse
import asyncio
import json
import os
import statistics
import sys
import time

from starlette.responses import StreamingResponse

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.quantization import cpu_features  # noqa: E402
from serve_app.jobs import EventStreamResponse  # noqa: E402

SCOPE = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}  # what uvicorn reports


async def _pieces(n: int):
    for _ in range(n - 1):
        yield "data: {}\n\n", True
        await asyncio.sleep(0)  # the next event arrives later
    yield "data: [DONE]\n\n", False


class TaskGroupWatched(EventStreamResponse):
    __call__ = StreamingResponse.__call__


KINDS = {"task group (Starlette's)": TaskGroupWatched, "one task (EventStreamResponse)": EventStreamResponse}


async def cpu_us_per_response(kind: str, responses: int, pieces: int) -> float:
    stays = asyncio.Event()

    async def receive() -> dict:
        await stays.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        pass

    start = time.process_time()
    await asyncio.gather(*(KINDS[kind](_pieces(pieces))(SCOPE, receive, send) for _ in range(responses)))
    return (time.process_time() - start) / responses * 1e6


async def main(args: argparse.Namespace) -> dict:
    runs = {kind: [] for kind in KINDS}
    for _ in range(args.repeats):
        for kind in KINDS:
            runs[kind].append(round(await cpu_us_per_response(kind, args.responses, args.pieces), 1))
    before, after = (statistics.median(values) for values in runs.values())
    return {"cpu": cpu_features(), "responses": args.responses, "pieces": args.pieces, "runs_us": runs,
            "median_us": [before, after], "ratio": round(after / before, 3)}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--responses", type=int, default=2000)
    ap.add_argument("--pieces", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    result = asyncio.run(main(args))
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
