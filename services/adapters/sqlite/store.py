"""``SqliteMemoryStore``: every store port of the embedded backend (graph, vectors, writes, announcements, forgetting
and the LLM cache) in one SQLite file (apsw + sqlite-vec).

apsw is synchronous, so every call runs on a worker thread and the event loop never waits on disk. Writes go
through one writer thread (one connection), so they are serialised within the process; across processes, WAL mode
plus ``BEGIN IMMEDIATE`` and a busy timeout let a memorize worker write while QA workers and the gateway read.
Readers run on a small pool, each thread with its own connection.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar

import apsw
from prometheus_client import Histogram

from services.domain import (
    Announcement,
    ApplyResult,
    ChangeSet,
    EdgeKind,
    Erasure,
    Stats,
    Triplet,
    Vertex,
    VertexKind,
)
from services.logging import get_logger
from services.metrics import STORE_WRITE_LATENCY
from services.ports import (
    CacheScope,
    Vector,
    VectorHit,
    VectorItem,
    WholeBackend,
)

from . import read, search
from .follow import MIN_ITEMS
from .schema import connect, create_schema
from .signs import SignIndex
from .terms import TermIndex
from .write import apply_change_set, erase, forget_values, mark_announced, put_value

T = TypeVar("T")

READ_LATENCY = Histogram(
    "memstream_sqlite_read_seconds",
    "Embedded store read latency",
    ["op"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
)

log = get_logger(__name__)


class SqliteMemoryStore(WholeBackend):
    def __init__(
        self,
        path: Path | str,
        dim: int,
        readers: int = 2,
        sign_min_items: int | None = MIN_ITEMS,
        term_min_items: int | None = MIN_ITEMS,
    ) -> None:
        """``sign_min_items``: users with at least this many indexed texts are searched by their sign bits first
        (``signs``); None: every dense search is vec0's exact scan. ``term_min_items``: likewise, their lexical
        search runs over an in-memory index (``terms``); None: every lexical search is FTS5's."""
        if dim <= 0:
            raise ValueError("dim must be positive")
        self.path = Path(path)
        self.dim = dim
        self.path.parent.mkdir(parents=True, exist_ok=True)
        init = connect(self.path)
        try:
            create_schema(init, dim)
        finally:
            init.close()
        self._local = threading.local()
        self._connections: list[apsw.Connection] = []
        self._lock = threading.Lock()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sqlite-write")
        self._readers = ThreadPoolExecutor(max_workers=max(1, readers), thread_name_prefix="sqlite-read")
        self._closed = False
        self._signs = None if sign_min_items is None else SignIndex(dim, sign_min_items)
        self._terms = None if term_min_items is None else TermIndex(term_min_items)
        log.info("sqlite_store_opened", path=str(self.path), dim=dim)

    @classmethod
    async def open(
        cls,
        path: Path | str,
        dim: int,
        readers: int = 2,
        sign_min_items: int | None = MIN_ITEMS,
        term_min_items: int | None = MIN_ITEMS,
    ) -> Self:
        """Open without blocking the event loop (creating the schema touches the disk)."""
        return await asyncio.to_thread(cls, path, dim, readers, sign_min_items, term_min_items)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # -- threads and connections ---------------------------------------------------------------------------

    def _conn(self) -> apsw.Connection:
        """This worker thread's connection (apsw connections are not shared between our threads)."""
        conn: apsw.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = connect(self.path)
            self._local.conn = conn
            with self._lock:
                self._connections.append(conn)
        return conn

    async def _run(self, pool: ThreadPoolExecutor, fn: Callable[..., T], *args: Any) -> T:
        if self._closed:
            raise RuntimeError("store is closed")
        return await asyncio.get_running_loop().run_in_executor(pool, lambda: fn(self._conn(), *args))

    async def _read(self, op: str, fn: Callable[..., T], *args: Any) -> T:
        started = time.perf_counter()
        try:
            return await self._run(self._readers, fn, *args)
        finally:
            READ_LATENCY.labels(op=op).observe(time.perf_counter() - started)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True

        def shutdown() -> None:
            self._writer.shutdown(wait=True)
            self._readers.shutdown(wait=True)
            with self._lock:
                for conn in self._connections:
                    conn.close()
                self._connections.clear()

        await asyncio.to_thread(shutdown)
        log.info("sqlite_store_closed", path=str(self.path))

    # -- MemoryWriter ------------------------------------------------------------------------------------------

    async def apply(self, change_set: ChangeSet, vectors: Sequence[VectorItem]) -> ApplyResult:
        started = time.perf_counter()
        result = await self._run(self._writer, apply_change_set, change_set, list(vectors), self.dim)
        STORE_WRITE_LATENCY.labels(store="sqlite").observe(time.perf_counter() - started)
        log.debug(
            "change_set_applied",
            user_id=change_set.user_id,
            change_set_id=change_set.id,
            **result.model_dump(exclude={"skipped_events", "announcement"}),
            skipped=len(result.skipped_events),
        )
        return result

    async def get_vertices(self, user_id: str, ids: Sequence[str]) -> dict[str, Vertex]:
        if not ids:
            return {}
        return await self._read("get_vertices", read.get_vertices, user_id, list(ids))

    async def find_objects(self, user_id: str, normalized_names: Sequence[str]) -> dict[str, Vertex]:
        if not normalized_names:
            return {}
        return await self._read("find_objects", read.find_objects, user_id, list(normalized_names))

    async def neighbors(
        self,
        user_id: str,
        vertex_ids: Sequence[str],
        edge_kinds: Sequence[EdgeKind] | None = None,
        limit_per_vertex: int | None = None,
        far_kinds: Sequence[VertexKind] | None = None,
    ) -> list[Triplet]:
        if not vertex_ids:
            return []
        kinds = None if edge_kinds is None else list(edge_kinds)
        far = None if far_kinds is None else list(far_kinds)
        return await self._read("neighbors", read.neighbors, user_id, list(vertex_ids), kinds, limit_per_vertex, far)

    async def get_triplets(self, user_id: str, edge_ids: Sequence[str]) -> dict[str, Triplet]:
        if not edge_ids:
            return {}
        return await self._read("get_triplets", read.get_triplets, user_id, list(edge_ids))

    async def valid_theses(self, user_id: str, about: Sequence[str] | None = None, limit: int = 50) -> list[Vertex]:
        objects = None if about is None else list(about)
        return await self._read("valid_theses", read.valid_theses, user_id, objects, limit)

    async def valid_theses_each(
        self, user_id: str, object_ids: Sequence[str], limit: int = 50
    ) -> dict[str, list[Vertex]]:
        if not object_ids:
            return {}
        return await self._read("valid_theses_each", read.valid_theses_each, user_id, list(object_ids), limit)

    async def seen_events(self, user_id: str, event_ids: Sequence[str]) -> set[str]:
        if not event_ids:
            return set()
        return await self._read("seen_events", read.seen_events, user_id, list(event_ids))

    async def stats(self, user_id: str) -> Stats:
        return await self._read("stats", read.stats, user_id)

    async def search(
        self,
        user_id: str,
        kinds: Sequence[str],
        query_vector: Vector | None,
        query_text: str | None = None,
        k: int = 10,
        restrict_to: Sequence[str] | None = None,
    ) -> list[VectorHit]:
        """``kinds`` empty: every kind. Dense if only a vector, BM25 if only text, RRF (k=60) if both."""
        kinds = list(kinds)
        ids = None if restrict_to is None else list(restrict_to)
        if query_vector is not None and query_text:
            vector = list(query_vector)
            return await self._read(
                "search_hybrid",
                search.hybrid,
                user_id,
                kinds,
                vector,
                query_text,
                k,
                self.dim,
                ids,
                self._signs,
                self._terms,
            )
        if query_vector is not None:
            vector = list(query_vector)
            ranked = await self._read(
                "search_dense", search.dense, user_id, kinds, vector, k, self.dim, ids, self._signs
            )
            return search.hits(ranked)
        if query_text:
            ranked = await self._read("search_lexical", search.lexical, user_id, kinds, query_text, k, ids, self._terms)
            return search.hits(ranked)
        return []

    async def get_vectors(self, user_id: str, ids: Sequence[str]) -> dict[str, list[float]]:
        if not ids:
            return {}
        return await self._read("get_vectors", search.get_vectors, user_id, list(ids))

    async def search_many(
        self, user_id: str, kinds: Sequence[str], query_vectors: Sequence[Vector], k: int = 10
    ) -> list[list[VectorHit]]:
        """One read (one thread hop, one connection) for the whole batch of dense searches."""
        if not query_vectors:
            return []
        vectors = [list(v) for v in query_vectors]
        return await self._read(
            "search_dense_many", search.dense_many, user_id, list(kinds), vectors, k, self.dim, self._signs
        )

    # -- AnnouncementLog -----------------------------------------------------------------------------------------

    async def pending_announcements(self, user_id: str, event_ids: Sequence[str]) -> list[Announcement]:
        if not event_ids:
            return []
        return await self._read("pending_announcements", read.pending_announcements, user_id, list(event_ids))

    async def mark_announced(self, user_id: str, change_set_ids: Sequence[str]) -> None:
        if change_set_ids:
            await self._run(self._writer, mark_announced, user_id, list(change_set_ids))

    # -- KeyValueCache ------------------------------------------------------------------------------------------

    async def get(self, key: str) -> str | None:
        return await self._read("kv_get", read.get_value, key)

    async def put(self, key: str, value: str, scope: CacheScope | None = None) -> None:
        await self._run(self._writer, put_value, key, value, scope)

    async def forget(self, user_id: str, event_ids: Sequence[str] | None) -> int:
        return await self._run(self._writer, forget_values, user_id, None if event_ids is None else list(event_ids))

    # -- ForgetStore ---------------------------------------------------------------------------------------------

    async def episodes(self, user_id: str, match: Mapping[str, str] | None) -> list[Vertex]:
        return await self._read("episodes", read.episodes, user_id, None if match is None else dict(match))

    async def invalidated_by(self, user_id: str, thesis_ids: Sequence[str]) -> list[Vertex]:
        if not thesis_ids:
            return []
        return await self._read("invalidated_by", read.invalidated_by, user_id, list(thesis_ids))

    async def forget_outcome(self, user_id: str, forget_id: str) -> str | None:
        return await self._read("forget_outcome", read.forget_outcome, user_id, forget_id)

    async def erase(self, erasure: Erasure, vectors: Sequence[VectorItem] = ()) -> None:
        started = time.perf_counter()
        await self._run(self._writer, erase, erasure, list(vectors), self.dim)
        STORE_WRITE_LATENCY.labels(store="sqlite").observe(time.perf_counter() - started)

    # -- tests and tooling ---------------------------------------------------------------------------------------

    async def dump(self, user_id: str | None = None) -> dict[str, list[tuple[Any, ...]]]:
        """Every row of every table (one user's, or all plus the KV cache), sorted: equal dumps, equal content."""
        return await self._read("dump", read.in_snapshot(read.dump), user_id)

    async def content_hashes(self) -> dict[str, str]:
        """Per user, a hash of their memory (``read.content``): equal hashes, equal memory, however it was built."""
        contents = await self._read("content", read.in_snapshot(_contents))
        return {user: hashlib.sha256(json.dumps(rows).encode()).hexdigest() for user, rows in contents.items()}

    async def pending_count(self) -> int:
        """Announcements of every user not yet marked announced."""
        return await self._read("pending_count", read.pending_count)


def _contents(conn: apsw.Connection) -> dict[str, dict[str, list[tuple[Any, ...]]]]:
    return {user: read.content(conn, user) for user in read.users(conn)}
