"""The local model's thread count per call: every core while other processes leave them free, half otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.adapters.llamacpp import threads
from services.adapters.llamacpp.threads import CoreWatch, choose_threads


@pytest.mark.parametrize(
    ("cores", "others", "chosen"),
    [(2, 0.0, 2), (2, 0.4, 2), (2, 0.9, 1), (2, None, 1), (8, 0.1, 8), (8, 3.0, 4), (1, 0.0, 1), (1, 1.0, 1)],
)
def test_choose_threads(cores: int, others: float | None, chosen: int) -> None:
    assert choose_threads(cores, others) == chosen


class FakeProc:
    """/proc/stat and /proc/self/stat whose counters the test advances."""

    def __init__(self, tmp_path: Path) -> None:
        self.stat, self.own = tmp_path / "stat", tmp_path / "self_stat"
        self.busy = self.mine = 0
        self.write()

    def write(self) -> None:
        # user nice system idle iowait irq softirq steal
        self.stat.write_text(f"cpu  {self.busy} 0 0 5000 0 0 0 0 0 0\ncpu0 0 0 0 0 0 0 0 0 0 0\n")
        fields = ["S"] + ["0"] * 10 + [str(self.mine), "0"] + ["0"] * 30
        self.own.write_text("1234 (python (x)) " + " ".join(fields) + "\n")

    def advance(self, busy: int, mine: int) -> None:
        self.busy += busy
        self.mine += mine
        self.write()


def test_core_watch_counts_other_processes_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    proc = FakeProc(tmp_path)
    clock = iter(float(t) for t in range(0, 1000, 10))
    monkeypatch.setattr(threads.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(threads.time, "sleep", lambda s: proc.advance(busy=50, mine=50))  # first window: all ours
    watch = CoreWatch(proc.stat, proc.own)
    watch.ticks_per_s = 100
    assert watch.others_busy() == 0.0  # the first window's busy ticks were all this process's
    proc.advance(busy=1000 + 300, mine=300)  # 10 s: another process kept one core busy
    assert watch.others_busy() == pytest.approx(1.0)
    proc.advance(busy=400, mine=400)
    assert watch.others_busy() == 0.0


def test_core_watch_without_proc_says_nothing(tmp_path: Path) -> None:
    watch = CoreWatch(tmp_path / "missing", tmp_path / "missing-too")
    assert watch.others_busy() is None
    assert choose_threads(2, watch.others_busy()) == 1
