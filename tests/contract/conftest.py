"""The ``memory_store`` fixture the port contract runs against: one param per MemoryStore implementation.

To add an adapter (e.g. Dgraph + Weaviate), add a param and open it in ``_open``; stores must accept any ``DIM``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.adapters.sqlite import SqliteMemoryStore
from services.ports import MemoryStore

DIM = 8  # the contract suite builds 8-dimensional unit vectors (test_memory_store_contract.DIM)


async def _open(kind: str, tmp_path: Path) -> MemoryStore:
    if kind == "sqlite":
        return await SqliteMemoryStore.open(tmp_path / "memory.sqlite3", dim=DIM)
    raise ValueError(f"unknown store {kind}")


@pytest.fixture(params=["sqlite"])
async def memory_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[MemoryStore]:
    store = await _open(request.param, tmp_path)
    try:
        yield store
    finally:
        await store.close()
