"""The ``memory_store`` fixture the port contract runs against: one param per backend, as the
backend's ``Stores``.

To add an adapter, add a param and open it in ``_open``; stores must accept any ``DIM``.

``remote`` is Dgraph + Weaviate at the addresses ``scripts/stack up`` exports (MEMSTREAM_DGRAPH,
MEMSTREAM_WEAVIATE_HTTP, MEMSTREAM_WEAVIATE_GRPC). Without them it skips on a developer's machine and fails in CI
(``CI`` set), so CI can never pass by silently skipping the real servers.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.adapters.sqlite import SqliteMemoryStore
from services.ports import Stores

DIM = 8  # the contract suite builds 8-dimensional unit vectors (test_memory_store_contract.DIM)
# the users the contract writes; the remote store forgets them before each test (the servers outlive the test)
CONTRACT_USERS = ("alice", "bob", "carol")
REMOTE_ADDRESSES = ("MEMSTREAM_DGRAPH", "MEMSTREAM_WEAVIATE_HTTP", "MEMSTREAM_WEAVIATE_GRPC")
# the contract's own Weaviate collections (8-dimensional), apart from any deployment's on the same server
REMOTE_PREFIX = "MemstreamContract"


def remote_addresses() -> tuple[str, str, str]:
    """The real servers' addresses; none set: skip here, fail in CI."""
    values = [os.environ.get(name, "") for name in REMOTE_ADDRESSES]
    if not all(values):
        missing = ", ".join(name for name, value in zip(REMOTE_ADDRESSES, values, strict=True) if not value)
        message = f'{missing} not set: start the real stack with eval "$(scripts/stack up)"'
        if os.environ.get("CI", "").lower() not in ("", "0", "false"):
            pytest.fail(f"CI must run the remote store contract: {message}")
        pytest.skip(message)
    dgraph, http, grpc = values
    return dgraph, http, grpc


async def _open(kind: str, tmp_path: Path) -> Stores:
    if kind == "sqlite":
        return (await SqliteMemoryStore.open(tmp_path / "memory.sqlite3", dim=DIM)).stores()
    if kind == "remote":
        from services.adapters.remote import RemoteMemoryStore

        dgraph, http, grpc = remote_addresses()
        store = await RemoteMemoryStore.open(dgraph, http, grpc, dim=DIM, prefix=REMOTE_PREFIX)
        for user in CONTRACT_USERS:
            await store.delete_user(user)
        return store.stores()
    raise ValueError(f"unknown store {kind}")


@pytest.fixture(params=["sqlite", pytest.param("remote", marks=pytest.mark.server)])
async def memory_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Stores]:
    store = await _open(request.param, tmp_path)
    try:
        yield store
    finally:
        await store.close()
