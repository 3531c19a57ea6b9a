"""The objects alive once an engine is built, kept out of the garbage collector's full collections.

A built engine's process holds hundreds of thousands of long-lived objects (torch, transformers,
the tokenizer; Ray and the web stack in a replica). Every full collection walks all of them, and
a step loop making a full batch's outputs triggers one every few dozen steps: on a 256-row batch
the pauses took 2-3 ms a step on average, as much as the rest of the step's host work
(benchmarks/host_step.py). Frozen after start-up, as vLLM's engine core does, they are left out
of every collection; the objects made since are collected as before.
"""
from __future__ import annotations

import atexit
import gc


def freeze_startup_heap() -> None:
    """Collects, then freezes every object alive. Objects frozen by an engine built before in
    this process are unfrozen first, so those that became garbage since are collected."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


# frozen objects are never collected, even at exit, where extension modules (nanobind's) then
# report them as leaked: unfrozen first, they are collected as usual
atexit.register(gc.unfreeze)
