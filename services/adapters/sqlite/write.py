"""The write path: a change set and its vectors in one IMMEDIATE transaction (runs on the store's writer thread)."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from datetime import datetime

import apsw

from services.domain import Announcement, ApplyResult, ChangeSet, EdgeKind, Erasure, VertexKind
from services.logging import get_logger
from services.ports import CacheScope, VectorItem
from services.validity import reopened

from .codec import (
    EDGE_COLUMNS,
    IN_LIST,
    N_EDGE_COLUMNS,
    N_VERTEX_COLUMNS,
    VERTEX_COLUMNS,
    dt_to_text,
    edge_row,
    json_list,
    props_to_text,
    text_to_dt,
    user_key,
    vector_blob,
    vertex_row,
)
from .follow import note_deletion
from .read import seen_events
from .signs import sign_blob

log = get_logger(__name__)

_INSERT_VERTEX = f"INSERT OR IGNORE INTO vertices ({VERTEX_COLUMNS}) VALUES ({', '.join('?' * N_VERTEX_COLUMNS)})"
_INSERT_EDGE = f"INSERT OR IGNORE INTO edges ({EDGE_COLUMNS}) VALUES ({', '.join('?' * N_EDGE_COLUMNS)})"
# invalidation never deletes and the first one wins, so a replay (or a later duplicate) changes nothing
_INVALIDATE = (
    "UPDATE vertices SET t_invalid = ?, t_expired = ?, invalidated_by = ? "
    "WHERE user_id = ? AND id = ? AND kind = 'thesis' AND t_invalid IS NULL"
)
_INVALIDATE_EDGE = (
    "UPDATE edges SET t_invalid = ?, t_expired = ?, invalidated_by = ? "
    "WHERE user_id = ? AND id = ? AND kind = 'relation' AND t_invalid IS NULL"
)
# a known thesis's marks changed (``ChangeSet.props_updates``): its props as memorize computed them
_PUT_PROPS = "UPDATE vertices SET props = ? WHERE user_id = ? AND id = ? AND kind = 'thesis'"
# a relation edge (or a thesis) stated again by a valid thesis about a time at or after it ended holds again, with
# the time in between kept as a gap (services/validity.py); one about an earlier time (a replay of an older change
# set, a late event) leaves it as it is
_ENDED = (
    "SELECT t_invalid, props, invalidated_by FROM {table} WHERE user_id = ? AND id = ? AND kind = ? "
    "AND t_invalid IS NOT NULL AND t_invalid <= ?"
)
_REOPEN = (
    "UPDATE {table} SET props = ?, t_invalid = NULL, t_expired = NULL, invalidated_by = NULL "
    "WHERE user_id = ? AND id = ?"
)


def _reopen(conn: apsw.Connection, table: str, kind: str, user: str, item_id: str, restated: datetime) -> None:
    row = conn.execute(_ENDED.format(table=table), (user, item_id, kind, dt_to_text(restated))).fetchone()
    if row is None:
        return
    ended = text_to_dt(str(row[0]))
    assert ended is not None
    props = reopened(json.loads(row[1]), ended, restated, row[2])
    conn.execute(_REOPEN.format(table=table), (props_to_text(props), user, item_id))


def _index(conn: apsw.Connection, user: str, vectors: Sequence[VectorItem], dim: int) -> None:
    """Index texts not indexed yet: their row, vector and FTS5 terms (one indexed before stays as it was)."""
    key = user_key(user)
    for item in vectors:
        conn.execute(
            "INSERT OR IGNORE INTO items (user_id, user_key, id, kind, text, sign) VALUES (?, ?, ?, ?, ?, ?)",
            (user, key, item.id, item.kind, item.text, sign_blob(item.vector)),
        )
        if not conn.changes():
            continue
        item_no = conn.last_insert_rowid()
        blob = vector_blob(item.vector, dim)
        conn.execute(
            "INSERT INTO vectors (rowid, user_id, kind, embedding) VALUES (?, ?, ?, ?)",
            (item_no, user, item.kind, blob),
        )
        conn.execute("INSERT INTO item_vectors (item_no, embedding) VALUES (?, ?)", (item_no, blob))
        conn.execute(
            "INSERT INTO fts (rowid, text, user_key, kind) VALUES (?, ?, ?, ?)", (item_no, item.text, key, item.kind)
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
    result = ApplyResult()
    restated = {v.id for v in change_set.restated_theses()}
    for update in change_set.props_updates:  # first: a reopening below adds its gap to these props
        conn.execute(_PUT_PROPS, (props_to_text(update.props), user, update.thesis_id))
    for vertex in change_set.vertices:
        conn.execute(_INSERT_VERTEX, vertex_row(vertex))
        if conn.changes():
            result.vertices_added += 1
            result.theses_added += vertex.kind is VertexKind.THESIS
        elif vertex.id in restated and vertex.t_valid is not None:
            _reopen(conn, "vertices", VertexKind.THESIS.value, user, vertex.id, vertex.t_valid)
    for edge in change_set.edges:
        conn.execute(_INSERT_EDGE, edge_row(edge))
        added = conn.changes()
        result.edges_added += added
        if not added and edge.kind is EdgeKind.RELATION and edge.t_invalid is None and edge.t_valid is not None:
            _reopen(conn, "edges", EdgeKind.RELATION.value, user, edge.id, edge.t_valid)
    for inv in change_set.invalidations:
        conn.execute(
            _INVALIDATE,
            (dt_to_text(inv.t_invalid), dt_to_text(inv.t_expired), inv.invalidated_by, user, inv.thesis_id),
        )
        result.theses_invalidated += conn.changes()
    for ended in change_set.edge_invalidations:
        conn.execute(
            _INVALIDATE_EDGE,
            (dt_to_text(ended.t_invalid), dt_to_text(ended.t_expired), ended.invalidated_by, user, ended.edge_id),
        )
    _index(conn, user, vectors, dim)
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


def put_value(conn: apsw.Connection, key: str, value: str, scope: CacheScope | None) -> None:
    with conn:  # one transaction: an entry is never without its sources
        conn.execute(
            "INSERT INTO cache.kv (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            (key, value),
        )
        if scope is not None:
            conn.executemany(
                "INSERT OR IGNORE INTO cache.kv_sources (key, user_id, event_id) VALUES (?, ?, ?)",
                [(key, scope.user_id, event_id) for event_id in scope.event_ids or ("",)],
            )


def forget_values(conn: apsw.Connection, user_id: str, event_ids: Sequence[str] | None) -> int:
    """Remove the user's cache entries built from ``event_ids`` or from no named event (all: ``None``)."""
    with conn:
        if event_ids is None:
            rows = conn.execute("SELECT DISTINCT key FROM cache.kv_sources WHERE user_id = ?", (user_id,))
        else:
            rows = conn.execute(
                "SELECT DISTINCT key FROM cache.kv_sources WHERE user_id = ? "
                f"AND (event_id = '' OR event_id IN {IN_LIST})",
                (user_id, json_list(event_ids)),
            )
        keys = [str(row[0]) for row in rows]
        conn.executemany("DELETE FROM cache.kv WHERE key = ?", [(key,) for key in keys])
        conn.executemany("DELETE FROM cache.kv_sources WHERE key = ?", [(key,) for key in keys])
    return len(keys)


def _unindex(conn: apsw.Connection, user_id: str, ids: Sequence[str]) -> None:
    """Drop indexed texts: their row, vector and FTS5 terms (an external-content FTS5 row is deleted by value)."""
    key = user_key(user_id)
    rows = conn.execute(
        f"SELECT item_no, text, kind FROM items WHERE user_id = ? AND id IN {IN_LIST}",
        (user_id, json_list(ids)),
    ).fetchall()
    if rows:
        note_deletion(conn, user_id)  # every process's in-memory copies of this user reload
    for item_no, text, kind in rows:
        conn.execute(
            "INSERT INTO fts (fts, rowid, text, user_key, kind) VALUES ('delete', ?, ?, ?, ?)",
            (item_no, text, key, kind),
        )
        conn.execute("DELETE FROM vectors WHERE rowid = ?", (item_no,))
        conn.execute("DELETE FROM item_vectors WHERE item_no = ?", (item_no,))
        conn.execute("DELETE FROM items WHERE item_no = ?", (item_no,))


def _erase_user(conn: apsw.Connection, erasure: Erasure, vectors: Sequence[VectorItem], dim: int) -> None:
    user = erasure.user_id
    items = [str(row[0]) for row in conn.execute("SELECT id FROM items WHERE user_id = ?", (user,))]
    _unindex(conn, user, items)
    conn.execute("DELETE FROM edges WHERE user_id = ?", (user,))
    conn.execute("DELETE FROM vertices WHERE user_id = ?", (user,))
    conn.execute("DELETE FROM pending_announcements WHERE user_id = ?", (user,))
    # every event the user sent stays known, as forgotten: a redelivery of one memorizes nothing
    conn.execute("UPDATE applied_events SET change_set_id = ? WHERE user_id = ?", (erasure.forget_id, user))


def _erase_items(conn: apsw.Connection, erasure: Erasure, vectors: Sequence[VectorItem], dim: int) -> None:
    user = erasure.user_id
    _unindex(conn, user, erasure.delete_vectors)
    _index(conn, user, vectors, dim)
    conn.executemany("DELETE FROM edges WHERE user_id = ? AND id = ?", [(user, i) for i in erasure.delete_edges])
    conn.executemany("DELETE FROM vertices WHERE user_id = ? AND id = ?", [(user, i) for i in erasure.delete_vertices])
    put = _INSERT_VERTEX.replace("INSERT OR IGNORE", "INSERT OR REPLACE")
    conn.executemany(put, [vertex_row(v) for v in erasure.put_vertices])
    conn.executemany(
        _INSERT_EDGE.replace("INSERT OR IGNORE", "INSERT OR REPLACE"), [edge_row(e) for e in erasure.put_edges]
    )
    conn.executemany(
        "INSERT OR REPLACE INTO applied_events (user_id, event_id, change_set_id) VALUES (?, ?, ?)",
        [(user, event_id, erasure.forget_id) for event_id in erasure.event_ids],
    )
    # a change set none of whose events is memorized any more has nothing left to announce
    conn.execute(
        "DELETE FROM pending_announcements WHERE user_id = ? AND change_set_id NOT IN "
        "(SELECT change_set_id FROM applied_events WHERE user_id = ?)",
        (user, user),
    )


#: how often a forget's checkpoint tries again while another process reads the file
_CHECKPOINT_TRIES = 20


def checkpoint(conn: apsw.Connection) -> bool:
    """Fold the WAL into the database file and truncate it, so the pages a forget rewrote (with secure_delete,
    zeroed in the file) leave no copy of the forgotten text in the WAL. A reader in another process can keep it
    from finishing: tried again briefly, then left to the next forget or checkpoint (logged)."""
    for attempt in range(_CHECKPOINT_TRIES):
        row = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        if row is None or not row[0]:  # (busy, WAL frames, frames checkpointed)
            return True
        time.sleep(0.05 * (attempt + 1))  # back off while the reader finishes (this runs on the writer thread)
    log.warning("sqlite_checkpoint_busy", tries=_CHECKPOINT_TRIES)
    return False


def erase(conn: apsw.Connection, erasure: Erasure, vectors: Sequence[VectorItem], dim: int) -> None:
    """Apply a forget in one IMMEDIATE transaction; a forget applied before changes nothing."""
    for item in vectors:
        if len(item.vector) != dim:
            raise ValueError(f"vector {item.id} has {len(item.vector)} dimensions, the store has {dim}")
    for vertex in erasure.put_vertices:
        if vertex.user_id != erasure.user_id:
            raise ValueError(f"vertex {vertex.id} belongs to {vertex.user_id!r}, the forget to {erasure.user_id!r}")
    for edge in erasure.put_edges:
        if edge.user_id != erasure.user_id:
            raise ValueError(f"edge {edge.id} belongs to {edge.user_id!r}, the forget to {erasure.user_id!r}")
    conn.execute("BEGIN IMMEDIATE")
    try:
        done = conn.execute(
            "SELECT 1 FROM forgets WHERE user_id = ? AND forget_id = ?", (erasure.user_id, erasure.forget_id)
        ).fetchone()
        if done is None:
            (_erase_user if erasure.whole_user else _erase_items)(conn, erasure, vectors, dim)
            conn.execute(
                "INSERT INTO forgets (user_id, forget_id, outcome) VALUES (?, ?, ?)",
                (erasure.user_id, erasure.forget_id, erasure.outcome),
            )
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    checkpoint(conn)
