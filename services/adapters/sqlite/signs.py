"""Dense search for a big user: the sign bits of every vector scanned in memory, the best candidates re-ranked by
their exact cosine in SQLite.

vec0's KNN reads every float vector of the user's partition: about 1.5 KB each at dim 384, so 0.7 GB a search for
a user with 460k indexed texts (a memory of 1M triplets), several hundred ms on a 2-core VM, and a question makes
several searches. One bit a dimension (the sign) is 48 bytes a vector: the Hamming distances of a query to half a
million of them take a few ms in numpy. The ``OVERSAMPLE`` x k nearest by Hamming distance (at least
``MIN_CANDIDATES``) are re-ranked by their exact cosine, from a copy of each vector in ``item_vectors`` (a point read
through vec0 loads the candidate's whole chunk of 256 vectors), in the exact path's order (distance, then id): the
hits and scores are exact cosines; what can differ is a true neighbour missing from the candidates.
``docs/benchmarks.md`` gives the recall measured against the exact search. A user with fewer than ``min_items``
texts is searched exactly, as before.

The sign bits are stored (``items.sign``, written with the vector) so a process loads a user's in one read (the
first search of a 1M-triplet user in a process: 1.5-2.6 s here). The
in-memory copy follows the file: after any commit by another connection (``PRAGMA data_version``) the texts indexed
since are appended; a deletion (forget) bumps that user's counter in ``meta`` (``items_deleted:`` and the user's
key) and only that user's copy is read again, so forgetting one user's message costs no other big user a reload.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import apsw
import numpy as np

from .codec import user_key

#: below this many indexed texts a user's dense search stays vec0's exact scan (it is fast enough there)
MIN_ITEMS = 20_000
# a candidate's vector is one point read (``item_vectors``, ~10 us): 4 x k candidates kept flat's 180-deep search
# near 11 ms at 1M triplets with recall@10 0.99 and recall@180 0.87 (8 x k: 32 ms, 0.99 and 0.95; docs/benchmarks.md)
OVERSAMPLE = 4
MIN_CANDIDATES = 256
DELETED_KEY = "items_deleted:"  # + the user's key: a counter per user


def sign_bits(vectors: np.ndarray) -> np.ndarray:
    """(n, dim) floats -> (n, ceil(dim / 64)) uint64: bit i set where dimension i is positive."""
    n, dim = vectors.shape
    words = -(-dim // 64)
    bits = np.zeros((n, words * 64), dtype=bool)
    bits[:, :dim] = vectors > 0
    return np.packbits(bits, axis=1, bitorder="little").view(np.uint64).reshape(n, words)


def sign_blob(vector: Sequence[float]) -> bytes:
    return sign_bits(np.asarray(vector, dtype=np.float32).reshape(1, -1)).tobytes()


def _from_blobs(blobs: Sequence[bytes], words: int) -> np.ndarray:
    return np.frombuffer(b"".join(blobs), dtype=np.uint64).reshape(len(blobs), words)


@dataclass
class _Kind:
    item_nos: np.ndarray  # int64 (n,)
    codes: np.ndarray  # uint64 (words, n): one contiguous row per word, so the scan runs over flat arrays

    def append(self, item_nos: np.ndarray, codes: np.ndarray) -> _Kind:
        return _Kind(np.concatenate([self.item_nos, item_nos]), np.concatenate([self.codes, codes.T], axis=1))


@dataclass
class _User:
    count: int
    max_item_no: int
    deleted: str
    kinds: dict[str, _Kind] | None = None  # None: too small, searched exactly
    synced: dict[int, int] = field(default_factory=dict)  # connection id -> its data_version when last synced


class SignIndex:
    """The in-memory sign bits of the big users of one store, shared by its reader threads."""

    def __init__(self, dim: int, min_items: int = MIN_ITEMS) -> None:
        self.words = -(-dim // 64)
        self.min_items = min_items
        self._users: dict[str, _User] = {}
        self._lock = threading.Lock()

    def candidates(
        self, conn: apsw.Connection, user_id: str, kinds: Sequence[str], vector: Sequence[float], k: int
    ) -> np.ndarray | None:
        """The item numbers to re-rank for the ``k`` nearest, or None when the user is searched exactly."""
        with self._lock:
            user = self._sync(conn, user_id)
            parts = None if user.kinds is None else [p for kind, p in user.kinds.items() if not kinds or kind in kinds]
        if parts is None:
            return None
        if not parts:
            return np.zeros(0, dtype=np.int64)
        query = sign_bits(np.asarray(vector, dtype=np.float32).reshape(1, -1))[0]
        distances = np.concatenate([self._hamming(p.codes, query) for p in parts])
        item_nos = np.concatenate([p.item_nos for p in parts])
        wanted = max(k * OVERSAMPLE, MIN_CANDIDATES)
        if len(item_nos) <= wanted:
            return item_nos
        # the smallest distance d with at least ``wanted`` candidates at or below it (ties all kept: deterministic)
        counts = np.cumsum(np.bincount(distances, minlength=self.words * 64 + 1))
        cutoff = int(np.searchsorted(counts, wanted))
        return item_nos[distances <= cutoff]

    def _hamming(self, codes: np.ndarray, query: np.ndarray) -> np.ndarray:
        n = codes.shape[1]
        total = np.zeros(n, dtype=np.uint16)
        scratch = np.empty(n, dtype=np.uint64)
        for word in range(self.words):
            np.bitwise_xor(codes[word], query[word], out=scratch)
            total += np.bitwise_count(scratch)
        return total

    # -- following the file ---------------------------------------------------------------------------------------

    def _sync(self, conn: apsw.Connection, user_id: str) -> _User:
        row: Any = conn.execute("PRAGMA data_version").fetchone()
        version = int(row[0])
        user = self._users.get(user_id)
        if user is not None and user.synced.get(id(conn)) == version:
            return user  # nothing committed by another connection since this one last looked
        deleted = _deleted(conn, user_id)
        if user is None or user.deleted != deleted:
            user = self._load(conn, user_id, deleted)
        else:
            self._append(conn, user_id, user)
        user.synced[id(conn)] = version
        self._users[user_id] = user
        return user

    def _load(self, conn: apsw.Connection, user_id: str, deleted: str) -> _User:
        found: Any = conn.execute(
            "SELECT count(*), coalesce(max(item_no), 0) FROM items WHERE user_id = ?", (user_id,)
        ).fetchone()
        count, top = found
        user = _User(count=int(count), max_item_no=int(top), deleted=deleted)
        if user.count >= self.min_items:
            rows: list[Any] = conn.execute(
                "SELECT item_no, kind, sign FROM items WHERE user_id = ? AND item_no <= ? ORDER BY item_no",
                (user_id, user.max_item_no),
            ).fetchall()
            user.kinds = {}
            self._add(user, rows)
        return user

    def _append(self, conn: apsw.Connection, user_id: str, user: _User) -> None:
        rows: list[Any] = conn.execute(
            "SELECT item_no, kind, sign FROM items WHERE item_no > ? AND user_id = ? ORDER BY item_no",
            (user.max_item_no, user_id),
        ).fetchall()
        if not rows:
            return
        user.count += len(rows)
        user.max_item_no = int(rows[-1][0])
        if user.kinds is not None:
            self._add(user, rows)
        elif user.count >= self.min_items:
            fresh = self._load(conn, user_id, user.deleted)
            user.kinds, user.count, user.max_item_no = fresh.kinds, fresh.count, fresh.max_item_no

    def _add(self, user: _User, rows: Sequence[Any]) -> None:
        assert user.kinds is not None
        by_kind: dict[str, list[tuple[int, bytes]]] = {}
        for item_no, kind, sign in rows:
            if sign is not None:  # written before sign bits existed and not backfilled: never a candidate
                by_kind.setdefault(str(kind), []).append((int(item_no), bytes(sign)))
        for kind, found in by_kind.items():
            item_nos = np.fromiter((n for n, _ in found), dtype=np.int64, count=len(found))
            codes = _from_blobs([s for _, s in found], self.words)
            part = user.kinds.get(kind)
            user.kinds[kind] = (
                _Kind(item_nos, np.ascontiguousarray(codes.T)) if part is None else part.append(item_nos, codes)
            )


def _deleted_key(user_id: str) -> str:
    return DELETED_KEY + user_key(user_id)  # a digest: meta holds no user id in the clear


def _deleted(conn: apsw.Connection, user_id: str) -> str:
    row: Any = conn.execute("SELECT value FROM meta WHERE key = ?", (_deleted_key(user_id),)).fetchone()
    return "0" if row is None else str(row[0])


def note_deletion(conn: apsw.Connection, user_id: str) -> None:
    """Called in the transaction that deletes a user's indexed texts: every process reloads that user's copy.
    Other users' copies stay valid: a reused item number is above every number still in use, so it reaches them
    as an appended text, never in place of one they hold."""
    conn.execute(
        "INSERT INTO meta (key, value) VALUES (?, '1') "
        "ON CONFLICT (key) DO UPDATE SET value = CAST(CAST(value AS INTEGER) + 1 AS TEXT)",
        (_deleted_key(user_id),),
    )


def backfill(conn: apsw.Connection, batch: int = 10_000) -> int:
    """Sign bits and the vector copy (``item_vectors``) of texts indexed by older code, from vec0's vectors."""
    done = after = 0
    while True:
        rows: list[Any] = conn.execute(
            "SELECT i.item_no, v.embedding FROM items i JOIN vectors v ON v.rowid = i.item_no WHERE i.item_no > ? "
            "AND (i.sign IS NULL OR NOT EXISTS (SELECT 1 FROM item_vectors iv WHERE iv.item_no = i.item_no)) "
            "ORDER BY i.item_no LIMIT ?",
            (after, batch),
        ).fetchall()
        if not rows:
            return done
        after = int(rows[-1][0])
        floats = np.frombuffer(b"".join(bytes(r[1]) for r in rows), dtype=np.float32).reshape(len(rows), -1)
        signs = sign_bits(floats)
        conn.executemany(
            "UPDATE items SET sign = ? WHERE item_no = ?", [(signs[i].tobytes(), r[0]) for i, r in enumerate(rows)]
        )
        conn.executemany("INSERT OR REPLACE INTO item_vectors (item_no, embedding) VALUES (?, ?)", rows)
        done += len(rows)
