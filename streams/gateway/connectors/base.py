"""The path every connector shares: verify -> map -> memory operations -> the gateway's durable produce.

A platform message has an identity that outlives its edits (``Post.key``: platform, workspace or chat, channel,
message). Each version of it is a chat-message event of its own id (the key, plus the edit's stamp for an edit), so
a retried delivery, a replayed webhook or the same message imported from an export and received live is the same
event, memorized once (memorize skips an event id it applied). An edit forgets the version memory holds and
memorizes the new text: memory then equals a run that only ever saw the edited message (no second copy, and no
"was true until the edit" for what was a typo). A deletion forgets the version memory holds. Which version that is
comes from ``VersionBook``, kept beside the gateway's outbox.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from prometheus_client import Counter

from schemas.events import ChatMessage, Event, Forget, ForgetScope, Query
from schemas.validation import MalformedJSON, parse_json
from services.ids import digest
from services.ingest.platforms import PlatformPost
from services.logging import get_logger
from streams.gateway import inputs

log = get_logger(__name__)

CONNECTOR_REQUESTS = Counter(
    "memstream_connector_requests_total",
    "Connector requests by platform and outcome (accepted, ignored, duplicate, or why refused)",
    ["platform", "outcome"],
)
CONNECTOR_OPERATIONS = Counter(
    "memstream_connector_operations_total", "Memory operations from connectors", ["platform", "operation"]
)

Produce = Callable[[str, Sequence[Event]], Awaitable[None]]


class Refused(Exception):
    """A request the connector will not take: ``status`` 400/401/403, ``reason`` the metric label."""

    def __init__(self, status: int, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.reason = reason


@dataclass(frozen=True)
class Post(PlatformPost):
    """One version of a platform message (``PlatformPost``: ``key`` names it across edits, ``version`` is "" as
    first sent, else the edit's stamp), for the memstream user ``user_id``."""

    user_id: str = ""

    @classmethod
    def of(cls, post: PlatformPost, user_id: str) -> Post:
        return cls(post.key, post.conversation_id, post.speaker, post.text, post.when, post.version, user_id)


@dataclass(frozen=True)
class Delete:
    key: str
    user_id: str


@dataclass(frozen=True)
class Question:
    """A message addressed to the bot: asked of its user's memory, answered back in ``channel`` / ``thread``."""

    key: str  # the platform message that asked: the query id follows from it, so a retry asks once
    user_id: str
    text: str
    when: datetime
    channel: str
    thread: str

    def query(self) -> Query:
        query_id = f"q_{digest('connector-question', self.key)}"
        return inputs.validate(
            Query,
            {"event_id": query_id, "user_id": self.user_id, "event_time": self.when, "question": self.text},
            "question",
        )


@dataclass
class Mapped:
    """What a request asks of memory; ``response``: the body the platform expects back (Slack's challenge)."""

    posts: list[Post] = field(default_factory=list)
    deletes: list[Delete] = field(default_factory=list)
    questions: list[Question] = field(default_factory=list)
    response: dict[str, Any] | None = None
    ignored: str | None = None  # why nothing was taken (a bot's message, a join notice, ...)
    delivery_id: str | None = None  # the platform's id of this delivery: its retries carry the same


class Connector(Protocol):
    platform: str

    def verify(self, headers: Mapping[str, str], body: bytes, now: float) -> None:
        """Raise ``Refused`` unless the request is signed as the platform documents, and fresh."""

    def map(self, payload: Any) -> Mapped:
        """The memory operations of a verified payload; ``Refused`` (403) for a workspace or chat no user has."""


def when(epoch: float | str) -> datetime:
    return datetime.fromtimestamp(float(epoch), tz=UTC)


#: ``(platform, place) -> user``: the mappings an admin keeps with the API keys (``PUT /v1/connector-places``)
Places = Callable[[str, str], str | None]


def no_places(_platform: str, _place: str) -> str | None:
    return None


def user_for(
    platform: str, place: str, mapping: Mapping[str, str], default: str | None, places: Places = no_places
) -> str:
    """The memstream user of a workspace or chat: its mapping (environment, then the key file's), else the
    connector's one user."""
    user = mapping.get(place) or places(platform, place) or default
    if user is None:
        raise Refused(
            403, "unmapped", f"{platform} {place!r} belongs to no memstream user (map it: docs/connectors.md)"
        )
    return user


class VersionBook:
    """Which event id holds each platform message in memory now (its latest version). SQLite beside the outbox;
    ids only, no text, so a forgotten message leaves nothing of itself here."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._conn: sqlite3.Connection | None = None
        self._lock = asyncio.Lock()

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("CREATE TABLE IF NOT EXISTS versions (key TEXT PRIMARY KEY, event_id TEXT NOT NULL)")
            self._conn = conn
        return self._conn

    async def _run(self, sql: str, *args: str) -> list[tuple[str, ...]]:
        async with self._lock:
            return await asyncio.to_thread(lambda: self._db().execute(sql, args).fetchall())

    async def current(self, keys: Sequence[str]) -> dict[str, str]:
        """The version memory holds of each of ``keys`` that has one, in one read."""
        rows = await self._run("SELECT key, event_id FROM versions WHERE key IN (SELECT value FROM json_each(?))",
                               json.dumps(list(keys)))  # fmt: skip
        return dict(rows)  # type: ignore[arg-type]

    async def set(self, key: str, event_id: str) -> None:
        await self._run("INSERT OR REPLACE INTO versions (key, event_id) VALUES (?, ?)", key, event_id)

    async def drop(self, key: str) -> None:
        await self._run("DELETE FROM versions WHERE key = ?", key)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class RecentIds:
    """The newest ``capacity`` delivery ids seen: a platform's retry of a delivery already taken is answered 200
    and not processed again (the event ids would make it harmless anyway; this saves the work)."""

    def __init__(self, capacity: int = 10_000) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, delivery_id: str) -> bool:
        return delivery_id in self._ids

    def add(self, delivery_id: str) -> None:
        self._ids[delivery_id] = None
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)


@dataclass
class Operations:
    """The events a mapped request becomes, per memory topic, in order."""

    events: list[Event] = field(default_factory=list)
    versions: dict[str, str | None] = field(default_factory=dict)  # key -> event id after (None: deleted)
    forgets: list[Forget] = field(default_factory=list)


def forget_of(event_id: str, user_id: str) -> Forget:
    """The tombstone of one message version; its id follows from the version, so a redelivered deletion or edit is
    the same forget."""
    return Forget(
        event_id=f"f_{digest('connector-forget', event_id)}",
        user_id=user_id,
        event_time=datetime.now(UTC),
        scope=ForgetScope.MESSAGE,
        target=event_id,
    )


async def operations(platform: str, mapped: Mapped, versions: VersionBook) -> Operations:
    ops = Operations()
    # what memory holds of every message the request touches, read once; the request's own changes then apply
    stored = await versions.current([p.key for p in mapped.posts] + [d.key for d in mapped.deletes])

    def held(key: str) -> str | None:
        return ops.versions[key] if key in ops.versions else stored.get(key)

    for post in mapped.posts:
        held_id = held(post.key)
        if held_id == post.event_id:
            continue  # this version is memorized already (a retry, or imported before)
        if held_id is not None:  # an edit: the version memory holds goes, the new one comes
            ops.forgets.append(forget_of(held_id, post.user_id))
            ops.events.append(ops.forgets[-1])
        message = inputs.validate(
            ChatMessage,
            {
                "event_id": post.event_id,
                "user_id": post.user_id,
                "event_time": post.when,
                "conversation_id": post.conversation_id,
                "speaker": post.speaker,
                "text": post.text,
                "platform": platform,
            },
            f"{platform} message",
        )
        ops.events.append(message)
        ops.versions[post.key] = post.event_id
    for deleted in mapped.deletes:
        held_id = held(deleted.key)
        # never seen here (sent before the connector was set up, or imported elsewhere): its first version
        target = held_id or deleted.key
        ops.forgets.append(forget_of(target, deleted.user_id))
        ops.events.append(ops.forgets[-1])
        ops.versions[deleted.key] = None
    return ops


async def publish(
    ops: Operations, produce: Produce, chat_topic: str, versions: VersionBook, sent: Callable[[Forget], object]
) -> None:
    """Produce the operations (durable in the outbox before the caller answers), then record the versions memory
    now holds: after, so a refused produce leaves the book as it was and the platform's retry goes through."""
    if not ops.events:
        return
    await produce(chat_topic, ops.events)
    for forget in ops.forgets:
        sent(forget)
    for key, event_id in ops.versions.items():
        await (versions.drop(key) if event_id is None else versions.set(key, event_id))


#: ``ask(platform, question)``: put the question to memory and answer it back where it was asked
Ask = Callable[[str, Question], Awaitable[bool]]
#: ``(platform, post) -> the post with its speaker's name``, where the platform's payload gave only an id
Names = Callable[[str, Post], Awaitable[Post]]


async def same_name(_platform: str, post: Post) -> Post:
    return post


def connector_router(
    connectors: Mapping[str, Connector],
    produce: Produce,
    chat_topic: str,
    versions: VersionBook,
    sent: Callable[[Forget], object],
    max_body_bytes: int,
    ask: Ask | None = None,
    names: Names = same_name,
) -> APIRouter:
    """``POST /v1/connectors/{path}`` for each configured connector; ``sent`` registers a forget for its status
    (``GET /v1/forget/{id}``); ``ask`` takes the questions to the bot (None: they are not answered). Routes of
    unconfigured platforms answer 404."""
    router = APIRouter()
    recent: dict[str, RecentIds] = {name: RecentIds() for name in connectors}

    async def receive(path: str, request: Request) -> Any:
        connector = connectors.get(path)
        if connector is None:
            return JSONResponse(status_code=404, content={"detail": f"the {path} connector is not configured"})
        platform = connector.platform
        body = await request.body()
        headers = {k.lower(): v for k, v in request.headers.items()}
        try:
            connector.verify(headers, body, time.time())
            mapped = connector.map(parse_json(body, max_body_bytes, f"the {platform} request"))
            mapped.posts = [await names(platform, post) for post in mapped.posts]
            repeated = mapped.delivery_id is not None and mapped.delivery_id in recent[path]
            ops = None if repeated else await operations(platform, mapped, versions)
        except Refused as exc:
            CONNECTOR_REQUESTS.labels(platform, exc.reason).inc()
            log.info("connector_refused", platform=platform, reason=exc.reason, detail=str(exc)[:200])
            return JSONResponse(status_code=exc.status, content={"detail": str(exc)})
        except (MalformedJSON, inputs.InvalidInput) as exc:
            CONNECTOR_REQUESTS.labels(platform, "malformed").inc()
            status = getattr(exc, "status", 400)
            return JSONResponse(status_code=400 if status == 422 else status, content={"detail": str(exc)})
        if ops is None:
            CONNECTOR_REQUESTS.labels(platform, "duplicate").inc()
            return mapped.response or {"ok": True, "duplicate": True}
        await publish(ops, produce, chat_topic, versions, sent)
        asked = 0
        for question in mapped.questions:
            asked += bool(ask is not None and await ask(platform, question))
        if mapped.questions and not asked:
            log.warning("connector_question_unanswered", platform=platform, why="no bot token to answer with")
        if mapped.delivery_id is not None:
            recent[path].add(mapped.delivery_id)
        messages = sum(isinstance(e, ChatMessage) for e in ops.events)
        CONNECTOR_OPERATIONS.labels(platform, "message").inc(messages)
        CONNECTOR_OPERATIONS.labels(platform, "forget").inc(len(ops.forgets))
        outcome = "accepted" if ops.events else "asked" if asked else "ignored" if not mapped.response else "answered"
        CONNECTOR_REQUESTS.labels(platform, outcome).inc()
        log.info("connector_request", platform=platform, outcome=outcome, messages=messages, forgets=len(ops.forgets))
        return mapped.response or {"ok": True, "messages": messages, "forgotten": len(ops.forgets), "asked": asked}

    def endpoint_of(path: str) -> Callable[[Request], Awaitable[Any]]:
        async def endpoint(request: Request) -> Any:
            return await receive(path, request)

        return endpoint

    for path in connectors:
        name = f"connector_{path.replace('/', '_')}"
        router.add_api_route(f"/v1/connectors/{path}", endpoint_of(path), methods=["POST"], name=name)
    return router
