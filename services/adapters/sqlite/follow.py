"""An in-memory copy of each big user's indexed texts, kept in step with the file, for the searches that a scan in
SQLite makes too slow at that size (``signs``: dense, ``terms``: lexical).

A user with fewer than ``min_items`` texts gets no copy (its searches stay in SQLite). The copy follows the file:
after any commit by another connection (``PRAGMA data_version``) the texts indexed since are appended; a deletion
(forget) bumps that user's counter in ``meta`` (``items_deleted:`` and the user's key) and only that user's copy is
read again, so forgetting one user's message costs no other big user a reload.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import apsw

from .codec import IN_LIST, json_list, user_key

#: below this many indexed texts a user's searches stay in SQLite (they are fast enough there)
MIN_ITEMS = 20_000
DELETED_KEY = "items_deleted:"  # + the user's key: a counter per user
ANY_DELETED_KEY = DELETED_KEY + "any"  # every user's deletions (a user's key is "u" + a digest, never "any")

P = TypeVar("P")


def item_ids(
    conn: apsw.Connection, user_id: str, kinds: Sequence[str], item_nos: Sequence[int], first: int | None = None
) -> dict[int, str]:
    """A copy's item numbers read back as ids: those that are this user's texts of these kinds (empty: any kind),
    checked again in the file; ``first``: only the first so many by id."""
    where = f" AND i.kind IN {IN_LIST}" if kinds else ""
    sql = f"""SELECT i.item_no, i.id FROM json_each(?) c CROSS JOIN items i ON i.item_no = c.value
              WHERE i.user_id = ?{where}"""
    params: list[Any] = [json.dumps(list(item_nos)), user_id]
    if kinds:
        params.append(json_list(kinds))
    if first is not None:
        sql += " ORDER BY i.id LIMIT ?"
        params.append(first)
    return {int(row[0]): str(row[1]) for row in conn.execute(sql, params)}


@dataclass
class _User(Generic[P]):
    count: int
    max_item_no: int
    deleted: str  # the user's deletion counter when the copy was read
    deleted_any: str  # every user's deletion counter then: while it stands, no item number was freed and reused
    seen: int  # every row up to this item number was looked at (this user's or not)
    copy: P | None = None  # None: too small, searched in SQLite
    synced: dict[int, int] = field(default_factory=dict)  # connection id -> its data_version when last synced


class ItemFollower(Generic[P]):
    """The in-memory copies (``P``) of the big users of one store, shared by its reader threads. A subclass names
    the ``items`` columns it reads after ``item_no`` and ``kind``, and builds and extends its copy from those rows."""

    columns = ""  # ", col, ..." of ``items`` after item_no and kind

    def __init__(self, min_items: int = MIN_ITEMS) -> None:
        self.min_items = min_items
        self._users: dict[str, _User[P]] = {}
        self._lock = threading.Lock()

    def copy_of(self, conn: apsw.Connection, user_id: str) -> P | None:
        """The user's copy as of ``conn``'s snapshot (call it with the read transaction open), or None when the user
        is too small to have one. A copy is never changed once returned (``_add`` makes a new one), so it is read
        without the lock."""
        with self._lock:
            return self._sync(conn, user_id).copy

    def _empty(self) -> P:
        raise NotImplementedError

    def _add(self, copy: P, rows: Sequence[Any]) -> P:
        """A new copy: ``copy`` with ``rows`` (item_no, kind, then ``columns``; in item_no order) appended."""
        raise NotImplementedError

    def _sync(self, conn: apsw.Connection, user_id: str) -> _User[P]:
        row: Any = conn.execute("PRAGMA data_version").fetchone()
        version = int(row[0])
        user = self._users.get(user_id)
        if user is not None and user.synced.get(id(conn)) == version:
            return user  # nothing committed by another connection since this one last looked
        deleted, deleted_any = _deleted(conn, _deleted_key(user_id)), _deleted(conn, ANY_DELETED_KEY)
        if user is None or user.deleted != deleted:
            user = self._load(conn, user_id, deleted, deleted_any)
        else:
            self._append(conn, user_id, user, deleted_any)
        user.synced[id(conn)] = version
        self._users[user_id] = user
        return user

    def _load(self, conn: apsw.Connection, user_id: str, deleted: str, deleted_any: str) -> _User[P]:
        found: Any = conn.execute(
            "SELECT count(*), coalesce(max(item_no), 0) FROM items WHERE user_id = ?", (user_id,)
        ).fetchone()
        count, top = int(found[0]), int(found[1])
        user: _User[P] = _User(count, top, deleted, deleted_any, seen=top)
        if user.count >= self.min_items:
            rows: list[Any] = conn.execute(
                f"SELECT item_no, kind{self.columns} FROM items WHERE user_id = ? AND item_no <= ? ORDER BY item_no",
                (user_id, user.max_item_no),
            ).fetchall()
            user.copy = self._add(self._empty(), rows)
        return user

    def _append(self, conn: apsw.Connection, user_id: str, user: _User[P], deleted_any: str) -> None:
        """Append the user's rows written since the last look. They are past ``seen`` unless some user's rows were
        deleted since (a freed item number is given again), and then past the user's own last row. Read by rowid
        when fewer rows follow that point than the user has, else on the user's index: left to itself SQLite took
        the index, which read all of a big user's rows after every commit (6 ms at 100k triplets)."""
        start = user.seen if deleted_any == user.deleted_any else user.max_item_no
        found: Any = conn.execute("SELECT max(item_no) FROM items").fetchone()
        top = int(found[0] or 0)
        by_rowid = top - start <= user.count
        rows: list[Any] = conn.execute(
            f"SELECT item_no, kind{self.columns} FROM items WHERE item_no > ? AND {'+' if by_rowid else ''}user_id = ? "
            "ORDER BY item_no",
            (start, user_id),
        ).fetchall()
        user.deleted_any = deleted_any
        user.seen = max(top, int(rows[-1][0]) if rows else 0)
        if not rows:
            return
        user.count += len(rows)
        user.max_item_no = int(rows[-1][0])
        if user.copy is not None:
            user.copy = self._add(user.copy, rows)
        elif user.count >= self.min_items:
            fresh = self._load(conn, user_id, user.deleted, deleted_any)
            user.copy, user.count, user.max_item_no = fresh.copy, fresh.count, fresh.max_item_no


def _deleted_key(user_id: str) -> str:
    return DELETED_KEY + user_key(user_id)  # a digest: meta holds no user id in the clear


def _deleted(conn: apsw.Connection, key: str) -> str:
    row: Any = conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
    return "0" if row is None else str(row[0])


def note_deletion(conn: apsw.Connection, user_id: str) -> None:
    """Called in the transaction that deletes a user's indexed texts: every process reloads that user's copies.
    Other users' copies stay valid: a reused item number is above every number still in use, so it reaches them
    as an appended text, never in place of one they hold (the counter of every user's deletions tells them to
    look past their own last row, not past the last row they saw)."""
    for key in (_deleted_key(user_id), ANY_DELETED_KEY):
        conn.execute(
            "INSERT INTO meta (key, value) VALUES (?, '1') "
            "ON CONFLICT (key) DO UPDATE SET value = CAST(CAST(value AS INTEGER) + 1 AS TEXT)",
            (key,),
        )
