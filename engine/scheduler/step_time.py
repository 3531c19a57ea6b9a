"""What a step costs, learnt while serving: step seconds ~= fixed + per_token * tokens.

The scheduler asks it how many tokens fit a step-latency target (`target_step_latency_s`), so
that running decodes keep their time per output token under the target whatever the hardware,
model or load, and prefill chunks take what is left. Fitted by exponentially weighted least
squares: recent steps count most, so a change of load or of machine speed shows in ~20 steps.
Speculative decoding asks what a step of a given size costs (engine.scheduler.speculation.adaptive).
Step time is not linear in tokens at small sizes on a CPU (one row is a matrix-vector product; two
rows already cost a matrix-matrix product that reads the weights more slowly, and the kernels
change with the step's size), so each size seen keeps its own recent time (`measured`), and sizes
not seen yet are priced from the nearest one seen (`estimate`). The
scheduler keeps a second one for a draft model's passes, sized by the requests a pass drafts for.
"""
from __future__ import annotations

from dataclasses import dataclass, field

_MIN_STEPS = 4  # observations before the fit is trusted
_MIN_TOKEN_SPREAD = 1.0  # tokens of standard deviation needed to tell fixed from per-token cost
_SIZE_DECAY = 0.7  # weight of a step size's past time per new step of that size


@dataclass(slots=True)
class StepTimeModel:
    decay: float = 0.95  # weight of the past per new step
    _weight: float = 0.0  # weighted sums of 1, tokens, seconds, tokens^2, tokens * seconds
    _tokens: float = 0.0
    _seconds: float = 0.0
    _tokens_sq: float = 0.0
    _tokens_seconds: float = 0.0
    _steps: int = 0
    _last_per_token: float | None = None  # from the last window whose step sizes varied enough
    _by_size: dict[int, float] = field(default_factory=dict)  # tokens -> recent seconds of a step that size

    def observe(self, tokens: int, seconds: float) -> None:
        d = self.decay
        self._weight = d * self._weight + 1.0
        self._tokens = d * self._tokens + tokens
        self._seconds = d * self._seconds + seconds
        self._tokens_sq = d * self._tokens_sq + tokens * tokens
        self._tokens_seconds = d * self._tokens_seconds + tokens * seconds
        self._steps += 1
        previous = self._by_size.get(tokens)
        self._by_size[tokens] = seconds if previous is None else _SIZE_DECAY * previous + (1 - _SIZE_DECAY) * seconds
        per_token = self._slope()
        if per_token is not None:
            self._last_per_token = per_token

    def _slope(self) -> float | None:
        """Seconds per token fitted over the window; None if its step sizes barely vary."""
        mean_tokens, mean_seconds = self._tokens / self._weight, self._seconds / self._weight
        variance = self._tokens_sq / self._weight - mean_tokens ** 2
        if variance < _MIN_TOKEN_SPREAD ** 2:
            return None
        per_token = (self._tokens_seconds / self._weight - mean_tokens * mean_seconds) / variance
        return per_token if per_token > 0 else None

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None before enough steps. When recent step
        sizes barely vary, the per-token cost is the last one that could be separated, with the
        fixed cost re-fitted around it; with none ever, all the time is charged per token (the
        cautious reading: it allows the fewest tokens)."""
        if self._steps < _MIN_STEPS or self._tokens <= 0:
            return None
        mean_tokens, mean_seconds = self._tokens / self._weight, self._seconds / self._weight
        per_token = self._last_per_token
        if per_token is not None and per_token * mean_tokens < mean_seconds:
            return mean_seconds - per_token * mean_tokens, per_token
        return 0.0, mean_seconds / mean_tokens

    def measured(self, tokens: int) -> float | None:
        """The recent time of a step of exactly `tokens` tokens; None if no step that size ran."""
        return self._by_size.get(tokens)

    def estimate(self, tokens: int) -> float | None:
        """A step of `tokens` tokens: the recent time of the nearest size measured, plus the
        per-token cost of the difference where one could be separated (else nothing for it);
        None before any step. Optimistic where `fit` is cautious: it prices a size to try, and a
        size tried is then measured. The line's own value, or all of a size's time charged per
        token while every step had one size, would price a draft pass over 4 requests at 4x one
        over 1, and a size priced so would never be tried."""
        if not self._by_size:
            return None
        nearest = min(self._by_size, key=lambda size: (abs(size - tokens), size))
        return max(self._by_size[nearest] + (self._last_per_token or 0.0) * (tokens - nearest), 0.0)

    def tokens_within(self, seconds: float) -> int | None:
        """Most tokens a step can take and still finish within `seconds`; None while unfitted."""
        fitted = self.fit()
        if fitted is None:
            return None
        fixed, per_token = fitted
        return max(int((seconds - fixed) / per_token + 1e-6), 0)  # 39.99999 tokens is 40
