"""How busy the machine is, from /proc/stat: for timings that must know whether other processes
took the cores they ran on (`auto`'s serving-mix timing, the benchmarks). Torch-free."""
from __future__ import annotations

import os
import time

SPARE_CORES_SLACK = 0.25  # cores other processes may take beyond those the timed threads leave them


def machine_busy_cpu_s() -> float | None:
    """CPU seconds every process has spent busy so far (user, nice, system, irq, softirq, steal),
    or None where /proc/stat is missing."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


CpuReading = tuple[float | None, float, float]  # every process's busy CPU-s, this process's CPU-s, wall s


def cpu_reading() -> CpuReading:
    """The machine's busy CPU seconds, this process's threads' CPU seconds and the wall clock, now."""
    return machine_busy_cpu_s(), time.process_time(), time.perf_counter()


def others_cores(start: CpuReading, end: CpuReading) -> float | None:
    """Cores' worth of CPU other processes took between two readings, on average (None where
    /proc/stat is missing)."""
    (busy0, own0, wall0), (busy1, own1, wall1) = start, end
    if busy0 is None or busy1 is None or wall1 <= wall0:
        return None
    return max(0.0, (busy1 - busy0) - (own1 - own0)) / (wall1 - wall0)


class OtherLoad:
    """The CPU the rest of the machine takes over the spans this context manager encloses, in cores
    on average over a span, the most of any (None where /proc/stat is missing). Ratios timed while
    other processes want the timed threads' cores are skewed, each mode by how it shares a core:
    on 2 cores during a compile, int8 timed 0.04x fp32 on a lone stream and gguf 0.13x, where the
    quiet machine gives 0.28x and 0.19x."""

    cores: float | None = None

    def __enter__(self) -> OtherLoad:
        self._start = cpu_reading()
        return self

    def __exit__(self, *exc) -> None:
        span = others_cores(self._start, cpu_reading())
        if span is not None:
            self.cores = max(self.cores or 0.0, span)

    def contends_with(self, threads: int) -> bool:
        """Whether the others took more than the cores `threads` timed threads left them."""
        spare = max(0, (os.cpu_count() or 1) - threads)
        return self.cores is not None and self.cores > spare + SPARE_CORES_SLACK
