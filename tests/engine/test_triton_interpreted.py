"""The CUDA kernels checked where there is no GPU: Triton's interpreter runs them on the CPU
(tests/engine/interpreted_kernels.py, in a process of its own), so every `make test` checks the
paged prefill kernel, the decode kernel split along the context and the merge of its partitions
against float32 attention across block sizes and query-head groups, within sliding windows and
with soft-capped scores, and the fused RMSNorm, gated activations and RoPE with the KV write
against the torch ops they replace, a mixture of experts' grouped matmuls against its loop over
experts, and LoRA adapters' shrink and expand kernels against torch's grouped products, in float32
and float16.
bfloat16, the CUDA default, is left to tests/gpu: the interpreter computes through NumPy, which
has no bfloat16."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = {"float32": 1e-5, "float16": 2e-3}  # relative error; measured ~7e-7 and ~3e-4


def test_the_kernels_agree_with_their_references_under_the_interpreter():
    run = subprocess.run([sys.executable, "-m", "tests.engine.interpreted_kernels"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env=os.environ | {"TRITON_INTERPRET": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(result["errors"]) == 12  # 2 dtypes x 2 block sizes x 3 head shapes, 7 requests each
    for case, errors in result["errors"].items():
        assert len(errors) == 7
        assert max(errors) < TOLERANCE[case.split("-")[0]], (case, errors)
    assert len(result["windowed"]) == 10  # 2 dtypes x (3 windows x 2 caps - neither)
    for case, errors in result["windowed"].items():
        assert len(errors) == 7 and max(errors) < TOLERANCE[case.split("-")[0]], (case, errors)
    for dtype, error in result["grouped_experts"].items():  # the experts' grouped matmuls against their loop
        assert error < TOLERANCE[dtype], (dtype, error)
    for dtype, error in result["lora"].items():  # LoRA adapters' deltas against torch's grouped products
        assert error < TOLERANCE[dtype], (dtype, error)
    assert result["decodes_agree_however_split"]
    assert result["fused_kernels"] == {"float32": None, "float16": None}, result["fused_kernels"]
