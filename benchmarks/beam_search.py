"""Beam search through the engine: searches per second, beam steps per second, and the tokens the
forward computed per beam step (1.0 when every step computes only each beam's new token).

The embedded model in its default mode; `--searches` prompts of different lengths searched
together (`LLM.beam_search`, their beams batched), at beam widths 2 and 4, `--tokens` new tokens
at most. Each round's prompts are new to the prefix cache; reported are medians of the rounds.

    python -m benchmarks.beam_search [--searches 8] [--tokens 48] [--rounds 3]
"""
from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.quantization import cpu_features
from engine import LLM
from engine.beam_search import BeamSearchParams

TOPICS = ["the history of the printing press", "how tides work", "a recipe for bread", "why the sky is blue",
          "the rules of chess", "how vaccines train the immune system", "the water cycle", "what a compiler does"]


def prompts(num: int, round_index: int) -> list[str]:
    """Prompts of 10 to ~150 tokens: a question asked with more context each time."""
    return [f"({round_index}) Explain {TOPICS[i % len(TOPICS)]}. " + "Give background, details and examples. " * (i * 3)
            for i in range(num)]


def run(llm: LLM, batch: list[str], width: int, tokens: int) -> dict[str, float]:
    before = llm.engine.get_stats()
    t0 = time.perf_counter()
    outputs = llm.beam_search(batch, BeamSearchParams(width, tokens))
    elapsed = time.perf_counter() - t0
    after = llm.engine.get_stats()
    assert all(len(o.outputs) == width for o in outputs)
    beam_steps = after.num_generation_tokens - before.num_generation_tokens  # one sampled token per beam step
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    computed = after.num_prompt_tokens - before.num_prompt_tokens - prompt_tokens + len(batch)
    return {"seconds": elapsed, "searches_per_s": len(batch) / elapsed, "beam_steps_per_s": beam_steps / elapsed,
            "computed_per_beam_step": computed / beam_steps}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--searches", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(max_num_seqs=64)
    llm.beam_search(prompts(2, -1), BeamSearchParams(2, 4))  # warm-up
    print(cpu_features())
    print(f"model: {llm.engine.model_report}")
    print("| beam width | searches/s | beam steps/s | computed tokens per beam step | seconds |")
    print("|---|---|---|---|---|")
    for width in (2, 4):
        rounds = [run(llm, prompts(args.searches, width * 100 + r), width, args.tokens) for r in range(args.rounds)]
        m = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
        print(f"| {width} | {m['searches_per_s']:.2f} | {m['beam_steps_per_s']:.1f} | "
              f"{m['computed_per_beam_step']:.2f} | {m['seconds']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
