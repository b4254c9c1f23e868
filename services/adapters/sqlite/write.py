"""The write path: a change set and its vectors in one IMMEDIATE transaction (runs on the store's writer thread)."""

from __future__ import annotations

from collections.abc import Sequence

import apsw

from services.domain import Announcement, ApplyResult, ChangeSet, VertexKind
from services.ports import VectorItem

from .codec import (
    EDGE_COLUMNS,
    N_EDGE_COLUMNS,
    N_VERTEX_COLUMNS,
    VERTEX_COLUMNS,
    dt_to_text,
    edge_row,
    user_key,
    vector_blob,
    vertex_row,
)
from .read import seen_events

_INSERT_VERTEX = f"INSERT OR IGNORE INTO vertices ({VERTEX_COLUMNS}) VALUES ({', '.join('?' * N_VERTEX_COLUMNS)})"
_INSERT_EDGE = f"INSERT OR IGNORE INTO edges ({EDGE_COLUMNS}) VALUES ({', '.join('?' * N_EDGE_COLUMNS)})"
# invalidation never deletes and the first one wins, so a replay (or a later duplicate) changes nothing
_INVALIDATE = (
    "UPDATE vertices SET t_invalid = ?, t_expired = ?, invalidated_by = ? "
    "WHERE user_id = ? AND id = ? AND kind = 'thesis' AND t_invalid IS NULL"
)


def check_change_set(change_set: ChangeSet, vectors: Sequence[VectorItem], dim: int) -> None:
    """Refuse anything that would write into another user's memory, or a vector of the wrong size."""
    user = change_set.user_id
    for vertex in change_set.vertices:
        if vertex.user_id != user:
            raise ValueError(f"vertex {vertex.id} belongs to {vertex.user_id!r}, change set to {user!r}")
    for edge in change_set.edges:
        if edge.user_id != user:
            raise ValueError(f"edge {edge.id} belongs to {edge.user_id!r}, change set to {user!r}")
    for item in vectors:
        if len(item.vector) != dim:
            raise ValueError(f"vector {item.id} has {len(item.vector)} dimensions, the store has {dim}")


def _write(conn: apsw.Connection, change_set: ChangeSet, vectors: Sequence[VectorItem], dim: int) -> ApplyResult:
    user = change_set.user_id
    key = user_key(user)
    result = ApplyResult()
    for vertex in change_set.vertices:
        conn.execute(_INSERT_VERTEX, vertex_row(vertex))
        if conn.changes():
            result.vertices_added += 1
            result.theses_added += vertex.kind is VertexKind.THESIS
    for edge in change_set.edges:
        conn.execute(_INSERT_EDGE, edge_row(edge))
        result.edges_added += conn.changes()
    for inv in change_set.invalidations:
        conn.execute(
            _INVALIDATE,
            (dt_to_text(inv.t_invalid), dt_to_text(inv.t_expired), inv.invalidated_by, user, inv.thesis_id),
        )
        result.theses_invalidated += conn.changes()
    for item in vectors:
        conn.execute(
            "INSERT OR IGNORE INTO items (user_id, user_key, id, kind, text) VALUES (?, ?, ?, ?, ?)",
            (user, key, item.id, item.kind, item.text),
        )
        if not conn.changes():
            continue  # indexed before: its vector and text stay as they were
        item_no = conn.last_insert_rowid()
        conn.execute(
            "INSERT INTO vectors (rowid, user_id, kind, embedding) VALUES (?, ?, ?, ?)",
            (item_no, user, item.kind, vector_blob(item.vector, dim)),
        )
        conn.execute(
            "INSERT INTO fts (rowid, text, user_key, kind) VALUES (?, ?, ?, ?)", (item_no, item.text, key, item.kind)
        )
    conn.executemany(
        "INSERT OR IGNORE INTO applied_events (user_id, event_id, change_set_id) VALUES (?, ?, ?)",
        [(user, event_id, change_set.id) for event_id in change_set.event_ids],
    )
    result.announcement = Announcement.of(change_set, result)
    conn.execute(
        "INSERT OR REPLACE INTO pending_announcements (user_id, change_set_id, announcement) VALUES (?, ?, ?)",
        (user, change_set.id, result.announcement.model_dump_json()),
    )
    return result


def apply_change_set(
    conn: apsw.Connection, change_set: ChangeSet, vectors: Sequence[VectorItem], dim: int
) -> ApplyResult:
    check_change_set(change_set, vectors, dim)
    event_ids = list(dict.fromkeys(change_set.event_ids))
    # IMMEDIATE takes the write lock up front: a deferred read-then-write could fail on upgrade under contention
    conn.execute("BEGIN IMMEDIATE")
    try:
        seen = seen_events(conn, change_set.user_id, event_ids)
        if event_ids and len(seen) == len(event_ids):
            conn.execute("ROLLBACK")
            return ApplyResult(skipped_events=event_ids)
        result = _write(conn, change_set, vectors, dim)
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    result.skipped_events = [event_id for event_id in event_ids if event_id in seen]
    return result


def mark_announced(conn: apsw.Connection, user_id: str, change_set_ids: Sequence[str]) -> None:
    with conn:  # one transaction
        conn.executemany(
            "DELETE FROM pending_announcements WHERE user_id = ? AND change_set_id = ?",
            [(user_id, change_set_id) for change_set_id in change_set_ids],
        )


def put_value(conn: apsw.Connection, key: str, value: str) -> None:
    conn.execute(
        "INSERT INTO kv (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
        (key, value),
    )
