"""The gateway's write-ahead outbox: what it acknowledged, on disk before the 202, until memory holds it.

The embedded broker keeps records in RAM, so the broker's acknowledgement is not durable. The gateway therefore
writes every accepted memory event (chat message, document) into a SQLite file (WAL, ``synchronous=FULL``: a
commit is on disk when it returns) before it answers, then publishes it. Concurrent requests share one commit
(group commit), so the fsync is paid once per batch of requests, not once per request.

An entry stays until memorize has applied its event and announced its change set (the store's ``seen_events``
less the events of pending announcements) — then it is pruned — or the event was dead-lettered (then it is marked
and never replayed by itself; an operator's dead-letter replay makes it pending again). On start the relay
re-publishes every pending entry, oldest first, so a user's events keep their order; memorize is idempotent by
event id, so a re-publish of an event the broker still has is harmless, and one of an applied event whose memory
update is pending makes memorize publish that update. The relay also retries entries whose publish failed,
periodically, until one succeeds.

One outbox per data directory: gateways sharing a data directory share it (SQLite locks; replays are
idempotent); gateways on different machines each keep their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from services import metrics
from services.logging import get_logger

log = get_logger(__name__)

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS outbox (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    topic TEXT NOT NULL,
    user_id TEXT NOT NULL,
    event_id TEXT NOT NULL,
    value BLOB NOT NULL,
    accepted_at REAL NOT NULL,
    dead_at REAL,
    dead_reason TEXT,
    UNIQUE (user_id, event_id)
);
"""

#: rows read, checked against the store or published per step
CHUNK = 500


@dataclass(frozen=True)
class OutboxRecord:
    topic: str
    user_id: str
    event_id: str
    value: bytes


@dataclass(frozen=True)
class OutboxEntry:
    seq: int
    record: OutboxRecord
    dead: bool = False


Applied = Callable[[str, Sequence[str]], Awaitable[set[str]]]
Publish = Callable[[Sequence[OutboxRecord]], Awaitable[None]]


class Outbox:
    """The SQLite outbox file. Every call runs on one thread of its own; ``add`` group-commits."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="outbox")
        self._conn: sqlite3.Connection | None = None
        self._queue: list[tuple[list[OutboxRecord], asyncio.Future[None]]] = []
        self._writer: asyncio.Task[None] | None = None

    async def open(self) -> None:
        await self._run(self._open)

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA busy_timeout = 10000")
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = FULL")  # WAL + FULL: every commit fsyncs the log before it returns
        conn.execute("PRAGMA secure_delete = ON")  # a forgotten message's text does not linger in free pages
        conn.executescript(_SCHEMA)
        self._conn = conn
        _fsync_dir(self.path.parent)  # the new file's directory entry survives a power cut too

    async def close(self) -> None:
        if self._writer is not None:
            with contextlib.suppress(Exception):
                await self._writer
        await self._run(self._close)
        self._executor.shutdown(wait=True)

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            raise RuntimeError("the outbox is not open")
        return self._conn

    async def pragma(self, name: str) -> Any:
        """A pragma's value (tests check the durability settings)."""
        return await self._run(lambda: self._db().execute(f"PRAGMA {name}").fetchone()[0])

    def _write(self, sql: str, rows: list[tuple[Any, ...]]) -> int:
        """``sql`` for every row, in one transaction (one fsync); returns the rows changed."""
        db = self._db()
        db.execute("BEGIN IMMEDIATE")
        try:
            changed = db.executemany(sql, rows).rowcount
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        return changed

    async def add(self, records: Sequence[OutboxRecord]) -> None:
        """Return once ``records`` are committed to disk. Requests that arrive while a commit runs share the next."""
        if not records:
            return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append((list(records), done))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write_queued())
        # a client that hangs up does not cancel the commit its neighbours share
        await asyncio.shield(done)

    async def _write_queued(self) -> None:
        while self._queue:
            batch, self._queue = self._queue, []
            try:
                await self._run(self._insert, [r for records, _ in batch for r in records])
            except Exception as exc:
                for _, done in batch:
                    done.set_exception(exc)
            else:
                metrics.OUTBOX_COMMITS.inc()
                for _, done in batch:
                    done.set_result(None)

    def _insert(self, records: list[OutboxRecord]) -> None:
        now = time.time()
        # accepted again (e.g. a dead letter replayed): pending again, at its first place in the user's order
        self._write(
            "INSERT INTO outbox (topic, user_id, event_id, value, accepted_at) VALUES (?, ?, ?, ?, ?) "
            "ON CONFLICT (user_id, event_id) DO UPDATE SET value = excluded.value, topic = excluded.topic, "
            "dead_at = NULL, dead_reason = NULL",
            [(r.topic, r.user_id, r.event_id, r.value, now) for r in records],
        )

    async def entries(self, after_seq: int = 0, limit: int = CHUNK, include_dead: bool = False) -> list[OutboxEntry]:
        """Entries after ``after_seq``, in acceptance order."""
        return await self._run(self._entries, after_seq, limit, include_dead)

    def _entries(self, after_seq: int, limit: int, include_dead: bool) -> list[OutboxEntry]:
        where = "" if include_dead else "AND dead_at IS NULL"
        rows = self._db().execute(
            f"SELECT seq, topic, user_id, event_id, value, dead_at FROM outbox WHERE seq > ? {where} "
            "ORDER BY seq LIMIT ?",
            (after_seq, limit),
        )
        return [OutboxEntry(seq, OutboxRecord(t, u, e, bytes(v)), dead is not None) for seq, t, u, e, v, dead in rows]

    async def remove(self, user_id: str, event_ids: Iterable[str]) -> int:
        """Drop entries whose events memory holds; returns how many went."""
        rows = [(user_id, e) for e in event_ids]
        return await self._run(self._write, "DELETE FROM outbox WHERE user_id = ? AND event_id = ?", rows)

    async def checkpoint(self) -> bool:
        """Fold the WAL into the file and truncate it: the pages of rows just deleted (a forgotten message) stay in
        the WAL file until then. False when a reader kept it from finishing (the next checkpoint does)."""

        def run() -> bool:
            busy, _, _ = self._db().execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            return not busy

        return await self._run(run)

    async def mark_dead(self, user_id: str, event_ids: Iterable[str], reason: str) -> None:
        rows = [(time.time(), reason, user_id, e) for e in event_ids]
        sql = "UPDATE outbox SET dead_at = ?, dead_reason = ? WHERE user_id = ? AND event_id = ?"
        await self._run(self._write, sql, rows)

    async def last_seq(self) -> int:
        return await self._run(
            lambda: int(self._db().execute("SELECT COALESCE(MAX(seq), 0) FROM outbox").fetchone()[0])
        )

    async def counts(self) -> dict[str, int]:
        """``{"pending": n, "dead": m}``."""
        return await self._run(self._counts)

    def _counts(self) -> dict[str, int]:
        pending, dead = self._db().execute("SELECT COUNT(*) - COUNT(dead_at), COUNT(dead_at) FROM outbox").fetchone()
        return {"pending": int(pending or 0), "dead": int(dead or 0)}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class OutboxRelay:
    """Moves outbox entries into the broker and prunes the memorized ones.

    ``publish`` sends records and returns once the broker acknowledged them; ``applied(user_id, ids)`` says which
    events memory applied and announced (the gateway's ``StoreStats.applied``).
    """

    def __init__(self, outbox: Outbox, publish: Publish, applied: Applied, interval_s: float = 10.0) -> None:
        self.outbox = outbox
        self.publish = publish
        self.applied = applied
        self.interval_s = interval_s
        self.replayed = asyncio.Event()  # set once the start-up replay has run
        self._failed: set[tuple[str, str]] = set()  # (user, event) whose publish failed since the last pass
        self._task: asyncio.Task[None] | None = None

    def publish_failed(self, records: Iterable[OutboxRecord]) -> None:
        """The gateway could not publish these (it answered 503): the next pass retries them."""
        self._failed.update((r.user_id, r.event_id) for r in records)

    async def replay(self, only: set[tuple[str, str]] | None = None, upto: int | None = None) -> int:
        """Re-publish pending entries memory does not hold yet (all, those in ``only``, those up to seq ``upto``),
        in acceptance order; prune the ones it holds. Returns how many were published."""
        published = 0
        after = 0
        while chunk := await self.outbox.entries(after):
            after = chunk[-1].seq
            wanted = [
                e
                for e in chunk
                if (only is None or (e.record.user_id, e.record.event_id) in only) and (upto is None or e.seq <= upto)
            ]
            fresh = await self._prune(wanted)
            if fresh:
                await self.publish([e.record for e in fresh])
                published += len(fresh)
                metrics.OUTBOX_REPLAYED.inc(len(fresh))
        return published

    async def prune(self) -> int:
        """Drop every entry (dead-lettered ones too) whose event memory holds; returns how many remain."""
        left = 0
        after = 0
        while chunk := await self.outbox.entries(after, include_dead=True):
            after = chunk[-1].seq
            left += len(await self._prune(chunk))
        return left

    async def _prune(self, entries: Sequence[OutboxEntry]) -> list[OutboxEntry]:
        """Remove the entries memory holds; return the others, in their order."""
        by_user: dict[str, list[str]] = defaultdict(list)
        for entry in entries:
            by_user[entry.record.user_id].append(entry.record.event_id)
        held: set[tuple[str, str]] = set()
        for user_id, ids in by_user.items():
            seen = await self.applied(user_id, ids)
            if seen:
                await self.outbox.remove(user_id, seen)
                held.update((user_id, e) for e in seen)
        return [e for e in entries if (e.record.user_id, e.record.event_id) not in held]

    async def start(self, ready: Callable[[], Awaitable[object]] | None = None) -> None:
        """Run the start-up replay, then a prune-and-retry pass every ``interval_s``, in the background.
        ``ready`` is awaited first (the dead-letter feed has read its backlog, so dead events are known). Only what
        was accepted before this call is replayed: later entries are published by their own requests."""
        upto = await self.outbox.last_seq()
        self._task = asyncio.create_task(self._run(ready, upto))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self, ready: Callable[[], Awaitable[object]] | None, upto: int) -> None:
        if ready is not None:
            await ready()
        while not self.replayed.is_set():
            try:
                count = await self.replay(upto=upto)
                self.replayed.set()
                log.info("outbox_replayed", published=count, **await self.outbox.counts())
            except Exception as exc:  # broker or store not there yet: try again, nothing is dropped
                log.warning("outbox_replay_failed", error=repr(exc))
                await asyncio.sleep(min(self.interval_s, 2.0))
        while True:
            await asyncio.sleep(self.interval_s)
            await self.pass_once()

    async def pass_once(self) -> None:
        """Retry the entries whose publish failed, then prune; errors are logged and the next pass tries again."""
        failed, self._failed = self._failed, set()
        try:
            if failed:
                count = await self.replay(only=failed)
                log.info("outbox_retried", published=count)
            await self.prune()
            counts = await self.outbox.counts()
        except Exception as exc:
            self._failed |= failed
            log.warning("outbox_pass_failed", error=repr(exc))
            return
        metrics.OUTBOX_ENTRIES.labels(state="pending").set(counts["pending"])
        metrics.OUTBOX_ENTRIES.labels(state="dead").set(counts["dead"])
