"""Integration tests against the real servers that ``eval "$(scripts/stack up)"`` starts and exports.

A test that needs a server and finds its address unset skips on a developer's machine and FAILS in CI (``CI`` set):
CI must never pass by skipping the real stack. Tests share the servers with other runs, so each one writes under
its own user ids (and the stores under their own Weaviate collection prefix).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator

import httpx
import pytest

from services.adapters.remote import RemoteMemoryStore

DIM = 8
PREFIX = "MemstreamIt"  # this suite's Weaviate collections (8-dimensional vectors)


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false")


def require_env(*names: str) -> list[str]:
    """The values of these settings; any unset: skip here, fail in CI."""
    values = [os.environ.get(name, "") for name in names]
    missing = [name for name, value in zip(names, values, strict=True) if not value]
    if missing:
        message = f'{", ".join(missing)} not set: start the real stack with eval "$(scripts/stack up)"'
        if in_ci():
            pytest.fail(f"CI must run the integration tests: {message}")
        pytest.skip(message)
    return values


@pytest.fixture
def user() -> str:
    """A user id no other test or run uses."""
    return f"it-{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def remote_store() -> AsyncIterator[RemoteMemoryStore]:
    dgraph, http, grpc = require_env("MEMSTREAM_DGRAPH", "MEMSTREAM_WEAVIATE_HTTP", "MEMSTREAM_WEAVIATE_GRPC")
    store = await RemoteMemoryStore.open(dgraph, http, grpc, dim=DIM, prefix=PREFIX)
    try:
        yield store
    finally:
        await store.close()


STACK_ENV = (
    "MEMSTREAM_BROKER",
    "MEMSTREAM_DGRAPH",
    "MEMSTREAM_WEAVIATE_HTTP",
    "MEMSTREAM_WEAVIATE_GRPC",
    "MEMSTREAM_OLLAMA_HOST",
    "MEMSTREAM_OLLAMA_MODEL",
    "MEMSTREAM_EMBED_MODEL",
)


@pytest.fixture(scope="session")
def real_stack() -> dict[str, str]:
    """Every address and model name ``scripts/stack up`` exports, by variable name."""
    return dict(zip(STACK_ENV, require_env(*STACK_ENV), strict=True))


@pytest.fixture(scope="session")
def ollama() -> tuple[str, str, str]:
    """(host, chat model, embedding model) of the real Ollama server, after checking it answers."""
    host, model, embed = require_env("MEMSTREAM_OLLAMA_HOST", "MEMSTREAM_OLLAMA_MODEL", "MEMSTREAM_EMBED_MODEL")
    version = httpx.get(f"{host}/api/version", timeout=10)
    assert version.status_code == 200, f"Ollama at {host} does not answer: {version.status_code}"
    return host, model, embed


@pytest.fixture(scope="session")
def kafka() -> str:
    """The bootstrap address of the real Apache Kafka."""
    (broker,) = require_env("MEMSTREAM_BROKER")
    return broker
