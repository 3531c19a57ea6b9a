"""The engine's C++ CPU kernels in csrc/ (one extension): built once per machine, loaded at start-up.

`paged_decode_attention` reads K/V blocks in place through the block table, where the pure-torch
path first gathers them into a padded copy; `block_quant_linear` multiplies activations by GGUF
block-quantized weights (Q8_0, Q4_1) for decode-sized batches, and `kernel_activations` gives
larger batches' activations (the fused prologue and the rounding) as the kernel computes them
(engine/models/linear.py); `DecodeStack` runs a decode step through all of a block-quantized
model's layers in one call (engine/models/llama.py), and `rope_write_kv` RoPE with the KV write
for it and for the layers' own path. They
are compiled for the CPU's vector width (torch's cpp_extension and ninja, tens of seconds).
`make install` builds them (`python -m engine.cpu_kernels`) into a cache keyed by the sources,
the flags, torch's version and the CPU capability, so an engine's start-up only loads the
library; if it is missing there, the first engine builds it (its start-up, and so a replica's
readiness, waits for that). If it cannot be built the engine runs pure-torch paths that compute
the same results.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import sys
import time
from pathlib import Path

import torch

from engine.cache_dir import cache_dir

logger = logging.getLogger(__name__)
_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / "bindings.cpp", _CSRC / "paged_decode.cpp", _CSRC / "block_quant_linear.cpp",
            _CSRC / "block_quant_gemm.cpp", _CSRC / "rope_kv.cpp", _CSRC / "decode_stack.cpp"]


def _flags() -> tuple[str, list[str]]:
    capability = torch.backends.cpu.get_cpu_capability()  # e.g. "AVX512", "AVX2", "DEFAULT"
    flags = ["-O3", "-ffast-math", "-fopenmp"]
    if capability in ("AVX2", "AVX512"):
        flags += ["-march=native", f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}"]
    return capability, flags


def _cpu_features() -> str:
    """The CPU's feature flags (Linux): -march=native builds for exactly these (AMX tiles, say), so
    a cache shared by machines of one vector width still keys each CPU's build apart."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("flags")), "")


def _name_and_dir() -> tuple[str, Path]:
    capability, flags = _flags()
    sources = b"".join(p.read_bytes() for p in sorted(_CSRC.iterdir()))
    key = hashlib.sha256(sources + " ".join(flags + [torch.__version__, _cpu_features()]).encode()).hexdigest()[:12]
    name = f"cbserve_cpu_kernels_{capability.lower()}_{key}"
    return name, cache_dir("kernels") / name


def kernel_build_key() -> str:
    """The kernels' build identity (sources, flags, torch, the CPU's features), without building
    them: what timings taken through them depend on."""
    return _name_and_dir()[0]


def _import(name: str, path: Path):
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _build(name: str, directory: Path):
    """Compiles the kernels into `directory` and returns the loaded module."""
    import ninja  # torch's builder looks for the ninja binary on PATH; the wheel ships one
    from torch.utils.cpp_extension import load

    if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    directory.mkdir(parents=True, exist_ok=True)
    _, flags = _flags()
    t0 = time.monotonic()
    module = load(name=name, sources=[str(p) for p in _SOURCES], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                  build_directory=str(directory), verbose=False)
    logger.warning("built the C++ CPU kernels in %.0f s into %s", time.monotonic() - t0, directory)
    return module


@functools.cache
def load_cpu_kernels():
    """The compiled module (built first if the cache lacks it), or None, with the reason
    logged, if it cannot be built here."""
    try:
        name, directory = _name_and_dir()
        library = directory / f"{name}.so"
        if library.exists():
            return _import(name, library)
        logger.warning("C++ CPU kernels not built yet (`make install` builds them); building them now")
        return _build(name, directory)
    except Exception as e:  # no compiler, no ninja, unsupported platform: fall back, say why
        logger.warning("C++ CPU kernels unavailable (%s); using the pure-torch paths", e)
        return None


if __name__ == "__main__":  # `make install`: build (or find) the kernels, say where
    logging.basicConfig(level=logging.INFO)
    name, directory = _name_and_dir()
    print(f"CPU kernels: {directory / (name + '.so')}")
    sys.exit(0 if load_cpu_kernels() is not None else 1)
