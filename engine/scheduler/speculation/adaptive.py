"""How many of its drafts each request verifies this step: the counts that maximise the batch's
expected tokens per second, from each request's acceptance history and the step's measured cost.

Each request's chance that a draft is accepted, alpha, is estimated from its own verifications
(a of k drafts accepted: a successes and, when a < k, one failure; counts decay, so the estimate
follows the request). Drafts are accepted while the target agrees, so the j-th draft yields a
token with probability alpha^j. Any set of drafts is best made of the ones with the largest
alpha^j, so the choice is how many of those to take: m drafts make a step of n + m tokens that
emits N + (their alpha^j) tokens, and the m with the most tokens per second (the step-time model's
cost of that step size, measured online, plus, for drafts from a model, one draft pass per draft
depth, each priced by the number of requests it drafts for, as the scheduler measures passes of each
size: the target's step time is measured without them; and, for a request the draft model has
not drafted for yet, its catch-up: the draft model computes the request's tokens so far once,
a cost spread over the tokens the request has left, each token it emits this step paying its
share) wins. So one rule covers every request and every load:
at batch 1 on a CPU, where a few more tokens cost little beside the step (weights are read once),
plausible drafts pay; in a full batch each draft costs a full token's compute and few or none do.
A size whose cost is not known yet is priced as the plain step's measured time plus the fitted
cost per token, tried, and then known; but the plain step itself (no drafts) is measured before
anything is weighed against it, or a wrong fit could keep it from ever running.

A request's prior is 0.5, or what the engine's drafts have earned lately over all requests where
that is less: where drafts are rarely right (a draft model that does not predict this target,
n-gram lookup on free chat) new requests do not each pay to learn it again. A draft model's
acceptance is a property of the pair of models more than of the text, so where its drafts have
earned more, that is the prior: a new request starts from it, its own verifications move it
from there, and it returns there while denied drafts (weighed with 0.5 instead, a request the
draft model is always right for would start near 0.8 and pass up drafts that pay). N-gram
lookup's acceptance is the text's own: an extraction request says nothing of the chat request
beside it, so there new requests start from 0.5 at most. A request that gets no drafts learns
nothing, so its counts decay toward the prior each step it is denied one; and where the engine's
estimate is below 0.5, it drifts back up toward 0.5 in steps where drafts were offered and none
was taken: speculation is retried now and then (rarely where it never pays), and resumes when the
load falls. Steps that take no drafts say nothing against a draft model that earned more, so
they leave that estimate as it is.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from engine.scheduler.step_time import StepTimeModel

PRIOR_ALPHA, PRIOR_TRIALS = 0.5, 2.0  # the prior where drafts have earned no less (n-gram: the highest), its weight
DECAY = 0.8  # weight of a request's past verifications per new one (and per step denied drafts)
ENGINE_DECAY = 0.98  # the same for the engine-wide estimate (per verification, per step denied drafts)


@dataclass(slots=True)
class AcceptanceEstimate:
    accepted: float = 0.0  # decayed counts of accepted drafts and of drafts tried
    trials: float = 0.0
    verified: bool = False  # drafts of this request were verified: a draft model holds its tokens

    def alpha(self, prior: float) -> float:
        return (self.accepted + PRIOR_TRIALS * prior) / (self.trials + PRIOR_TRIALS)

    def observe(self, num_proposed: int, num_accepted: int, decay: float = DECAY) -> None:
        self.accepted = decay * self.accepted + num_accepted
        self.trials = decay * self.trials + num_accepted + (num_accepted < num_proposed)
        self.verified = True

    def decay(self, decay: float = DECAY) -> None:
        self.accepted *= decay
        self.trials *= decay


class AdaptiveSpeculation:
    """Per-request acceptance estimates and the choice of how many drafts each request verifies."""

    def __init__(self, prior_from_engine: bool = False):
        self._estimates: dict[str, AcceptanceEstimate] = {}
        self._engine = AcceptanceEstimate()  # every request's verifications
        self.prior_from_engine = prior_from_engine  # drafts from a model: the prior is what its drafts earned

    @property
    def prior(self) -> float:
        earned = self._engine.alpha(PRIOR_ALPHA)
        return earned if self.prior_from_engine else min(PRIOR_ALPHA, earned)

    def _estimate(self, request_id: str) -> AcceptanceEstimate:
        estimate = self._estimates.get(request_id)
        if estimate is None:
            estimate = self._estimates[request_id] = AcceptanceEstimate()
        return estimate

    def alpha(self, request_id: str) -> float:
        return self._estimate(request_id).alpha(self.prior)

    def observe(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        self._estimate(request_id).observe(num_proposed, num_accepted)
        self._engine.observe(num_proposed, num_accepted, ENGINE_DECAY)

    def forget(self, request_id: str) -> None:
        self._estimates.pop(request_id, None)

    def trim(self, request_ids: list[str], drafts: list[list[int]], step_time: StepTimeModel,
             num_decodes: int, pass_seconds: Callable[[int], float] | None = None,
             catch_up_per_token: list[float] | None = None) -> list[list[int]]:
        """Each request's drafts cut to the counts that maximise the step's expected tokens per
        second for `num_decodes` decoding requests, a draft model's passes counted in (one per
        draft depth, over the requests drafting that deep: `pass_seconds(requests)` each), and its
        catch-up on a request it has not drafted for (`catch_up_per_token`: its share of each token
        the request emits); unchanged while no step cost is measured, and none while the plain
        step of this size is not."""
        fitted = step_time.fit()  # None before enough steps: nothing to price with yet
        if fitted is None:
            return drafts
        base = step_time.measured(num_decodes)
        if base is None:
            return [[] for _ in drafts]
        per_token = fitted[1]

        def seconds(tokens: int) -> float:
            """A step's time: the plain step's plus the fitted cost of its extra tokens, or its
            own measured time where that is more (a larger step measured faster is noise, and
            taking it for free drafts would pay for that noise every step). Not the line's own
            value: its fixed part is fitted over prefills and warm-up steps, and can price the
            step one token past a plain one far above it, so that no draft is ever tried."""
            anchored = base + per_token * (tokens - num_decodes)
            measured = step_time.measured(tokens)
            return anchored if measured is None else max(measured, anchored)

        @functools.cache
        def pass_price(num_requests: int) -> float:  # each size priced once per step
            return pass_seconds(num_requests) if num_requests and pass_seconds is not None else 0.0

        prior = self.prior  # once per step, not per request
        estimates = [self._estimate(request_id) for request_id in request_ids]
        alphas = [estimate.alpha(prior) for estimate in estimates]
        catch_up = [0.0 if estimate.verified else share  # a request the draft model holds pays none
                    for estimate, share in zip(estimates, catch_up_per_token or [0.0] * len(drafts))]
        candidates = sorted(((alphas[i] ** j, i, j) for i, d in enumerate(drafts) for j in range(1, len(d) + 1)),
                            reverse=True)
        depths = [0] * len(drafts)  # each request's drafts taken so far
        drafting = [0] * (max(map(len, drafts), default=0) + 1)  # requests with drafts at each depth
        best_m, best_rate, tokens, draft_seconds = 0, num_decodes / base, float(num_decodes), 0.0
        for m, (gain, i, _) in enumerate(candidates, start=1):
            tokens += gain
            depths[i] += 1
            if pass_seconds is not None:  # the pass at this request's new depth takes one more request
                drafting[depths[i]] += 1
                n = drafting[depths[i]]
                draft_seconds += pass_price(n) - pass_price(n - 1)
            draft_seconds += catch_up[i] * (gain + (depths[i] == 1))  # its first draft: its own token too
            rate = tokens / (seconds(num_decodes + m) + draft_seconds)
            if rate > best_rate:
                best_m, best_rate = m, rate
        counts = [0] * len(drafts)
        for _, i, _ in candidates[:best_m]:
            counts[i] += 1
        if candidates and best_m == 0 and self._engine.alpha(PRIOR_ALPHA) < PRIOR_ALPHA:
            self._engine.decay(ENGINE_DECAY)
        for request_id, d, count in zip(request_ids, drafts, counts):
            if d and count == 0:
                self._estimate(request_id).decay()
        return [d[:count] for d, count in zip(drafts, counts)]
