"""Graph reads. Plain functions over one connection; every statement is scoped by ``user_id``."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import apsw

from services.domain import Announcement, EdgeKind, Stats, Triplet, Vertex, VertexKind

from .codec import (
    EDGE_COLUMNS,
    IN_LIST,
    N_EDGE_COLUMNS,
    N_VERTEX_COLUMNS,
    VERTEX_COLUMNS,
    json_list,
    row_edge,
    row_vertex,
)

T = TypeVar("T")

# an applied event recorded as forgotten (its change set id is the forget's, ``f_...``) is bookkeeping, not memory
MEMORIZED = "change_set_id NOT LIKE 'f\\_%' ESCAPE '\\'"
# theses newest first (world clock, then ingest clock); id makes ties deterministic
_THESIS_ORDER = "ORDER BY t_valid DESC NULLS LAST, t_created DESC NULLS LAST, id"


def _prefixed(columns: str, alias: str) -> str:
    return ", ".join(f"{alias}.{c.strip()}" for c in columns.split(","))


def get_vertices(conn: apsw.Connection, user_id: str, ids: Sequence[str]) -> dict[str, Vertex]:
    rows = conn.execute(
        f"SELECT {VERTEX_COLUMNS} FROM vertices WHERE user_id = ? AND id IN {IN_LIST}", (user_id, json_list(ids))
    )
    return {row[0]: row_vertex(row) for row in rows}


def find_objects(conn: apsw.Connection, user_id: str, normalized_names: Sequence[str]) -> dict[str, Vertex]:
    rows = conn.execute(
        # INDEXED BY: for ORDER BY id the planner preferred the primary key and read every object of the user
        # (a json_each list has no size it can see); by name it reads only the names asked for
        f"SELECT {VERTEX_COLUMNS} FROM vertices INDEXED BY vertices_by_name "
        f"WHERE user_id = ? AND kind = 'object' AND norm_name IN {IN_LIST} ORDER BY id",
        (user_id, json_list(normalized_names)),
    )
    found: dict[str, Vertex] = {}
    for row in rows:
        found.setdefault(row[4], row_vertex(row))
    return found


# the first ``limit_per_vertex`` edges of each frontier vertex, newest first (without a limit the window, which
# numbered every row to keep them all, is left out: the same rows in the same order)
_RANKED = """SELECT * FROM (
    SELECT *, row_number() OVER (PARTITION BY pos ORDER BY t_valid DESC NULLS LAST, id) AS rn FROM hits
) WHERE rn <= ?"""


def neighbors(
    conn: apsw.Connection,
    user_id: str,
    vertex_ids: Sequence[str],
    edge_kinds: Sequence[EdgeKind] | None,
    limit_per_vertex: int | None,
    far_kinds: Sequence[VertexKind] | None = None,
) -> list[Triplet]:
    frontier = list(dict.fromkeys(vertex_ids))
    if not frontier or (edge_kinds is not None and not edge_kinds) or (far_kinds is not None and not far_kinds):
        return []
    kinds = [EdgeKind(kind).value for kind in edge_kinds] if edge_kinds is not None else [k.value for k in EdgeKind]
    # the far end's kind is checked before the ranking, so the limit counts only the edges asked for
    far_out, far_in, far_params = "", "", list[Any]()
    if far_kinds is not None:
        far = f"SELECT 1 FROM vertices v WHERE v.user_id = e.user_id AND v.id = e.{{}} AND v.kind IN {IN_LIST}"
        far_out, far_in = f" AND EXISTS ({far.format('target')})", f" AND EXISTS ({far.format('source')})"
        far_params = [json_list([VertexKind(kind).value for kind in far_kinds])]
    # one statement for the whole frontier: outgoing and incoming edges (a self-loop only once), ranked per
    # frontier vertex so ``limit_per_vertex`` applies to each, then both ends joined in. CROSS JOIN keeps the
    # frontier the outer loop: the planner cannot size json_each and otherwise walked all the user's edges by
    # user_id alone for every frontier vertex (880 ms at 100k triplets, benchmarks/qa_scale.py)
    sql = f"""
        WITH frontier (vid, pos) AS (SELECT value, key FROM json_each(?)),
        hits AS (
            SELECT f.pos, e.* FROM frontier f CROSS JOIN edges e ON e.user_id = ? AND e.source = f.vid
            WHERE e.kind IN {IN_LIST}{far_out}
            UNION ALL
            SELECT f.pos, e.* FROM frontier f CROSS JOIN edges e ON e.user_id = ? AND e.target = f.vid
            WHERE e.kind IN {IN_LIST} AND e.source != e.target{far_in}
        ),
        ranked AS ({_RANKED if limit_per_vertex is not None else "SELECT * FROM hits"})
        SELECT {_prefixed(EDGE_COLUMNS, "r")}, {_prefixed(VERTEX_COLUMNS, "s")}, {_prefixed(VERTEX_COLUMNS, "t")}
        FROM ranked r
        JOIN vertices s ON s.user_id = r.user_id AND s.id = r.source
        JOIN vertices t ON t.user_id = r.user_id AND t.id = r.target
        ORDER BY r.pos, r.t_valid DESC NULLS LAST, r.id
    """
    params: tuple[Any, ...] = (
        json_list(frontier),
        *(user_id, json_list(kinds), *far_params),
        *(user_id, json_list(kinds), *far_params),
        *([] if limit_per_vertex is None else [limit_per_vertex]),
    )
    triplets: dict[str, Triplet] = {}
    # a frontier vertex is an end of each of its rows (an episode of every edge into it): decoded once per call,
    # which halved the vertices a flat retrieval decodes
    decoded: dict[str, Vertex] = {}

    def vertex(columns: Sequence[Any]) -> Vertex:
        found = decoded.get(columns[0])
        if found is None:
            found = decoded[columns[0]] = row_vertex(columns)
        return found

    start, end = N_EDGE_COLUMNS, N_EDGE_COLUMNS + N_VERTEX_COLUMNS
    for row in conn.execute(sql, params):
        if row[0] in triplets:
            continue  # an edge between two frontier vertices comes back once per end
        triplets[row[0]] = Triplet(start=vertex(row[start:end]), edge=row_edge(row[:start]), end=vertex(row[end:]))
    return list(triplets.values())


def get_triplets(conn: apsw.Connection, user_id: str, edge_ids: Sequence[str]) -> dict[str, Triplet]:
    sql = f"""
        SELECT {_prefixed(EDGE_COLUMNS, "e")}, {_prefixed(VERTEX_COLUMNS, "s")}, {_prefixed(VERTEX_COLUMNS, "t")}
        FROM edges e
        JOIN vertices s ON s.user_id = e.user_id AND s.id = e.source
        JOIN vertices t ON t.user_id = e.user_id AND t.id = e.target
        WHERE e.user_id = ? AND e.id IN {IN_LIST}
    """
    start, end = N_EDGE_COLUMNS, N_EDGE_COLUMNS + N_VERTEX_COLUMNS
    return {
        row[0]: Triplet(start=row_vertex(row[start:end]), edge=row_edge(row[:start]), end=row_vertex(row[end:]))
        for row in conn.execute(sql, (user_id, json_list(edge_ids)))
    }


def valid_theses(conn: apsw.Connection, user_id: str, about: Sequence[str] | None, limit: int) -> list[Vertex]:
    if about is None:
        rows = conn.execute(
            f"SELECT {VERTEX_COLUMNS} FROM vertices WHERE user_id = ? AND kind = 'thesis' AND t_invalid IS NULL "
            f"{_THESIS_ORDER} LIMIT ?",
            (user_id, limit),
        )
        return [row_vertex(row) for row in rows]
    if not about:
        return []
    objects = json_list(about)
    rows = conn.execute(
        f"""SELECT {VERTEX_COLUMNS} FROM vertices
            WHERE user_id = ? AND kind = 'thesis' AND t_invalid IS NULL AND id IN (
                SELECT target FROM edges WHERE user_id = ? AND source IN {IN_LIST}
                UNION SELECT source FROM edges WHERE user_id = ? AND target IN {IN_LIST})
            {_THESIS_ORDER} LIMIT ?""",
        (user_id, user_id, objects, user_id, objects, limit),
    )
    return [row_vertex(row) for row in rows]


def valid_theses_each(
    conn: apsw.Connection, user_id: str, objects: Sequence[str], limit: int
) -> dict[str, list[Vertex]]:
    """``valid_theses`` about each object, in one read transaction."""
    with conn:
        found = {o: valid_theses(conn, user_id, [o], limit) for o in dict.fromkeys(objects)}
    return found


def seen_events(conn: apsw.Connection, user_id: str, event_ids: Sequence[str]) -> set[str]:
    rows = conn.execute(
        f"SELECT event_id FROM applied_events WHERE user_id = ? AND event_id IN {IN_LIST}",
        (user_id, json_list(event_ids)),
    )
    return {row[0] for row in rows}


def stats(conn: apsw.Connection, user_id: str) -> Stats:
    vertices = dict.fromkeys((k.value for k in VertexKind), 0)
    vertices.update(conn.execute("SELECT kind, count(*) FROM vertices WHERE user_id = ? GROUP BY kind", (user_id,)))
    edges = dict.fromkeys((k.value for k in EdgeKind), 0)
    edges.update(conn.execute("SELECT kind, count(*) FROM edges WHERE user_id = ? GROUP BY kind", (user_id,)))
    valid, invalidated = conn.execute(
        "SELECT count(*) FILTER (WHERE t_invalid IS NULL), count(*) FILTER (WHERE t_invalid IS NOT NULL) "
        "FROM vertices WHERE user_id = ? AND kind = 'thesis'",
        (user_id,),
    ).fetchone() or (0, 0)
    (events,) = conn.execute(
        f"SELECT count(*) FROM applied_events WHERE user_id = ? AND {MEMORIZED}", (user_id,)
    ).fetchone() or (0,)
    return Stats(
        user_id=user_id,
        vertices=vertices,
        edges=edges,
        theses_valid=valid,
        theses_invalidated=invalidated,
        events=events,
    )


def pending_announcements(conn: apsw.Connection, user_id: str, event_ids: Sequence[str]) -> list[Announcement]:
    rows = conn.execute(
        "SELECT announcement FROM pending_announcements WHERE user_id = ? AND change_set_id IN "
        f"(SELECT change_set_id FROM applied_events WHERE user_id = ? AND event_id IN {IN_LIST}) ORDER BY rowid",
        (user_id, user_id, json_list(event_ids)),
    )
    return [Announcement.model_validate_json(str(row[0])) for row in rows]


def episodes(conn: apsw.Connection, user_id: str, match: Mapping[str, str] | None) -> list[Vertex]:
    sql = f"SELECT {VERTEX_COLUMNS} FROM vertices WHERE user_id = ? AND kind = 'episodic'"
    params: list[Any] = [user_id]
    for key, value in sorted((match or {}).items()):
        sql += " AND json_extract(props, ?) = ?"
        params += [f'$."{key}"', value]
    return [row_vertex(row) for row in conn.execute(sql + " ORDER BY id", params)]


def invalidated_by(conn: apsw.Connection, user_id: str, thesis_ids: Sequence[str]) -> list[Vertex]:
    rows = conn.execute(
        f"SELECT {VERTEX_COLUMNS} FROM vertices WHERE user_id = ? AND kind = 'thesis' "
        f"AND invalidated_by IN {IN_LIST} ORDER BY id",
        (user_id, json_list(thesis_ids)),
    )
    return [row_vertex(row) for row in rows]


def forget_outcome(conn: apsw.Connection, user_id: str, forget_id: str) -> str | None:
    row = conn.execute("SELECT outcome FROM forgets WHERE user_id = ? AND forget_id = ?", (user_id, forget_id))
    found = row.fetchone()
    return None if found is None else str(found[0])


def get_value(conn: apsw.Connection, key: str) -> str | None:
    row = conn.execute("SELECT value FROM cache.kv WHERE key = ?", (key,)).fetchone()
    return None if row is None else str(row[0])


# every table, ordered by a unique key, so two dumps compare equal iff the stored content is equal
_DUMPS: dict[str, tuple[str, str | None]] = {
    "vertices": (f"SELECT {VERTEX_COLUMNS} FROM vertices {{where}} ORDER BY user_id, id", "user_id"),
    "edges": (f"SELECT {EDGE_COLUMNS} FROM edges {{where}} ORDER BY user_id, id", "user_id"),
    "applied_events": ("SELECT * FROM applied_events {where} ORDER BY user_id, event_id", "user_id"),
    "items": ("SELECT item_no, user_id, user_key, id, kind, text FROM items {where} ORDER BY user_id, id", "user_id"),
    "vectors": (
        "SELECT i.user_id, i.id, v.kind, v.embedding FROM items i JOIN vectors v ON v.rowid = i.item_no "
        "{where} ORDER BY i.user_id, i.id",
        "i.user_id",
    ),
    "fts_terms": (
        "SELECT t.term, t.doc, t.col, t.offset FROM fts_terms t JOIN items i ON i.item_no = t.doc "
        "{where} ORDER BY t.term, t.doc, t.col, t.offset",
        "i.user_id",
    ),
    "kv": ("SELECT key, value FROM cache.kv ORDER BY key", None),
    "kv_sources": (
        "SELECT key, user_id, event_id FROM cache.kv_sources {where} ORDER BY key, user_id, event_id",
        "user_id",
    ),
    "forgets": ("SELECT user_id, forget_id, outcome FROM forgets {where} ORDER BY user_id, forget_id", "user_id"),
}


def dump(conn: apsw.Connection, user_id: str | None) -> dict[str, list[tuple[Any, ...]]]:
    out: dict[str, list[tuple[Any, ...]]] = {}
    for table, (sql, user_column) in _DUMPS.items():
        if user_id is None:
            out[table] = [tuple(row) for row in conn.execute(sql.format(where=""))]
        elif user_column is not None:
            rows = conn.execute(sql.format(where=f"WHERE {user_column} = ?"), (user_id,))
            out[table] = [tuple(row) for row in rows]
    return out


# a user's memory without the ingest-time clocks (t_created, t_expired) and the bookkeeping of how events were grouped
# into change sets: two runs over the same events have equal content whatever crashed and however batches fell
_CONTENT = {
    "vertices": "SELECT id, kind, name, norm_name, props, t_valid, t_invalid, invalidated_by, episode_label, "
    "temporal_label FROM vertices WHERE user_id = ? ORDER BY id",
    "edges": "SELECT id, user_id, kind, source, target, relation, props, t_valid, t_invalid, invalidated_by "
    "FROM edges WHERE user_id = ? ORDER BY id",
    "events": f"SELECT event_id FROM applied_events WHERE user_id = ? AND {MEMORIZED} ORDER BY event_id",
    "items": "SELECT id, kind, text FROM items WHERE user_id = ? ORDER BY id",
}


def content(conn: apsw.Connection, user_id: str) -> dict[str, list[tuple[Any, ...]]]:
    return {name: [tuple(row) for row in conn.execute(sql, (user_id,))] for name, sql in _CONTENT.items()}


def users(conn: apsw.Connection) -> list[str]:
    return [
        str(row[0])
        for row in conn.execute(f"SELECT DISTINCT user_id FROM applied_events WHERE {MEMORIZED} ORDER BY user_id")
    ]


def pending_count(conn: apsw.Connection) -> int:
    (count,) = conn.execute("SELECT count(*) FROM pending_announcements")
    return int(count[0])


def in_snapshot(fn: Callable[..., T]) -> Callable[..., T]:
    """Run a multi-statement read inside one read transaction, so it sees one consistent snapshot."""

    def wrapper(conn: apsw.Connection, *args: Any) -> T:
        conn.execute("BEGIN")
        try:
            return fn(conn, *args)
        finally:
            conn.execute("COMMIT")

    return wrapper
