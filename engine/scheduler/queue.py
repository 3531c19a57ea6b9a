"""Ordering of waiting requests: FCFS, SJF and priority, with aging.

Owns the rank of a waiting request, nothing about budgets. Aging lowers (improves) a request's
rank by `aging_rate` per second of waiting, so under any load it eventually outranks every newer
arrival: for `priority` a request of class p waiting t seconds ranks as p - aging_rate * t; for
`sjf` its estimated remaining tokens shrink by aging_rate tokens per second.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

from engine.request import Request

LengthPredictor = Callable[[Request], float]


def default_remaining_work(request: Request) -> float:
    """SJF's estimate: uncomputed tokens plus the outputs still allowed."""
    return float(request.num_remaining_tokens)


class WaitingQueue:
    def __init__(self, policy: str, aging_rate: float, predictor: LengthPredictor = default_remaining_work):
        self.policy = policy
        self.aging_rate = aging_rate
        self.predictor = predictor
        self._requests: dict[str, Request] = {}  # insertion order = arrival order for fcfs

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def add(self, request: Request) -> None:
        self._requests[request.request_id] = request

    def remove(self, request_id: str) -> Request | None:
        return self._requests.pop(request_id, None)

    def rank(self, request: Request, now: float) -> tuple[float, float]:
        """Lower ranks are served first; ties go to the earlier arrival."""
        aged = self.aging_rate * (now - request.arrival_time)
        if self.policy == "sjf":
            return (self.predictor(request) - aged, request.arrival_time)
        if self.policy == "priority":
            return (request.priority - aged, request.arrival_time)
        return (0.0, request.arrival_time)

    def requests(self) -> list[Request]:
        """Waiting requests, unordered."""
        return list(self._requests.values())

    def ordered(self, now: float) -> Iterator[Request]:
        """Waiting requests best rank first (a snapshot: callers may remove while iterating)."""
        return iter(sorted(self._requests.values(), key=lambda r: self.rank(r, now)))
