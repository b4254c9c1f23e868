"""The soak script (benchmarks/soak.py) for one minute at a small rate, so CI runs it: `memstream up` as a real
process, steady ingest and concurrent questions through the gateway, RSS sampled; every question answered, every
accepted message memorized once, no process restarted, RSS flat over the second half."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.soak import Options, run


@pytest.mark.slow
@pytest.mark.server
def test_a_minute_of_ingest_and_questions_answers_all_memorizes_all_and_keeps_memory_flat(tmp_path: Path) -> None:
    opts = Options(minutes=1.0, users=3, rate=1.0, questions_per_min=4.0, sample_s=5.0)
    report = run(opts, tmp_path)
    assert report["failures"] == []
    messages, questions = report["messages"], report["questions"]
    assert messages["accepted"] >= 45 and messages["memorized"] == messages["episodes"] == messages["accepted"]
    assert questions["asked"] >= 6 and questions["answered"] == questions["asked"] == report["answer_latency_s"]["n"]
    assert questions["quoting_own_memory"] > 0  # the answers name their speaker: the leak check sees names
    assert sorted(name.split(" ")[0] for name in report["rss"]) == ["broker", "gateway", "up", "worker"]
    assert all(r["samples"] >= 10 and "slope_mb_per_min" in r for r in report["rss"].values())
    assert report["ingest_to_queryable_s"]["polled"]["n"] == messages["accepted"]
