"""benchmarks/investigations/host_step.py drives the engine process's own loop with the GPU config's engine
arguments: a steady batch of decodes is scheduled ahead every step, and a request arriving every
step (through the loop's commands) makes every step a mixed one, scheduled anew."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2]))
from benchmarks.investigations import host_step  # noqa: E402


def test_decoding_rows_are_scheduled_ahead_and_arrivals_make_mixed_steps():
    decodes = host_step.run(rows=8, prefill=0, steps=15, profiled=False)
    assert decodes["steps launched ahead"] == 1.0 and decodes["schedule"] == 0.0
    assert decodes["rows"] == 8 and decodes["bytes sent"] > 0
    assert 0 < decodes["host"] < decodes["wall"]
    mixed = host_step.run(rows=8, prefill=16, steps=15, profiled=False)
    assert mixed["steps launched ahead"] == 0.0 and mixed["schedule"] > 0
