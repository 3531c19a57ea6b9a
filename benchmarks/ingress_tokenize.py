"""What tokenizing a burst's text prompts costs the ingress's event loop: each prompt tokenized on
the loop by its request's handler (`engine.tokenization.encode_text`, the ingress before), against
`serve_app.batch_tokenizer.BatchTokenizer` (batches in a worker thread).

`--requests` handlers at once, each with a text prompt of about `--tokens` tokens of SmolLM2's
tokenizer (the embedded model's; random words), while a ticker on the same loop sleeps 1 ms at a
time, as the loop's other work (streams) would wait: the loop's longest stall (the ticker's
longest gap beyond its 1 ms), the loop thread's CPU time, and the wall time until every prompt has
its ids. Medians of `--repeats`, the two alternated; the ids of both ways are checked equal.

    python benchmarks/ingress_tokenize.py [--requests 256] [--tokens 150] [--repeats 5] [--json OUT]
"""
import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.quantization import cpu_features  # noqa: E402
from engine.model_loader import load_vocabulary  # noqa: E402
from engine.tokenization import encode_text  # noqa: E402
from serve_app.batch_tokenizer import BatchTokenizer  # noqa: E402

WORDS = ("the of and to in is was for on that with as by at from his her an which their were are been has "
         "river mountain quietly engine observe window candle ancient harbor signal").split()


def prompts(num: int, tokens: int) -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(tokens)) for _ in range(num)]


async def burst(texts: list[str], encode) -> dict:
    """Every text's ids through `encode` (a coroutine function), one task a text, with the ticker."""
    stalls, done = [0.0], asyncio.Event()

    async def ticker() -> None:
        while not done.is_set():
            t0 = time.perf_counter()
            await asyncio.sleep(0.001)
            stalls[0] = max(stalls[0], time.perf_counter() - t0 - 0.001)

    ticking = asyncio.ensure_future(ticker())
    await asyncio.sleep(0.01)
    cpu0, t0 = time.thread_time(), time.perf_counter()
    ids = await asyncio.gather(*(encode(text) for text in texts))
    wall, cpu = time.perf_counter() - t0, time.thread_time() - cpu0
    done.set()
    await ticking
    return {"ids": ids, "longest stall ms": stalls[0] * 1e3, "loop CPU ms": cpu * 1e3, "wall ms": wall * 1e3}


async def main(args: argparse.Namespace) -> dict:
    tokenizer = load_vocabulary(None)[0]
    tokens = BatchTokenizer(tokenizer)
    texts = prompts(args.requests, args.tokens)

    async def on_loop(text: str) -> list[int]:
        return encode_text(tokenizer, text)

    ways = {"on the loop": on_loop, "BatchTokenizer": tokens.encode}
    runs: dict[str, list[dict]] = {way: [] for way in ways}
    for _ in range(args.repeats):
        for way, encode in ways.items():
            runs[way].append(await burst(texts, encode))
    assert runs["on the loop"][0]["ids"] == runs["BatchTokenizer"][0]["ids"]
    num_tokens = sum(map(len, runs["on the loop"][0]["ids"]))
    figures = ("longest stall ms", "loop CPU ms", "wall ms")
    return {"cpu": cpu_features(), "requests": args.requests, "prompt tokens": num_tokens,
            "runs": {way: [{k: round(r[k], 2) for k in figures} for r in rs] for way, rs in runs.items()},
            "median": {way: {k: round(statistics.median(r[k] for r in rs), 2) for k in figures}
                       for way, rs in runs.items()}}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=150)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    result = asyncio.run(main(args))
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
