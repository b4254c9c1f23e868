"""The worker loads an in-process embedder before it takes events (a static table's first distillation is not paid
inside the first batch); a served embedder is left to its own outage handling. Whatever fails after the services
are built, their stores are closed."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

import streams.worker as worker
from services.ports import BlockingEmbedder, Embedder
from services.settings import Settings


class Started(Exception):
    """Raised where the worker would start consuming: everything before it has run."""


class Recording:
    dim = 4

    def __init__(self, calls: list[list[str]], fail: bool = False) -> None:
        self.calls, self.fail = calls, fail

    def record(self, texts: Sequence[str]) -> list[list[float]]:
        self.calls.append(list(texts))
        if self.fail:
            raise OSError("the model file is unreadable")
        return [[1.0, 0.0, 0.0, 0.0] for _ in texts]


class InProcess(Recording, BlockingEmbedder):
    name = "in-process"

    def embed_sync(self, texts: Sequence[str]) -> list[list[float]]:
        return self.record(texts)


class Served(Recording, Embedder):
    name = "served"

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        return self.record(texts)


@pytest.mark.parametrize(("kind", "warmed"), [(InProcess, True), (Served, False)])
async def test_an_in_process_embedder_is_loaded_before_the_worker_consumes(
    kind: type[Any], warmed: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[list[str]] = []
    order: list[str] = []

    class Services:
        embedder = kind(calls)

        async def close(self) -> None:
            order.append("closed")

    async def nothing(*args: Any, **kwargs: Any) -> None:
        return None

    async def services(settings: Settings, llm: Any) -> Services:
        return Services()

    def consume(*args: Any, **kwargs: Any) -> None:
        order.append(f"consume after {len(calls)} embedder calls")
        raise Started

    monkeypatch.setattr(worker, "wait_for_kafka", nothing)
    monkeypatch.setattr(worker, "ensure_topics", nothing)
    monkeypatch.setattr(worker, "build_services", services)
    monkeypatch.setattr(worker, "Cancellations", consume)
    with pytest.raises(Started):
        await worker.run_worker(Settings(data_dir=tmp_path), "127.0.0.1:1")
    assert calls == ([["warm up"]] if warmed else [])
    assert order == [f"consume after {len(calls)} embedder calls", "closed"]


async def test_a_failed_warm_up_closes_the_services(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    closed: list[bool] = []

    class Services:
        embedder = InProcess([], fail=True)

        async def close(self) -> None:
            closed.append(True)

    async def nothing(*args: Any, **kwargs: Any) -> None:
        return None

    async def services(settings: Settings, llm: Any) -> Services:
        return Services()

    monkeypatch.setattr(worker, "wait_for_kafka", nothing)
    monkeypatch.setattr(worker, "ensure_topics", nothing)
    monkeypatch.setattr(worker, "build_services", services)
    with pytest.raises(OSError, match="unreadable"):
        await worker.run_worker(Settings(data_dir=tmp_path), "127.0.0.1:1")
    assert closed == [True]
