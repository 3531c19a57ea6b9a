"""tests/gpu need an NVIDIA GPU and a CUDA build of torch: without them each test is skipped, saying
so (they are deselected by the `gpu` marker in `make test` anyway; `make test-gpu` selects them)."""
from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    reason = (f"no CUDA device: torch {torch.__version__} "
              f"{'is a CPU build' if torch.version.cuda is None else 'sees no GPU'}; run `make test-gpu` on a GPU host")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))
