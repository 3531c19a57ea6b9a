"""Constrained decoding's cost per step: the same batch with and without a JSON schema.

The embedded model in its default mode, B requests (B = 1, 16, 64) each generating exactly
`--tokens` tokens greedily: free ones with ignore_eos, constrained ones under a schema that
cannot end before then (an array of at least 100 records), so both runs take the same steps and
the difference is the constraint's work (each row's mask, the apply, the matcher's advance).
Rounds alternate free and constrained; reported are medians of output tok/s and their ratio.

    python -m benchmarks.structured_outputs [--tokens 64] [--rounds 3]
"""
from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.quantization import cpu_features
from engine import LLM, SamplingParams
from engine.sampling_params import StructuredOutputsParams

SCHEMA = {"type": "array", "minItems": 100, "items": {
    "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                     "role": {"enum": ["admin", "user", "guest"]}},
    "required": ["name", "age", "role"], "additionalProperties": False}}
PROMPTS = ["List the people in the team as JSON.", "Write the guest list as JSON records.",
           "Give me a JSON array of users.", "Output the staff directory in JSON."]


def run(llm: LLM, batch: int, tokens: int, constrained: bool) -> float:
    """Output tokens per second for one batch."""
    spec = StructuredOutputsParams(json=SCHEMA) if constrained else None
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=not constrained, structured_outputs=spec)
    prompts = [PROMPTS[i % len(PROMPTS)] + f" ({i})" for i in range(batch)]
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == batch * tokens, "a request ended early: the step counts would differ"
    return produced / elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(max_num_seqs=64)
    run(llm, 4, 8, True)  # warm-up: the compile, the kernels
    print(cpu_features())
    print(f"model: {llm.engine.model_report}")
    print("| batch | free tok/s | constrained tok/s | constrained / free |")
    print("|---|---|---|---|")
    for batch in (1, 16, 64):
        free, constrained = [], []
        for _ in range(args.rounds):
            free.append(run(llm, batch, args.tokens, False))
            constrained.append(run(llm, batch, args.tokens, True))
        f, c = statistics.median(free), statistics.median(constrained)
        print(f"| {batch} | {f:.1f} | {c:.1f} | {c / f:.3f} |", flush=True)


if __name__ == "__main__":
    main()
