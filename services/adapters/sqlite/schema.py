"""Connection setup and schema. One file holds graph, vectors, lexical index and applied events; the KV (LLM)
cache has a file of its own beside it (``cache_path``), attached to every connection as ``cache``."""

from __future__ import annotations

from pathlib import Path

import apsw
import sqlite_vec

from services import ids
from services.domain import Vertex
from services.logging import get_logger

from . import signs
from .codec import EDGE_COLUMNS, FTS_TOKENIZER, VERTEX_COLUMNS, dt_to_text, props_to_text, row_edge, row_vertex

log = get_logger(__name__)

SCHEMA_VERSION = "1"
BUSY_TIMEOUT_MS = 10_000
# vec0 pre-allocates one chunk per partition (user): chunk_size * dim * 4 bytes. 256 keeps a small user at
# ~384 KiB for dim 384 while a 5,000-vector scan stays as fast as with the default 1024.
VEC_CHUNK_SIZE = 256
MMAP_BYTES = 4 << 30  # SQLite caps it at its compile-time SQLITE_MAX_MMAP_SIZE
CACHE = "cache"  # the schema name of the attached cache file


def cache_path(path: Path) -> Path:
    """The KV cache's file beside the memory file (``memory.sqlite3`` -> ``memory.cache.sqlite3``).

    Why apart: a connection's first read after another connection committed to a file it reads drops its page
    cache and remaps the file (6-13 ms on a 2 GB memory, then the pages fault in again), and every question
    writes the cache. In one file, every question reset every reader of the memory; apart, only memorize does."""
    return path.with_suffix(".cache" + path.suffix)


def connect(path: Path) -> apsw.Connection:
    conn = apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READWRITE | apsw.SQLITE_OPEN_CREATE)
    # several processes share the file: wait for a lock instead of failing at once
    conn.set_busy_timeout(BUSY_TIMEOUT_MS)
    conn.enable_load_extension(True)
    conn.load_extension(sqlite_vec.loadable_path())
    conn.enable_load_extension(False)
    conn.execute("PRAGMA journal_mode=WAL").fetchall()
    # WAL + NORMAL never corrupts; a power cut may lose the last commits, which the event replay restores
    conn.execute("PRAGMA synchronous=NORMAL")
    # what a forget deletes is overwritten on disk, not left readable in free pages
    conn.execute("PRAGMA secure_delete=ON")
    # reads through a memory map: a big user's search makes ~1,000 point reads in a file of a GB or more, which
    # cost about twice as much through read() calls (writes still go through the WAL as before)
    conn.execute(f"PRAGMA mmap_size={MMAP_BYTES}").fetchall()
    conn.execute(f"ATTACH DATABASE ? AS {CACHE}", (str(cache_path(Path(path))),))
    conn.execute(f"PRAGMA {CACHE}.journal_mode=WAL").fetchall()
    conn.execute(f"PRAGMA {CACHE}.synchronous=NORMAL")
    conn.execute(f"PRAGMA {CACHE}.secure_delete=ON")
    return conn


def _ddl(dim: int) -> list[str]:
    return [
        "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
        """CREATE TABLE IF NOT EXISTS vertices (
            id TEXT NOT NULL, user_id TEXT NOT NULL, kind TEXT NOT NULL, name TEXT NOT NULL, norm_name TEXT,
            props TEXT NOT NULL, t_created TEXT, t_valid TEXT, t_expired TEXT, t_invalid TEXT, invalidated_by TEXT,
            episode_label TEXT, temporal_label TEXT,
            PRIMARY KEY (user_id, id))""",
        "CREATE INDEX IF NOT EXISTS vertices_by_name ON vertices (user_id, kind, norm_name)",
        """CREATE TABLE IF NOT EXISTS edges (
            id TEXT NOT NULL, user_id TEXT NOT NULL, kind TEXT NOT NULL, source TEXT NOT NULL, target TEXT NOT NULL,
            relation TEXT NOT NULL, props TEXT NOT NULL, t_valid TEXT, t_expired TEXT, t_invalid TEXT,
            invalidated_by TEXT,
            PRIMARY KEY (user_id, id))""",
        "CREATE INDEX IF NOT EXISTS edges_by_source ON edges (user_id, source)",
        "CREATE INDEX IF NOT EXISTS edges_by_target ON edges (user_id, target)",
        """CREATE TABLE IF NOT EXISTS applied_events (
            user_id TEXT NOT NULL, event_id TEXT NOT NULL, change_set_id TEXT NOT NULL,
            PRIMARY KEY (user_id, event_id))""",
        # a change set's memory update (Announcement JSON), written with its applied events, until it was published
        """CREATE TABLE IF NOT EXISTS pending_announcements (
            user_id TEXT NOT NULL, change_set_id TEXT NOT NULL, announcement TEXT NOT NULL,
            PRIMARY KEY (user_id, change_set_id))""",
        # one row per indexed text; its item_no is the rowid in both the vec0 and the FTS5 table. user_key is
        # the user id as one opaque token, so FTS5 narrows a MATCH to one user inside the index
        """CREATE TABLE IF NOT EXISTS items (
            item_no INTEGER PRIMARY KEY, user_id TEXT NOT NULL, user_key TEXT NOT NULL, id TEXT NOT NULL,
            kind TEXT NOT NULL, text TEXT NOT NULL, sign BLOB, UNIQUE (user_id, id))""",
        # each indexed text's vector again, by item number: a big user's dense search re-ranks its sign-bit
        # candidates from here (``signs``), a point read each, where vec0 reads the candidate's whole chunk
        """CREATE TABLE IF NOT EXISTS item_vectors (item_no INTEGER PRIMARY KEY, embedding BLOB NOT NULL)""",
        f"""CREATE VIRTUAL TABLE IF NOT EXISTS vectors USING vec0(
            user_id TEXT PARTITION KEY, kind TEXT, embedding FLOAT[{dim}] distance_metric=cosine,
            chunk_size={VEC_CHUNK_SIZE})""",
        f"""CREATE VIRTUAL TABLE IF NOT EXISTS fts USING fts5(
            text, user_key, kind, content='items', content_rowid='item_no',
            tokenize='{FTS_TOKENIZER}')""",
        # a deleted row's terms leave the index at once, not at the next merge: a forgotten message's words stay
        # nowhere in the file (SQLite >= 3.42; kept in the table's config)
        "INSERT INTO fts (fts, rank) VALUES ('secure-delete', 1)",
        # read-only view of the inverted index, so tests can check that a replay indexed nothing twice
        "CREATE VIRTUAL TABLE IF NOT EXISTS fts_terms USING fts5vocab(fts, 'instance')",
        f"CREATE TABLE IF NOT EXISTS {CACHE}.kv (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
        # whose text a cached entry was built from (event_id '' for an entry built from the user's memory at
        # large): forgetting removes the entries of the forgotten events and the user's untagged ones
        f"""CREATE TABLE IF NOT EXISTS {CACHE}.kv_sources (
            key TEXT NOT NULL, user_id TEXT NOT NULL, event_id TEXT NOT NULL, PRIMARY KEY (key, user_id, event_id))""",
        f"CREATE INDEX IF NOT EXISTS {CACHE}.kv_sources_by_user ON kv_sources (user_id, event_id)",
        # applied forgets and what each announced (MemoryForgotten JSON), so a replayed tombstone says it again
        """CREATE TABLE IF NOT EXISTS forgets (
            user_id TEXT NOT NULL, forget_id TEXT NOT NULL, outcome TEXT NOT NULL, PRIMARY KEY (user_id, forget_id))""",
    ]


#: columns added since schema "1" was first written: (table, column, type); added to an older file on open
_ADDED_COLUMNS = (
    ("edges", "t_expired", "TEXT"),
    ("edges", "t_invalid", "TEXT"),
    ("edges", "invalidated_by", "TEXT"),
    ("items", "sign", "BLOB"),  # the vector's sign bits (``signs``): a big user's dense search scans these
)


def _migrate(conn: apsw.Connection) -> None:
    """Bring a file written by older code up to date (idempotent: a column already there is left alone)."""
    for table, column, kind in _ADDED_COLUMNS:
        present = {str(row[1]) for row in conn.execute(f"PRAGMA table_info({table})")}
        if column not in present:
            conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
    _move_cache(conn)


def _move_cache(conn: apsw.Connection) -> None:
    """A file from before the cache had its own: its entries move over and its tables go (dropped with secure
    delete, so nothing a forget should reach stays behind). The two files do not commit as one, so a crash in
    between leaves both copies, and the next open moves again (``OR IGNORE``)."""
    old = {str(r[0]) for r in conn.execute("SELECT name FROM main.sqlite_master WHERE name IN ('kv', 'kv_sources')")}
    if "kv" in old:
        conn.execute(f"INSERT OR IGNORE INTO {CACHE}.kv (key, value) SELECT key, value FROM main.kv")
        conn.execute("DROP TABLE main.kv")
    if "kv_sources" in old:
        conn.execute(
            f"INSERT OR IGNORE INTO {CACHE}.kv_sources (key, user_id, event_id) "
            "SELECT key, user_id, event_id FROM main.kv_sources"
        )
        conn.execute("DROP TABLE main.kv_sources")
    if old:
        log.info("sqlite_cache_moved", tables=sorted(old))


#: meta key recording that every indexed text has its sign bits (``signs.backfill``)
SIGNS_STORED = "sign_bits_and_vector_copies"
#: meta key recording that relation edges took their validity from their staters (``_derive_edge_validity``)
EDGE_VALIDITY_DERIVED = "edge_validity_derived"


def _derive_edge_validity(conn: apsw.Connection, stored: dict[str, str]) -> None:
    """Once per file: relation edges written before they carried validity (all valid) take it from the theses
    that state them, as memorize gives it now; recorded in ``meta``, so it never runs again."""
    if stored.get(EDGE_VALIDITY_DERIVED):
        return
    staters: dict[tuple[str, str], list[Vertex]] = {}
    for row in conn.execute(f"SELECT {VERTEX_COLUMNS} FROM vertices WHERE kind = 'thesis'"):
        thesis = row_vertex(row)
        edge_id = ids.stated_relation(thesis.user_id, thesis.props)
        if edge_id is not None:
            staters.setdefault((thesis.user_id, edge_id), []).append(thesis)
    rows = conn.execute(f"SELECT {EDGE_COLUMNS} FROM edges WHERE kind = 'relation' AND t_invalid IS NULL").fetchall()
    derived = 0
    for row in rows:
        edge = row_edge(row)
        by = staters.get((edge.user_id, edge.id))
        mended = edge if not by else edge.stated_by(by)
        if mended != edge:
            conn.execute(
                "UPDATE edges SET props = ?, t_invalid = ?, t_expired = ?, invalidated_by = ? "
                "WHERE user_id = ? AND id = ?",
                (
                    props_to_text(mended.props),
                    dt_to_text(mended.t_invalid),
                    dt_to_text(mended.t_expired),
                    mended.invalidated_by,
                    edge.user_id,
                    edge.id,
                ),
            )
            derived += 1
    conn.execute("INSERT INTO meta (key, value) VALUES (?, '1')", (EDGE_VALIDITY_DERIVED,))
    if derived:
        log.info("sqlite_edge_validity_derived", edges=derived)


class StoreDimensionError(ValueError):
    """The store's vectors have another size than the embedder's: they came from another embedder."""


def create_schema(conn: apsw.Connection, dim: int) -> None:
    """Idempotent; safe when several processes open a fresh file at once (one IMMEDIATE transaction)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        for statement in _ddl(dim):
            conn.execute(statement)
        _migrate(conn)
        stored = {str(key): str(value) for key, value in conn.execute("SELECT key, value FROM meta")}
        if not stored:
            conn.executemany(
                "INSERT INTO meta (key, value) VALUES (?, ?)",
                [("schema_version", SCHEMA_VERSION), ("dim", str(dim))],
            )
        elif stored.get("dim") != str(dim):
            raise StoreDimensionError(f"store was created with dim={stored.get('dim')}, opened with dim={dim}")
        elif stored.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"store schema {stored.get('schema_version')}, this code knows {SCHEMA_VERSION}")
        _derive_edge_validity(conn, stored)
        if not stored.get(SIGNS_STORED):
            # once per file: texts indexed by older code get their sign bits and a copy of their vector; new code
            # writes both with the text
            filled = signs.backfill(conn)
            conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, '1')", (SIGNS_STORED,))
            if filled:
                log.info("sqlite_sign_bits_backfilled", items=filled)
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
