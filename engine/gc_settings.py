"""The garbage collector's settings for a serving process.

A built engine's process holds hundreds of thousands of long-lived objects (torch, transformers,
the tokenizer). Every full collection walks all of them, and a step loop making a full batch's
outputs triggered one every few dozen steps: on a 256-row batch the pauses took 2.9-3.4 ms a
step on average, as much as the rest of the step's host work (benchmarks/investigations/host_step.py). Frozen
after start-up, as vLLM's engine core and Ray Serve's replicas do, they are left out of every
collection; the objects made since are collected as before.

Python starts a young collection after every 700 net new container objects. A step loop's
objects mostly die within the step, and a request's in the ingress live as long as the request:
collecting them every 700 took 0.35 ms of a 256-row step, and in a burst of 512 requests 0.45
of the ingress's 3.7 CPU-s, young collections and the full ones they lead to. At 20,000 they
take a tenth of that.
"""
from __future__ import annotations

import atexit
import gc

YOUNG_COLLECTION_OBJECTS = 20_000  # net new container objects that start a young collection


def collect_young_less_often() -> None:
    gc.set_threshold(YOUNG_COLLECTION_OBJECTS)


def freeze_startup_heap() -> None:
    """Collects, then freezes every object alive; young collections less often from then on.
    Objects frozen by an engine built before in this process are unfrozen first, so those that
    became garbage since are collected."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    collect_young_less_often()


# frozen objects are never collected, even at exit, where extension modules (nanobind's) then
# report them as leaked: unfrozen first, they are collected as usual
atexit.register(gc.unfreeze)
