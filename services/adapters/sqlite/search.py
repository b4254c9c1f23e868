"""Dense (vec0 KNN; sign bits for a big user), lexical (FTS5 BM25; in memory for a big user) and hybrid
(reciprocal rank fusion) search, scoped to one user."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import apsw
import numpy as np

from services.ports import VectorHit

from .codec import IN_LIST, blob_vector, fts_match, json_list, vector_blob
from .follow import item_ids
from .signs import SignIndex
from .terms import TermIndex

RRF_K = 60
VEC_MAX_K = 4096  # vec0's limit on k
# each ranking fused in hybrid search is this many times k deep (at least 30). 2, not 3: as good or better on both
# real sets (whole-conversation LoCoMo evidence recall@5/@10/@20, 2Wiki chains) and a third less to rank and
# re-rank for a big user (docs/benchmarks.md, "4 December, night")
HYBRID_DEPTH = 2

#: (id, score) best first: hits without a model each, for the rankings a hybrid search fuses (a flat retrieval's
#: two rankings are 540 deep each; a validated ``VectorHit`` a hit took a tenth of a question's time at 1M)
Ranked = list[tuple[str, float]]


def hits(ranked: Ranked) -> list[VectorHit]:
    return [VectorHit(id=id_, score=score) for id_, score in ranked]


def _filters(
    alias: str, user_id: str, kinds: Sequence[str], restrict_to: Sequence[str] | None
) -> tuple[str, list[object]]:
    """Kind and id filters shared by both searches; an empty ``kinds`` means every kind."""
    sql, params = "", list[object]()
    if kinds:
        sql += f" AND {alias}.kind IN {IN_LIST}"
        params.append(json_list(kinds))
    if restrict_to is not None:
        sql += f" AND {alias}.rowid IN (SELECT item_no FROM items WHERE user_id = ? AND id IN {IN_LIST})"
        params.extend([user_id, json_list(restrict_to)])
    return sql, params


def dense(
    conn: apsw.Connection,
    user_id: str,
    kinds: Sequence[str],
    vector: Sequence[float],
    k: int,
    dim: int,
    restrict_to: Sequence[str] | None = None,
    signs: SignIndex | None = None,
) -> Ranked:
    """The ``k`` nearest by cosine; ``signs``: a big user's candidates come from its sign bits (``signs``)."""
    if k <= 0 or (restrict_to is not None and not restrict_to):
        return []
    candidates = None if signs is None or restrict_to is not None else signs.candidates(conn, user_id, kinds, vector, k)
    if candidates is not None:
        return _rerank(conn, user_id, kinds, vector, k, dim, candidates.tolist())
    where, params = _filters("v", user_id, kinds, restrict_to)
    rows = conn.execute(
        f"""SELECT i.id, v.distance FROM vectors v JOIN items i ON i.item_no = v.rowid
            WHERE v.embedding MATCH ? AND v.k = ? AND v.user_id = ? {where}
            ORDER BY v.distance, i.id""",
        (vector_blob(vector, dim), min(k, VEC_MAX_K), user_id, *params),
    )
    # vec0's cosine distance is 1 - cos
    return [(str(row[0]), 1.0 - float(row[1])) for row in rows]


def _rerank(
    conn: apsw.Connection,
    user_id: str,
    kinds: Sequence[str],
    vector: Sequence[float],
    k: int,
    dim: int,
    candidates: list[int],
) -> Ranked:
    """The exact cosine of each candidate (its vector from ``item_vectors``, one point read: through vec0 a point
    read loads the candidate's whole chunk of 256 vectors), in the exact search's order: distance, then id. Only
    the nearest are looked up in ``items`` (their ids, and the user and kind checked again)."""
    if not candidates:
        return []
    rows: list[Any] = conn.execute(
        "SELECT iv.item_no, iv.embedding FROM json_each(?) c CROSS JOIN item_vectors iv ON iv.item_no = c.value",
        (json.dumps(sorted(candidates)),),  # in the table's order: 15% faster than scattered point reads
    ).fetchall()
    if not rows:
        return []
    item_nos = np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows))
    found = np.frombuffer(b"".join(bytes(r[1]) for r in rows), dtype=np.float32).reshape(len(rows), dim)
    query = np.asarray(vector, dtype=np.float32)
    norms = np.linalg.norm(found, axis=1) * float(np.linalg.norm(query))
    distances = 1.0 - (found @ query) / np.maximum(norms, 1e-30)
    order = np.argsort(distances, kind="stable")
    best: list[tuple[float, str]] = []
    done = 0
    while done < len(order) and len(best) < k:
        # the next k (and every candidate tied with the last of them: ties are ordered by id, read below)
        end = min(done + k, len(order))
        while end < len(order) and distances[order[end]] == distances[order[end - 1]]:
            end += 1
        part = order[done:end]
        ids = item_ids(conn, user_id, kinds, item_nos[part].tolist())
        best += [(float(distances[j]), ids[int(item_nos[j])]) for j in part if int(item_nos[j]) in ids]
        done = end
    return [(id_, 1.0 - distance) for distance, id_ in sorted(best)[:k]]


def dense_many(
    conn: apsw.Connection,
    user_id: str,
    kinds: Sequence[str],
    vectors: Sequence[Sequence[float]],
    k: int,
    dim: int,
    signs: SignIndex | None = None,
) -> list[list[VectorHit]]:
    """``dense`` for each vector, on one connection in one read transaction (the hits agree with one snapshot)."""
    with conn:
        found = [hits(dense(conn, user_id, kinds, vector, k, dim, signs=signs)) for vector in vectors]
    return found


def lexical(
    conn: apsw.Connection,
    user_id: str,
    kinds: Sequence[str],
    text: str,
    k: int,
    restrict_to: Sequence[str] | None = None,
    terms: TermIndex | None = None,
) -> Ranked:
    """The ``k`` best by BM25; ``terms``: a big user's from its in-memory index (``terms``), not FTS5's."""
    query = fts_match(user_id, kinds, text)
    if query is None or k <= 0 or (restrict_to is not None and not restrict_to):
        return []
    if terms is not None and restrict_to is None:
        found = terms.search(conn, user_id, kinds, text, k)
        if found is not None:
            return found
    # the MATCH already keeps only this user's rows of these kinds; the exact SQL filters on items guard it
    where, params = _filters("i", user_id, kinds, restrict_to)
    rows = conn.execute(
        f"""SELECT i.id, bm25(fts, 1.0, 0.0, 0.0) AS rank FROM fts JOIN items i ON i.item_no = fts.rowid
            WHERE fts MATCH ? AND i.user_id = ? {where}
            ORDER BY rank, i.id LIMIT ?""",
        (query, user_id, *params, k),
    )
    # FTS5's bm25() is negated so that smaller sorts first; the port wants higher = better
    return [(str(row[0]), -float(row[1])) for row in rows]


def fuse(rankings: Sequence[Sequence[VectorHit]], k: int) -> list[VectorHit]:
    """Reciprocal rank fusion: score = sum over lists of 1 / (RRF_K + rank), rank from 1."""
    return fuse_ids([[hit.id for hit in ranking] for ranking in rankings], k)


def fuse_ids(rankings: Sequence[Sequence[str]], k: int) -> list[VectorHit]:
    """``fuse`` over the rankings' ids, best first (the fusion reads ranks only)."""
    scores: dict[str, float] = {}
    for ranking in rankings:
        for rank, id_ in enumerate(ranking, start=1):
            scores[id_] = scores.get(id_, 0.0) + 1.0 / (RRF_K + rank)
    best = sorted(scores.items(), key=lambda item: (-item[1], item[0]))[:k]
    return [VectorHit(id=id_, score=score) for id_, score in best]


def hybrid(
    conn: apsw.Connection,
    user_id: str,
    kinds: Sequence[str],
    vector: Sequence[float],
    text: str,
    k: int,
    dim: int,
    restrict_to: Sequence[str] | None = None,
    signs: SignIndex | None = None,
    terms: TermIndex | None = None,
) -> list[VectorHit]:
    depth = max(HYBRID_DEPTH * k, 30)
    conn.execute("BEGIN")  # both rankings from one snapshot
    try:
        dense_hits = dense(conn, user_id, kinds, vector, depth, dim, restrict_to, signs)
        lexical_hits = lexical(conn, user_id, kinds, text, depth, restrict_to, terms)
    finally:
        conn.execute("COMMIT")
    return fuse_ids([[id_ for id_, _ in dense_hits], [id_ for id_, _ in lexical_hits]], k)


def get_vectors(conn: apsw.Connection, user_id: str, ids: Sequence[str]) -> dict[str, list[float]]:
    # from the vector copy by item number, a point read each: through vec0 each read loaded the item's whole chunk
    # of 256 vectors (the QA filter's 20 vectors took 2 ms at 1M triplets)
    rows = conn.execute(
        """SELECT i.id, iv.embedding FROM json_each(?) w CROSS JOIN items i ON i.user_id = ? AND i.id = w.value
            CROSS JOIN item_vectors iv ON iv.item_no = i.item_no""",
        (json_list(ids), user_id),
    )
    return {row[0]: blob_vector(row[1]) for row in rows}
