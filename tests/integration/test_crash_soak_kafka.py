"""The randomized kill test on Apache Kafka (``eval "$(scripts/stack up kafka)"``), small scale: workers killed
with SIGKILL at random moments of the ingest, then memory equal to a clean run's, nothing lost, duplicated or left
unannounced. The run has topics and a consumer group of its own, so it can share the broker."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from benchmarks.crash_soak import failures, soak

pytestmark = [pytest.mark.slow, pytest.mark.server]


def test_kill_9_of_workers_on_kafka_loses_duplicates_and_leaves_unannounced_nothing(kafka: str, tmp_path: Path) -> None:
    report = asyncio.run(soak(messages=300, users=10, kills=3, workers=2, seed=3, data_dir=tmp_path, broker=kafka))
    assert report["kills"] == 3 and report["broker"] == kafka
    assert failures(report) == []
    assert report["change_sets"] > 0 and report["memory_update_records"] >= report["change_sets"]
