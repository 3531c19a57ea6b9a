"""Where the engine keeps what it derives once per machine and reuses on every start: compiled
kernels, models converted from GGUF. $CBSERVE_CACHE, else ~/.cache/cbserve."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "CBSERVE_CACHE"


def cache_dir(kind: str) -> Path:
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "cbserve")
    return root / kind
