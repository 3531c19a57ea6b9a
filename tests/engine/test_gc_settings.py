"""A built engine's start-up objects are frozen out of the garbage collector's walks and its
young collections come less often (engine/gc_settings.py); an engine dropped before the next is built
is still collected."""
from __future__ import annotations

import gc
import weakref

from engine import LLM, SamplingParams
from engine.gc_settings import YOUNG_COLLECTION_OBJECTS


def test_a_built_engine_freezes_the_heap_and_a_dropped_one_in_a_cycle_is_collected(tiny_llama):
    gc.set_threshold(700)  # Python's default, whatever an engine built before in this process set
    first = LLM(tiny_llama, quantization="none", max_num_seqs=4)
    assert gc.get_freeze_count() > 0
    assert gc.get_threshold()[0] == YOUNG_COLLECTION_OBJECTS
    first.engine.itself = first.engine  # a reference cycle: only the collector can free it
    gone = weakref.ref(first.engine)
    del first
    second = LLM(tiny_llama, quantization="none", max_num_seqs=4)
    assert gone() is None, "the first engine, frozen with the heap, was never collected"
    output = second.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                             use_tqdm=False)
    assert len(output[0].outputs[0].token_ids) == 4
