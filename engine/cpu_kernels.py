"""The engine's C++ CPU kernels in csrc/ (one extension): built once per machine, loaded at start-up.

`paged_decode_attention` reads K/V blocks in place through the block table, where the pure-torch
path first gathers them into a padded copy; `block_quant_linear` multiplies activations by GGUF
block-quantized weights (Q8_0, Q4_1) for decode-sized batches, `block_quant_gemm` (AMX tiles) and
`vector_gemm` (AVX512-VNNI/BF16, AVX-512, AVX2) for larger ones, and `kernel_activations` gives
the fp32 GEMM fallback's activations (the fused prologue and the rounding) as the kernels compute
them (engine/models/linear.py); `LoraSlots` adds each row's LoRA adapter delta to a matmul's
output (engine/lora.py); `DecodeStack` runs a decode step through all of a block-quantized
model's layers in one call (engine/models/decoder.py), and `rope_write_kv` RoPE with the KV write
for it and for the layers' own path. They
are compiled for this CPU's features, -march=native (torch's cpp_extension and ninja, about two
minutes on 2 cores).
`make install` builds them (`python -m engine.cpu_kernels`) into a cache keyed by the sources,
the flags, torch's version and the CPU capability, so an engine's start-up only loads the
library; if it is missing there, the first engine builds it (its start-up, and so a replica's
readiness, waits for that). If it cannot be built the engine runs pure-torch paths that compute
the same results.
"""
from __future__ import annotations

import fcntl
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
            _CSRC / "gguf_rows.cpp", _CSRC / "block_quant_gemm.cpp", _CSRC / "vector_gemm.cpp", _CSRC / "rope_kv.cpp",
            _CSRC / "decode_stack.cpp", _CSRC / "lora.cpp", _CSRC / "scratch.cpp"]
# Builds for older CPU families than this one (gcc's -march names), so every feature branch is
# compiled and run here (the native build has this CPU's own): torch's vector capability each
# implies, and the CPU flags it needs. Tests build the matmul kernels alone for each;
# CBSERVE_CPU_MARCH=haswell, say, makes the engine load a whole build for one (benchmarks).
TARGETS = {
    "x86-64": ("DEFAULT", frozenset()),  # the plain loops
    "haswell": ("AVX2", frozenset({"avx2", "fma", "f16c"})),
    "skylake-avx512": ("AVX512", frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})),  # no VNNI, no BF16
}
_MATMUL_SOURCES = [_CSRC / "bindings.cpp", _CSRC / "block_quant_linear.cpp", _CSRC / "gguf_rows.cpp",
                   _CSRC / "vector_gemm.cpp", _CSRC / "lora.cpp", _CSRC / "scratch.cpp"]


def _engine_march() -> str:
    return os.environ.get("CBSERVE_CPU_MARCH", "native")


def _flags(march: str, matmuls_only: bool) -> tuple[str, list[str]]:
    """The build's vector capability and compiler flags: for "native", torch's capability here
    (e.g. "AVX512", "AVX2", "DEFAULT") and this CPU's every feature; else a TARGETS entry."""
    capability = torch.backends.cpu.get_cpu_capability() if march == "native" else TARGETS[march][0]
    flags = ["-O3", "-ffast-math", "-fopenmp"]
    if capability in ("AVX2", "AVX512"):
        flags += [f"-march={march}", f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}"]
    elif march != "native":
        flags += [f"-march={march}"]
    if matmuls_only:
        flags += ["-DCBSERVE_MATMULS_ONLY"]
    return capability, flags


def runnable_targets() -> list[str]:
    """The TARGETS this CPU can run."""
    flags = set(cpu_flags().split())
    return [march for march, (_, needs) in TARGETS.items() if needs <= flags]


def cpu_flags() -> str:
    """The CPU's feature flags (Linux): -march=native builds for exactly these (AMX tiles, say), so
    a cache shared by machines of one vector width still keys each CPU's build apart."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("flags")), "")


def _name_and_dir(march: str, matmuls_only: bool, csrc: Path = _CSRC) -> tuple[str, Path]:
    capability, flags = _flags(march, matmuls_only)
    sources = b"".join(p.read_bytes() for p in sorted(csrc.iterdir()))
    key = hashlib.sha256(sources + " ".join(flags + [torch.__version__, cpu_flags()]).encode()).hexdigest()[:12]
    suffix = ("" if march == "native" else "_" + march.replace("-", "_")) + ("_matmuls" if matmuls_only else "")
    name = f"cbserve_cpu_kernels_{capability.lower()}{suffix}_{key}"
    return name, cache_dir("kernels") / name


def kernel_build_key() -> str:
    """The engine's kernels' build identity (sources, flags, torch, the CPU's features), without
    building them: what timings taken through them depend on."""
    return _name_and_dir(_engine_march(), False)[0]


def _import(name: str, path: Path):
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    if spec is None:
        raise ImportError(f"no module spec for {path}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _build(name: str, directory: Path, march: str, matmuls_only: bool, csrc: Path = _CSRC):
    """Compiles the kernels (the sources in `csrc`) into `directory` and returns the loaded module."""
    import ninja  # torch's builder looks for the ninja binary on PATH; the wheel ships one
    from torch.utils.cpp_extension import load

    if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    _, flags = _flags(march, matmuls_only)
    t0 = time.monotonic()
    sources = [csrc / p.name for p in (_MATMUL_SOURCES if matmuls_only else _SOURCES)]
    module = load(name=name, sources=[str(p) for p in sources], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                  build_directory=str(directory), verbose=False)
    logger.warning("built the C++ CPU kernels in %.0f s into %s", time.monotonic() - t0, directory)
    return module


def _load(march: str, matmuls_only: bool, csrc: Path = _CSRC):
    """The build of `csrc` for `march` from the cache, compiled first if the cache lacks it. One
    process builds at a time, under a lock the system drops when its holder dies: torch's own lock
    file outlives a build that was killed (a restart, an OOM) and would make every later start
    wait for it forever, so whoever holds ours removes it."""
    name, directory = _name_and_dir(march, matmuls_only, csrc)
    library = directory / f"{name}.so"
    if library.exists():
        return _import(name, library)
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "build.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        if library.exists():  # built while this process waited
            return _import(name, library)
        (directory / "lock").unlink(missing_ok=True)
        logger.warning("C++ CPU kernels not built yet (`make install` builds them); building them now")
        return _build(name, directory, march, matmuls_only, csrc)


@functools.cache
def load_cpu_kernels(march: str | None = None, matmuls_only: bool = False):
    """The compiled module (built first if the cache lacks it), or None, with the reason
    logged, if it cannot be built here. By default the engine's build (this CPU's, "native",
    unless CBSERVE_CPU_MARCH names a TARGETS entry); `march` and `matmuls_only`: the matmul
    kernels built for another family (tests)."""
    try:
        return _load(march or _engine_march(), matmuls_only)
    except Exception as e:  # no compiler, no ninja, unsupported platform: fall back, say why
        logger.warning("C++ CPU kernels unavailable (%s); using the pure-torch paths", e)
        return None


if __name__ == "__main__":  # `make install`: build (or find) the kernels, say where
    logging.basicConfig(level=logging.INFO)
    name, directory = _name_and_dir(_engine_march(), False)
    print(f"CPU kernels: {directory / (name + '.so')}")
    sys.exit(0 if load_cpu_kernels() is not None else 1)
