"""Ordering of waiting requests: FCFS, SJF and priority, with aging. The one home of the ranking
rule: the serve app's admission router imports `rank_key` and `estimated_work` from here.

Aging lowers (improves) a waiting request's rank by `aging_rate` per second: for `priority` a
request of class p that arrived at a ranks at time t as p - aging_rate * (t - a); for `sjf` its
estimated work shrinks by aging_rate tokens per second. With one rate for everyone that order
is the order of p + aging_rate * a, a key that does not change while the request waits, so the
queue is a heap (engine/lazy_heap.py: O(log n) per add and pop, O(1) removal) instead of a sort per step.
"""
from __future__ import annotations

from collections.abc import Callable

from engine.lazy_heap import LazyHeap
from engine.request import Request

LengthPredictor = Callable[[Request], float]


def estimated_work(num_uncomputed_tokens: int, num_remaining_outputs: int) -> float:
    """SJF's estimate of a request's remaining work in tokens."""
    return float(num_uncomputed_tokens + num_remaining_outputs)


def default_remaining_work(request: Request) -> float:
    return estimated_work(request.num_uncomputed_tokens,
                          request.params.max_tokens - request.num_output_tokens)


def rank_key(policy: str, aging_rate: float, priority: int, work: float, arrival_time: float) -> float:
    """Lower is served first. The aged rank at any time t is this key minus aging_rate * t, the
    same shift for everyone, so comparing keys compares aged ranks. FCFS (and static) is arrival
    order; ties are broken by the caller (arrival, then insertion order)."""
    if policy == "sjf":
        return work + aging_rate * arrival_time
    if policy == "priority":
        return priority + aging_rate * arrival_time
    return arrival_time


class WaitingQueue:
    def __init__(self, policy: str, aging_rate: float, predictor: LengthPredictor = default_remaining_work):
        self.policy = policy
        self.aging_rate = aging_rate
        self.predictor = predictor
        self._heap: LazyHeap[Request] = LazyHeap()
        self.num_tokens = 0  # tokens of the waiting requests (prompt, plus outputs for re-queued ones)
        self.num_embeddings = 0  # waiting embedding requests

    def __len__(self) -> int:
        return len(self._heap)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._heap

    def key(self, request: Request) -> float:
        """The request's rank key (see rank_key); valid while the request waits or runs. The
        work estimate is made only for `sjf`, the one policy that ranks by it."""
        work = self.predictor(request) if self.policy == "sjf" else 0.0
        return rank_key(self.policy, self.aging_rate, request.priority, work, request.arrival_time)

    def add(self, request: Request) -> None:
        self.remove(request.request_id)  # at most once
        self._heap.push(request.request_id, self.key(request), request.arrival_time, request)
        self.num_tokens += request.num_tokens
        self.num_embeddings += request.pooling is not None

    def remove(self, request_id: str) -> Request | None:
        """Takes the request out; None if it is not waiting."""
        request = self._heap.remove(request_id)
        if request is not None:
            self.num_tokens -= request.num_tokens
            self.num_embeddings -= request.pooling is not None
        return request

    def peek(self) -> Request | None:
        """The best-ranked waiting request, or None."""
        return self._heap.peek()

    def pop(self) -> Request | None:
        """The best-ranked waiting request, taken out; None when none waits."""
        request = self._heap.pop()
        if request is not None:
            self.num_tokens -= request.num_tokens
            self.num_embeddings -= request.pooling is not None
        return request

    def requests(self) -> list[Request]:
        """Waiting requests, unordered."""
        return self._heap.items()
