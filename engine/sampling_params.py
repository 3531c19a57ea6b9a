"""User-facing sampling parameters, validated on construction (vLLM's SamplingParams fields)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 or -1 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None  # stop strings, not included in the text
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # number of top logprobs to return per token (plus the sampled one)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self):
        checks = (
            ("n", self.n >= 1, "must be >= 1"),
            ("max_tokens", self.max_tokens >= 1, "must be >= 1"),
            ("temperature", self.temperature >= 0, "must be >= 0"),
            ("top_k", self.top_k >= 0, "must be >= 1, or 0/-1 to disable"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            ("repetition_penalty", self.repetition_penalty > 0, "must be > 0"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "must be in [0, 20]"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
            ("stop_token_ids", all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             "must be non-negative ints"),
        )
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"{name} {rule}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
