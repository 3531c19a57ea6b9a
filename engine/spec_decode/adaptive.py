"""How many of its drafts each request verifies this step: the counts that maximise the batch's
expected tokens per second, from each request's acceptance history and the step's measured cost.

Each request's chance that a draft is accepted, alpha, is estimated from its own verifications
(a of k drafts accepted: a successes and, when a < k, one failure; counts decay, so the estimate
follows the request). Drafts accepted while the target agrees, so the j-th draft yields a token
with probability alpha^j. The step-time model says a step costs fixed + c * tokens seconds. A step
of T seconds whose decodes emit N tokens gains alpha^j tokens and c seconds per draft added, which
raises N / T exactly when alpha^j > c * N / T; adding drafts in decreasing alpha^j while that
holds gives the largest N / T (a ratio of sums grows with each item above it and with no item
below it). So one rule covers every request and every load: at batch 1 on a CPU, where c is
small beside the step's fixed cost (weights are read once for 1 + k tokens), any plausible draft
pays; in a full batch c * N / T nears 1 and none does.

A request that gets no drafts learns nothing, so its counts decay toward the prior each step it
is denied one: speculation is retried now and then, and resumes when the load falls.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.scheduler.step_time import StepTimeModel

PRIOR_ACCEPTED, PRIOR_TRIALS = 1.0, 2.0  # alpha 0.5 before any evidence
DECAY = 0.8  # weight of a request's past verifications per new one (and per step denied drafts)


@dataclass(slots=True)
class AcceptanceEstimate:
    accepted: float = 0.0  # decayed counts of accepted drafts and of drafts tried
    trials: float = 0.0

    @property
    def alpha(self) -> float:
        return (self.accepted + PRIOR_ACCEPTED) / (self.trials + PRIOR_TRIALS)

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        self.accepted = DECAY * self.accepted + num_accepted
        self.trials = DECAY * self.trials + num_accepted + (num_accepted < num_proposed)

    def decay(self) -> None:
        self.accepted *= DECAY
        self.trials *= DECAY


class AdaptiveSpeculation:
    """Per-request acceptance estimates and the choice of how many drafts each request verifies."""

    def __init__(self):
        self._estimates: dict[str, AcceptanceEstimate] = {}

    def alpha(self, request_id: str) -> float:
        estimate = self._estimates.get(request_id)
        return estimate.alpha if estimate is not None else AcceptanceEstimate().alpha

    def observe(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        self._estimates.setdefault(request_id, AcceptanceEstimate()).observe(num_proposed, num_accepted)

    def forget(self, request_id: str) -> None:
        self._estimates.pop(request_id, None)

    def trim(self, request_ids: list[str], drafts: list[list[int]], step_time: StepTimeModel,
             num_decodes: int) -> list[list[int]]:
        """Each request's drafts cut to the count that maximises the step's expected tokens per
        second for `num_decodes` decoding requests; unchanged while the step cost is unmeasured."""
        fitted = step_time.fit()
        if fitted is None:
            return drafts
        fixed, per_token = fitted
        alphas = [self.alpha(request_id) for request_id in request_ids]
        candidates = sorted(((alphas[i] ** j, i) for i, d in enumerate(drafts) for j in range(1, len(d) + 1)),
                            reverse=True)
        tokens, seconds = float(num_decodes), fixed + per_token * num_decodes
        counts = [0] * len(drafts)
        for gain, i in candidates:
            if gain * seconds <= per_token * tokens:
                break
            tokens += gain
            seconds += per_token
            counts[i] += 1
        for request_id, d, count in zip(request_ids, drafts, counts):
            if d and count == 0:
                self._estimates.setdefault(request_id, AcceptanceEstimate()).decay()
        return [d[:count] for d, count in zip(drafts, counts)]
