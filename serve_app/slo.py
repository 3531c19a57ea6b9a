"""Latency objectives per priority class, and whether each finished request met them.

A class's objectives are a time to first token and/or a time per output token (`slo` in the
app config). A request meets its SLO when it finished without error and met every objective of
its class; goodput is such requests per second. Requests whose client left and bad requests the
engine refused are not counted (the replica decides which it records). The tracker keeps totals
(exported as counters) and a sliding window (attainment ratio and goodput as gauges), per class.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

OBJECTIVES = ("ttft", "tpot")


class SLOTarget(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ttft_s: float | None = Field(None, gt=0, description="Time to first token, from arrival at the router.")
    tpot_s: float | None = Field(None, gt=0, description="Time per output token after the first.")

    def objectives(self) -> dict[str, float]:
        """objective -> seconds, for the objectives this class states."""
        return {name: seconds for name, seconds in (("ttft", self.ttft_s), ("tpot", self.tpot_s))
                if seconds is not None}

    def verdicts(self, ttft_s: float | None, tpot_s: float | None, ok: bool) -> dict[str, bool]:
        """objective -> met, for this class's objectives (a failed request meets none; a request
        of one token has no TPOT and meets that objective)."""
        out = {}
        if self.ttft_s is not None:
            out["ttft"] = ok and ttft_s is not None and ttft_s <= self.ttft_s
        if self.tpot_s is not None:
            out["tpot"] = ok and (tpot_s is None or tpot_s <= self.tpot_s)
        return out


@dataclass(slots=True)
class ClassTally:
    finished: int = 0
    met: int = 0  # met every objective
    met_by_objective: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OBJECTIVES, 0))
    recent: deque[tuple[float, bool]] = field(default_factory=deque)  # (finish time, met) in the window


class SLOTracker:
    def __init__(self, targets: dict[int, SLOTarget], window_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):
        self.targets = targets
        self.window_s = window_s
        self.clock = clock
        self.tallies: dict[int, ClassTally] = {}

    def record(self, priority: int, ttft_s: float | None, tpot_s: float | None,
               ok: bool) -> dict[str, bool] | None:
        """Counts a finished request; its verdicts (objective -> met, plus 'all'), or None when
        its class states no objective."""
        target = self.targets.get(priority)
        if target is None:
            return None
        verdicts = target.verdicts(ttft_s, tpot_s, ok)
        verdicts["all"] = all(verdicts.values())
        tally = self.tallies.setdefault(priority, ClassTally())
        tally.finished += 1
        tally.met += verdicts["all"]
        for objective in OBJECTIVES:
            tally.met_by_objective[objective] += verdicts.get(objective, False)
        tally.recent.append((self.clock(), verdicts["all"]))
        return verdicts

    def window(self) -> dict[int, tuple[float | None, float]]:
        """priority -> (attainment ratio, goodput requests/s) over the last window_s seconds, for
        every class that has finished requests; attainment is None when none finished in the window
        (goodput is then 0)."""
        now, out = self.clock(), {}
        for priority, tally in self.tallies.items():
            while tally.recent and tally.recent[0][0] < now - self.window_s:
                tally.recent.popleft()
            met = sum(m for _, m in tally.recent)
            out[priority] = (met / len(tally.recent) if tally.recent else None, met / self.window_s)
        return out

    def snapshot(self) -> dict[int, dict[str, float | None]]:
        """Totals and window figures per class (tests and tools read this)."""
        window = self.window()
        return {p: {"finished": t.finished, "met": t.met, **{f"met_{o}": n for o, n in t.met_by_objective.items()},
                    "attainment": window[p][0], "goodput_rps": window[p][1]}
                for p, t in self.tallies.items()}
