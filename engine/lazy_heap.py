"""A priority queue of items under ids with O(1) removal: a heap with lazy deletion.

The engine's waiting queue (engine/scheduler/queue.py) and the serve app's admission queue
(serve_app/admission.py) rank by keys that never change while an item waits, so both keep a heap
and, on removal, only forget the id: the item's heap entry goes stale and is skipped when met,
and the heap is rebuilt without stale entries once they outnumber the live ones (O(n), amortised
over the removals that made them).
"""
from __future__ import annotations

import heapq
import itertools
from typing import Generic, TypeVar

T = TypeVar("T")


class LazyHeap(Generic[T]):
    """Items ordered by (key, arrival, insertion order), lowest first."""

    # Invariant: every id in `_live` has exactly one live heap entry, the one whose sequence number
    # `_live` holds; other heap entries are stale (removed or replaced) and skipped.
    def __init__(self):
        self._heap: list[tuple[float, float, int, str]] = []
        self._live: dict[str, tuple[int, T]] = {}  # id -> (live entry's sequence number, item)
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, item_id: str) -> bool:
        return item_id in self._live

    def push(self, item_id: str, key: float, arrival: float, item: T) -> None:
        """Adds the item (replacing one under the same id)."""
        self.remove(item_id)
        seq = next(self._seq)
        self._live[item_id] = (seq, item)
        heapq.heappush(self._heap, (key, arrival, seq, item_id))

    def remove(self, item_id: str) -> T | None:
        """Takes the item out; None if no item has that id."""
        entry = self._live.pop(item_id, None)
        if entry is None:
            return None
        if len(self._heap) > 2 * len(self._live) + 64:  # mostly stale: rebuild
            self._heap = [e for e in self._heap if self._is_live(e)]
            heapq.heapify(self._heap)
        return entry[1]

    def _is_live(self, entry: tuple[float, float, int, str]) -> bool:
        live = self._live.get(entry[3])
        return live is not None and live[0] == entry[2]

    def peek(self) -> T | None:
        """The lowest-ranked item, or None."""
        while self._heap and not self._is_live(self._heap[0]):
            heapq.heappop(self._heap)
        return self._live[self._heap[0][3]][1] if self._heap else None

    def pop(self) -> T | None:
        """Takes out and returns the lowest-ranked item, or None."""
        if self.peek() is None:
            return None
        return self.remove(heapq.heappop(self._heap)[3])

    def items(self) -> list[T]:
        """The items, unordered."""
        return [item for _, item in self._live.values()]
