"""Builds (once per machine, cached by torch) the C++ paged decode attention kernel in csrc/.

The kernel reads K/V blocks in place through the block table, where the pure-torch path first
gathers them into a padded copy. It is compiled for the CPU's vector width at first use (tens of
seconds, needs a C++ compiler and ninja); when that is not possible the engine runs the
pure-torch path, which computes the same attention.
"""
from __future__ import annotations

import functools
import logging
import os

import torch

logger = logging.getLogger(__name__)
_SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "paged_decode.cpp")


@functools.cache
def load_paged_decode():
    """The compiled module, or None (with the reason logged) if it cannot be built here."""
    capability = torch.backends.cpu.get_cpu_capability()  # e.g. "AVX512", "AVX2", "DEFAULT"
    flags = ["-O3", "-ffast-math", "-fopenmp"]
    if capability in ("AVX2", "AVX512"):
        flags += ["-march=native", f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}"]
    try:
        import ninja  # torch's builder looks for the ninja binary on PATH; the wheel ships one
        from torch.utils.cpp_extension import load

        if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        return load(name=f"cbserve_paged_decode_{capability.lower()}", sources=[_SOURCE], extra_cflags=flags,
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no compiler, no ninja, unsupported platform: fall back, say why
        logger.warning("C++ paged decode attention unavailable (%s); using the pure-torch path", e)
        return None
