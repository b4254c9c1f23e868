"""The randomized kill test at small scale (benchmarks/crash_soak.py runs it at full scale): real broker, real
worker processes killed with SIGKILL at random moments of the ingest, then memory equal to a clean run's, nothing
lost, duplicated or left unannounced."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from benchmarks.crash_soak import failures, soak, soak_through_gateway

pytestmark = [pytest.mark.slow, pytest.mark.server]


def test_kill_9_of_workers_during_ingest_loses_duplicates_and_leaves_unannounced_nothing(tmp_path: Path) -> None:
    report = asyncio.run(soak(messages=600, users=10, kills=4, workers=2, seed=11, data_dir=tmp_path))
    assert report["kills"] == 4
    assert failures(report) == []
    assert report["change_sets"] > 0 and report["memory_update_records"] >= report["change_sets"]


def test_kill_9_of_workers_and_of_the_embedded_broker_under_up_loses_no_accepted_message(tmp_path: Path) -> None:
    """Messages POSTed through the gateway of `memstream up`; the broker (records in RAM) is killed once, a
    worker three times: every 202 becomes memory once, as in a clean run, and every change set is announced."""
    report = asyncio.run(
        soak_through_gateway(messages=300, users=10, kills=3, broker_kills=1, workers=2, seed=3, data_dir=tmp_path)
    )
    assert (report["kills"], report["broker_kills"]) == (3, 1)
    assert report["accepted"] == 300
    assert failures(report) == []
    assert report["unseen_written_before_a_broker_kill"] <= report["change_sets"]
