"""How many more tokens a decoding request is expected to emit, learnt from the requests that
finished lately: over those that ran longer than it has so far, the mean of their lengths (each
capped at its own cap), less what it has emitted; its cap while none did.

A draft model's one-time catch-up on a request is spread over these tokens
(engine.scheduler.speculation.adaptive). `max_tokens` alone is a loose bound where text ends on its own
(a reply of 35 tokens under a cap of 96): spread over it, a catch-up looks cheap for a request a
few tokens from its end.
"""
from __future__ import annotations

import bisect
import itertools
from collections import deque

WINDOW = 256  # finished requests remembered: recent ones speak for the current load


class OutputLengths:
    def __init__(self, window: int = WINDOW):
        self._recent: deque[int] = deque(maxlen=window)
        self._sorted: list[int] | None = None  # built on demand after a change
        self._suffix_sums: list[int] = []  # _suffix_sums[i] == sum(self._sorted[i:])

    def record(self, num_output_tokens: int) -> None:
        """A request that ended by itself (a stop) or at its cap."""
        self._recent.append(num_output_tokens)
        self._sorted = None

    def expected_remaining(self, num_emitted: int, cap: int) -> float:
        """Tokens a request that has emitted `num_emitted` of at most `cap` is expected to emit
        still (at least one)."""
        if self._sorted is None:
            self._sorted = sorted(self._recent)
            self._suffix_sums = list(itertools.accumulate(reversed(self._sorted), initial=0))[::-1]
        lengths, count = self._sorted, len(self._sorted)
        longer = bisect.bisect_right(lengths, num_emitted)  # first recorded length above num_emitted
        if longer == count:
            return float(max(cap - num_emitted, 1))
        capped = max(bisect.bisect_right(lengths, cap), longer)  # first above the cap: counts as the cap
        total = self._suffix_sums[longer] - self._suffix_sums[capped] + cap * (count - capped)
        return max(total / (count - longer) - num_emitted, 1.0)
