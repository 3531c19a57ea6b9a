"""Speculative decoding on the embedded model: plain decoding vs n-gram drafts, same run.

Two workloads: extraction (the answer repeats a passage of the prompt) and free chat. For each
batch size, plain and ngram runs alternate (`--repeats` rounds); the figure is the median output
tokens per second, with the ratio to plain, the acceptance rate and the mean accepted drafts per
verifying step. Outputs are checked identical (greedy).

    python benchmarks/speculative.py [--batch-sizes 1,4,16] [--repeats 3] [--k 4]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))
from benchmarks.workload import Stopwatch  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402

PASSAGES = [
    "Continuous batching keeps the accelerator busy by adding new requests to the running batch at every "
    "step, while a paged key-value cache lets many requests share memory without fragmentation.",
    "The committee met on Tuesday to review the budget, approved the new library wing, and asked the "
    "treasurer to publish the quarterly accounts before the end of the month.",
    "def add(a, b):\n    return a + b\n\ndef multiply(a, b):\n    return a * b\n",
    "Rivers carry sediment from the mountains to the sea, building deltas where the current slows and the "
    "fine sand settles into broad, fertile plains.",
]
QUESTIONS = ["What is the capital of France?", "Name three colors.", "Write a haiku about the sea.",
             "Why is the sky blue?"]


def workload(name: str, batch: int) -> list[list[dict]]:
    if name == "extraction":
        items = [f"Repeat the following text exactly, word for word:\n\n{p}" for p in PASSAGES]
    else:
        items = QUESTIONS
    return [[{"role": "user", "content": items[i % len(items)]}] for i in range(batch)]


def run(llm: LLM, chats: list[list[dict]], max_tokens: int) -> tuple[float, list[list[int]], dict]:
    before = llm.engine.get_stats()
    with Stopwatch() as clock:
        outputs = llm.chat(chats, SamplingParams(max_tokens=max_tokens, temperature=0), use_tqdm=False)
    after = llm.engine.get_stats()
    tokens = [o.outputs[0].token_ids for o in outputs]
    proposed = after.num_spec_proposed_tokens - before.num_spec_proposed_tokens
    accepted = after.num_spec_accepted_tokens - before.num_spec_accepted_tokens
    return sum(map(len, tokens)) / clock.wall_s, tokens, {
        "steps": after.num_steps - before.num_steps, "proposed": proposed, "accepted": accepted}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-sizes", default="1,4,16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    llms = {"plain": LLM(), "ngram": LLM(speculative_config={"method": "ngram", "num_speculative_tokens": args.k})}
    rows = []
    for name in ("extraction", "chat"):
        for batch in map(int, args.batch_sizes.split(",")):
            chats = workload(name, batch)
            speeds: dict[str, list[float]] = {"plain": [], "ngram": []}
            outputs, counts = {}, {}
            for _ in range(args.repeats):
                for mode, llm in llms.items():  # interleaved: drift hits both alike
                    tok_s, outputs[mode], counts[mode] = run(llm, chats, args.max_tokens)
                    speeds[mode].append(tok_s)
            assert outputs["ngram"] == outputs["plain"], f"{name} batch {batch}: outputs differ"
            plain, ngram = statistics.median(speeds["plain"]), statistics.median(speeds["ngram"])
            spec = counts["ngram"]
            row = {"workload": name, "batch": batch, "plain_tok_s": round(plain, 1), "ngram_tok_s": round(ngram, 1),
                   "ratio": round(ngram / plain, 2),
                   "acceptance": round(spec["accepted"] / max(spec["proposed"], 1), 2),
                   "steps_plain": counts["plain"]["steps"], "steps_ngram": spec["steps"]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
