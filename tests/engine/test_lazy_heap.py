"""The lazy-deletion heap both queues rank with (engine/lazy_heap.py): order by key, then arrival,
then insertion; O(1) removal that later peeks skip; rebuilt once stale entries dominate."""
from __future__ import annotations

import random

from engine.lazy_heap import LazyHeap


def test_items_come_out_by_key_arrival_then_insertion_and_removed_ones_never():
    heap: LazyHeap[str] = LazyHeap()
    heap.push("a", 2.0, 0.0, "a")
    heap.push("b", 1.0, 5.0, "b")
    heap.push("c", 1.0, 3.0, "c")
    heap.push("d", 1.0, 3.0, "d")  # ties c on key and arrival: inserted later
    heap.push("e", 0.5, 9.0, "e")
    assert heap.remove("e") == "e" and heap.remove("e") is None
    heap.push("a", 0.0, 0.0, "a again")  # replaces a's entry
    assert len(heap) == 4 and "a" in heap and "e" not in heap
    assert [heap.pop() for _ in range(5)] == ["a again", "c", "d", "b", None]


def test_against_a_sorted_list_under_random_pushes_and_removals():
    rng = random.Random(0)
    heap: LazyHeap[int] = LazyHeap()
    model: dict[str, tuple[float, float, int]] = {}
    for step in range(5000):
        op = rng.random()
        if op < 0.5:
            item_id = f"r{rng.randrange(300)}"
            key, arrival = float(rng.randrange(20)), float(rng.randrange(20))
            heap.push(item_id, key, arrival, step)
            model[item_id] = (key, arrival, step)
        elif op < 0.8 and model:
            item_id = rng.choice(sorted(model))
            assert heap.remove(item_id) == model.pop(item_id)[2]
        else:
            best = min(model.values(), default=None)
            assert heap.peek() == (None if best is None else best[2])
        assert len(heap) == len(model)
        assert len(heap._heap) <= 2 * len(model) + 65  # stale entries are dropped once they dominate
    assert sorted(heap.items()) == sorted(v[2] for v in model.values())
