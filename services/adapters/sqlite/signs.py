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
first search of a 1M-triplet user in a process: 1.5-2.6 s here); ``follow`` keeps the copy in step with the file.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import apsw
import numpy as np

from .follow import MIN_ITEMS, ItemFollower

# a candidate's vector is one point read (``item_vectors``, ~10 us): 4 x k candidates kept flat's 180-deep search
# near 11 ms at 1M triplets with recall@10 0.99 and recall@180 0.87 (8 x k: 32 ms, 0.99 and 0.95; docs/benchmarks.md)
OVERSAMPLE = 4
MIN_CANDIDATES = 256


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


Copy = dict[str, _Kind]  # a big user's sign bits by kind


class SignIndex(ItemFollower[Copy]):
    """The in-memory sign bits of the big users of one store, shared by its reader threads."""

    columns = ", sign"

    def __init__(self, dim: int, min_items: int = MIN_ITEMS) -> None:
        super().__init__(min_items)
        self.words = -(-dim // 64)

    def candidates(
        self, conn: apsw.Connection, user_id: str, kinds: Sequence[str], vector: Sequence[float], k: int
    ) -> np.ndarray | None:
        """The item numbers to re-rank for the ``k`` nearest, or None when the user is searched exactly."""
        copy = self.copy_of(conn, user_id)
        if copy is None:
            return None
        parts = [p for kind, p in copy.items() if not kinds or kind in kinds]
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

    def _empty(self) -> Copy:
        return {}

    def _add(self, copy: Copy, rows: Sequence[Any]) -> Copy:
        by_kind: dict[str, list[tuple[int, bytes]]] = {}
        for item_no, kind, sign in rows:
            if sign is not None:  # written before sign bits existed and not backfilled: never a candidate
                by_kind.setdefault(str(kind), []).append((int(item_no), bytes(sign)))
        grown = dict(copy)
        for kind, found in by_kind.items():
            item_nos = np.fromiter((n for n, _ in found), dtype=np.int64, count=len(found))
            codes = _from_blobs([s for _, s in found], self.words)
            part = grown.get(kind)
            grown[kind] = (
                _Kind(item_nos, np.ascontiguousarray(codes.T)) if part is None else part.append(item_nos, codes)
            )
        return grown


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
