"""Embeddings beside generation in one engine: 16 streams decode while a burst of 256 embedding
requests arrives. Reports the streams' time per output token while the burst is computed against
the same streams' alone over as many steps (target: at most 1.2x), and the burst's throughput
(inputs and prompt tokens a second). The embedded model in its default mode, `make serve`'s engine arguments,
the engine's own step loop (LLMEngine); medians of the rounds.

    .venv/bin/python benchmarks/embeddings.py --rounds 3 --json benchmarks/results/embeddings.json
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.quantization import cpu_features  # noqa: E402
from benchmarks.workload import DEFAULT_VOCAB_SIZE  # noqa: E402
from engine import LLMEngine, PoolingParams, SamplingParams  # noqa: E402

ENGINE_ARGS = dict(max_num_seqs=32, max_num_batched_tokens=512, policy="priority", enable_prefix_caching=True)
STREAMS, EMBEDDINGS = 16, 256


def _prompts(rng: random.Random, count: int, lo: int, hi: int) -> list[list[int]]:
    return [[rng.randrange(100, DEFAULT_VOCAB_SIZE) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def _run(engine: LLMEngine, steps: int | None = None, until_done: set[str] | None = None) -> tuple[float, int]:
    """Steps `steps` times, or until every request of `until_done` has finished: (seconds, steps)."""
    pending = set(until_done or ())
    count, t0 = 0, time.perf_counter()
    while (count < steps) if steps is not None else pending:
        for out in engine.step():
            if out.finished:
                pending.discard(out.request_id)
        count += 1
    return time.perf_counter() - t0, count


def _streams(engine: LLMEngine, tag: str, prompts: list[list[int]]) -> list[str]:
    """The streams decoding (their prompts in): their request ids."""
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True))
    _run(engine, steps=12)
    return ids


def _end(engine: LLMEngine, ids: list[str]) -> None:
    for request_id in ids:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()


def run_round(engine: LLMEngine, seed: int) -> dict[str, float]:
    """The streams with the burst, then the same streams alone for as many steps (their contexts
    grow alike, and with them the decode steps' time)."""
    rng = random.Random(seed)
    streams, burst = _prompts(rng, STREAMS, 64, 64), _prompts(rng, EMBEDDINGS, 32, 128)
    ids = _streams(engine, f"b{seed}", streams)
    for i, prompt in enumerate(burst):
        engine.add_request(f"e{seed}-{i}", prompt, PoolingParams())
    burst_s, steps = _run(engine, until_done={f"e{seed}-{i}" for i in range(EMBEDDINGS)})
    _end(engine, ids)
    ids = _streams(engine, f"a{seed}", streams)
    alone_s, _ = _run(engine, steps=steps)
    _end(engine, ids)
    tpot_alone, tpot_burst = alone_s / steps, burst_s / steps  # a step: one token per stream
    return {"tpot_alone_ms": 1000 * tpot_alone, "tpot_burst_ms": 1000 * tpot_burst,
            "tpot_ratio": tpot_burst / tpot_alone, "embeddings_per_s": EMBEDDINGS / burst_s,
            "embedding_tokens_per_s": sum(map(len, burst)) / burst_s, "burst_s": burst_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args()
    print(f"CPU: {cpu_features()}")
    engine = LLMEngine.from_engine_args(None, **ENGINE_ARGS)
    print(f"model: {engine.model_report.quantization}, KV {engine.model_report.kv_cache_dtype}")
    run_round(engine, seed=100)  # warm-up: kernels, caches, the step-time model
    rounds = [run_round(engine, seed=r) for r in range(args.rounds)]
    medians = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    for k, v in medians.items():
        print(f"{k}: {v:.3f}  (rounds: {', '.join(f'{r[k]:.3f}' for r in rounds)})")
    print(f"streams' TPOT during the burst / alone: {medians['tpot_ratio']:.2f}x (target <= 1.2)")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_features(), "engine_args": ENGINE_ARGS, "streams": STREAMS,
                                               "embeddings": EMBEDDINGS, "rounds": rounds, "medians": medians},
                                              indent=1))


if __name__ == "__main__":
    main()
