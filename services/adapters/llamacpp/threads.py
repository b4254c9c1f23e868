"""How many threads a local model call should decode with, decided per call from what else the cores are doing.

On 2 cores llama.cpp at 2 threads generates about 1.7x faster than at 1 while the machine is otherwise quiet, and
6-8x slower once another process keeps a core busy (a thread waits on a descheduled peer every token;
docs/benchmarks.md "Local model threads"). The thread count is fixed when a model is loaded, so the adapter keeps
up to two engines of the same weights (the file is memory-mapped: the second costs its KV cache, not another copy
of the weights) and picks one per call: all the cores while the other processes leave them free, half otherwise.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

#: cores kept busy by other processes below which the model takes every core
QUIET_BELOW = 0.5
#: a reading older than this is taken again before the next call
MAX_AGE_S = 2.0
#: the first reading (no earlier sample to compare with) looks at this short a window
FIRST_WINDOW_S = 0.25


@dataclass(frozen=True)
class _Sample:
    at: float
    busy_ticks: int  # every process's, all cores (/proc/stat)
    own_ticks: int  # this process's (/proc/self/stat)


def _read(stat: Path, own: Path) -> _Sample | None:
    try:
        fields = stat.read_text().split("\n", 1)[0].split()[1:]
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
        own_fields = own.read_text().rsplit(")", 1)[1].split()
        mine = int(own_fields[11]) + int(own_fields[12])  # utime + stime
    except (OSError, ValueError, IndexError):
        return None
    return _Sample(time.monotonic(), user + nice + system + irq + softirq + steal, mine)


class CoreWatch:
    """Cores in use by other processes, from /proc (Linux); None where it cannot be read."""

    def __init__(self, stat: Path = Path("/proc/stat"), own: Path = Path("/proc/self/stat")) -> None:
        self.stat, self.own = stat, own
        self.ticks_per_s = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._last: _Sample | None = None
        self._reading: float | None = None
        self._lock = threading.Lock()

    def others_busy(self) -> float | None:
        with self._lock:
            now = _read(self.stat, self.own)
            if now is None:
                return None
            if self._last is None:
                self._last = now
                time.sleep(FIRST_WINDOW_S)  # runs in the call's worker thread, never on the event loop
                now = _read(self.stat, self.own) or now
            if self._reading is not None and now.at - self._last.at < MAX_AGE_S / 4:
                return self._reading  # too short a window to say more than the last reading did
            elapsed = max(now.at - self._last.at, 1e-3)
            others = (now.busy_ticks - self._last.busy_ticks) - (now.own_ticks - self._last.own_ticks)
            self._reading = max(0.0, others / self.ticks_per_s / elapsed)
            self._last = now
            return self._reading


def choose_threads(cores: int, others_busy: float | None) -> int:
    """Every core while others leave them free; half (at least one) while they do, or when it cannot be known."""
    half = max(1, cores // 2)
    if others_busy is None:
        return half
    return cores if others_busy < QUIET_BELOW else half
