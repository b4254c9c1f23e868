"""Embedded memory store: graph, vectors, lexical index, applied events and KV cache in one SQLite file."""

from .schema import StoreDimensionError
from .store import SqliteMemoryStore

__all__ = ["SqliteMemoryStore", "StoreDimensionError"]
