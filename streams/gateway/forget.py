"""Forgetting at the gateway: the ``/v1/forget`` routes, and the purge of every copy the gateway holds.

``POST /v1/forget`` turns ``{"user_id", "scope", "target"}`` into a ``Forget`` tombstone with a forget id made
here, and produces it like any memory event (outbox first, in order with the user's earlier events) onto the
topic of what it forgets: chat for a message or a conversation, documents for a document, both for a user. The
workers erase memory in that order and announce each erasure as a ``MemoryForgotten`` on the memory-updates topic.

``MemoryUpdatesFeed`` reads those, and the ``Purger`` drops what the gateway itself keeps of the forgotten memory:
answers (and their traces) that cite a removed vertex or edge, dead letters of the forgotten events (a replay would
bring their text back), and the outbox rows of those events. All of the user's, for a user forget. ``Forgets`` is
the one record of forgets: it answers ``GET /v1/forget/{id}`` (pending until a ``MemoryForgotten`` came back from
every topic the tombstone went to) and keeps every erasure, so that records read *after* it (a restarted gateway
reads the answers and dead-letter topics from their beginning again) are refused on arrival too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from aiokafka import ConsumerRecord
from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import JSONResponse
from prometheus_client import Counter
from pydantic import BaseModel, Field

from schemas.events import Answer, DeadLetter, Event, Forget, ForgetScope, MemoryForgotten
from services.logging import get_logger
from services.observability.traces import Trace, TraceStore
from services.settings import Settings
from streams.background import Fetch, TopicFeed
from streams.codec import InvalidEvent, decode
from streams.gateway import inputs
from streams.gateway.answers import AnswerBook
from streams.gateway.auth import Action, Principal, Writer, scoped_parse
from streams.gateway.dead_letters import DeadLetterBook, DeadLetterFeed
from streams.gateway.ratelimit import RateLimiter
from streams.outbox import Outbox
from streams.topics import TopicNames

log = get_logger(__name__)

FORGETS_ACCEPTED = Counter("memstream_forgets_accepted_total", "Forgets accepted by the gateway", ["scope"])
FORGETS_COMPLETED = Counter(
    "memstream_forgets_completed_total", "Forgets the store applied on every topic they were sent on", ["scope"]
)
FORGET_PURGED = Counter(
    "memstream_gateway_forget_purged_total", "Copies the gateway dropped because their memory was forgotten", ["what"]
)

Produce = Callable[[str, Sequence[Event]], Awaitable[None]]


def forget_topics(scope: ForgetScope, topics: TopicNames) -> list[str]:
    """The topics a tombstone goes to: those of what it forgets."""
    if scope is ForgetScope.USER:
        return [topics.chat, topics.documents]
    return [topics.documents] if scope is ForgetScope.DOCUMENT else [topics.chat]


def outbox_event_id(topic: str, event: Event) -> str:
    """The outbox row id of ``event`` on ``topic``: a user's tombstone goes to two topics with one forget id, and
    the outbox keeps one row per (user, id); each row goes once the erasure on its topic is announced."""
    return f"{event.event_id}@{topic}" if isinstance(event, Forget) else event.event_id


def _payload(raw: str | bytes) -> dict[str, Any]:
    try:
        item = json.loads(raw)
    except ValueError:
        return {}
    return item if isinstance(item, dict) else {}


def selects(scope: ForgetScope, target: str | None, event_id: str, payload: dict[str, Any]) -> bool:
    """Whether a forget of ``scope``/``target`` covers the event ``event_id`` with this (decoded) payload."""
    kind = payload.get("kind")
    if scope is ForgetScope.USER:
        return True
    if scope is ForgetScope.MESSAGE:
        return event_id == target
    if scope is ForgetScope.DOCUMENT:
        return kind == "document" and payload.get("document_id", event_id) == target
    return kind == "chat_message" and payload.get("conversation_id", "default") == target


def cited_ids(content: object) -> set[str]:
    """The memory ids (vertices, edges) an answer, a trace or a stage detail cites as evidence."""
    if isinstance(content, Answer):
        return {e.id for e in content.evidence}
    if isinstance(content, Trace):
        found = {e.id for e in content.final_evidence}
        for run in content.timeline:
            found |= cited_ids(run.detail)
        return found | (cited_ids(content.answer) if content.answer is not None else set())
    if isinstance(content, dict):
        items = content.get("evidence")
        if isinstance(items, list):
            return {str(i.get("id")) if isinstance(i, dict) else str(i) for i in items}
    return set()


@dataclass(frozen=True)
class Erasure:
    """One ``MemoryForgotten``: what a forget erased on one topic, and when."""

    announced: MemoryForgotten
    removed_all: bool
    removed_ids: frozenset[str]
    source_event_ids: frozenset[str]

    @classmethod
    def of(cls, done: MemoryForgotten) -> Erasure:
        return cls(
            done,
            done.removed_all or done.scope is ForgetScope.USER,
            frozenset(done.removed_ids),
            frozenset(done.source_event_ids),
        )

    def covers(self, when: datetime, content: object) -> bool:
        """A copy made before the erasure from memory it erased (all of it, for a whole user)."""
        return when < self.announced.committed_at and (
            self.removed_all or not self.removed_ids.isdisjoint(cited_ids(content))
        )

    def covers_letter(self, letter: DeadLetter) -> bool:
        if letter.ingest_time >= self.announced.committed_at:
            return False
        if self.removed_all or not self.source_event_ids.isdisjoint(letter.failed_event_ids):
            return True
        payload = _payload(letter.payload)
        done = self.announced
        return any(selects(done.scope, done.target, e, payload) for e in letter.failed_event_ids or ["?"])


@dataclass
class ForgetEntry:
    """One forget: the topics its tombstone went to, and the erasure announced on each so far."""

    forget_id: str
    user_id: str
    scope: ForgetScope
    target: str | None
    topics: list[str]
    accepted_at: datetime | None = None
    done: dict[str, Erasure] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return all(t in self.done for t in self.topics)


class ForgetStatus(BaseModel):
    forget_id: str
    user_id: str
    scope: ForgetScope
    target: str | None
    status: str = Field(description="pending, or done once every topic's erasure was announced")
    topics: list[str]
    topics_done: list[str]
    accepted_at: datetime | None = Field(description="When this gateway accepted it (none: heard of on the topic).")
    committed_at: datetime | None = Field(description="When the last erasure committed.")
    removed_all: bool
    source_events: int = Field(description="Events whose memory was erased.")
    vertices_removed: int
    edges_removed: int
    theses_restored: int
    cache_entries_removed: int

    @classmethod
    def of(cls, entry: ForgetEntry) -> ForgetStatus:
        done = [e.announced for e in entry.done.values()]
        return cls(
            forget_id=entry.forget_id,
            user_id=entry.user_id,
            scope=entry.scope,
            target=entry.target,
            status="done" if entry.complete else "pending",
            topics=entry.topics,
            topics_done=[t for t in entry.topics if t in entry.done],
            accepted_at=entry.accepted_at,
            committed_at=max((d.committed_at for d in done), default=None),
            removed_all=any(d.removed_all for d in done),
            source_events=len({e for d in done for e in d.source_event_ids}),
            vertices_removed=sum(d.vertices_removed for d in done),
            edges_removed=sum(d.edges_removed for d in done),
            theses_restored=sum(d.theses_restored for d in done),
            cache_entries_removed=sum(d.cache_entries_removed for d in done),
        )


class Forgets:
    """The one view of forgets at the gateway: forget id -> ``ForgetEntry`` for those it sent and those it heard
    announced (at most ``capacity``, the oldest go first), indexed by user; and the queries whose answer or trace
    went with an erasure. It answers ``GET /v1/forget/{id}``, and its ``forgets_*`` tell the books what to refuse,
    so that a copy read *after* its erasure (a restarted gateway reads answers and dead letters again) is refused."""

    def __init__(self, topics: TopicNames, capacity: int = 100_000, queries_capacity: int = 100_000) -> None:
        self.topics = topics
        self.capacity = capacity
        self.queries_capacity = queries_capacity
        self._entries: OrderedDict[str, ForgetEntry] = OrderedDict()
        self._by_user: dict[str, dict[str, ForgetEntry]] = {}
        self._queries: OrderedDict[str, None] = OrderedDict()
        self._changed = asyncio.Condition()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, forget_id: str) -> ForgetEntry | None:
        return self._entries.get(forget_id)

    def _put(self, entry: ForgetEntry) -> ForgetEntry:
        old = self._entries.pop(entry.forget_id, None)
        if old is not None:
            self._by_user.get(old.user_id, {}).pop(old.forget_id, None)
        self._entries[entry.forget_id] = entry
        self._by_user.setdefault(entry.user_id, {})[entry.forget_id] = entry
        while len(self._entries) > self.capacity:
            _, gone = self._entries.popitem(last=False)
            user = self._by_user.get(gone.user_id, {})
            user.pop(gone.forget_id, None)
            if not user:
                self._by_user.pop(gone.user_id, None)
            if gone.done:  # copies of its memory read from now on are no longer refused
                log.warning("forgets_full", forget_id=gone.forget_id, capacity=self.capacity)
        return entry

    def sent(self, forget: Forget) -> ForgetEntry:
        topics = forget_topics(forget.scope, self.topics)
        entry = ForgetEntry(forget.event_id, forget.user_id, forget.scope, forget.target, topics, forget.ingest_time)
        return self._put(entry)

    def record(self, done: MemoryForgotten) -> tuple[Erasure, ForgetEntry, bool]:
        """Record an erasure; returns it, its forget's entry and whether it completed that forget just now."""
        entry = self._entries.get(done.forget_id)
        if entry is None or entry.user_id != done.user_id:
            topics = forget_topics(done.scope, self.topics)
            entry = self._put(ForgetEntry(done.forget_id, done.user_id, done.scope, done.target, topics))
        was_complete = entry.complete
        erasure = entry.done[done.source_topic] = Erasure.of(done)
        return erasure, entry, entry.complete and not was_complete

    async def wait_done(self, forget_id: str, timeout_s: float) -> ForgetEntry | None:
        """The entry, waiting up to ``timeout_s`` for it to be complete."""

        def done() -> bool:
            entry = self._entries.get(forget_id)
            return entry is None or entry.complete

        async with self._changed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait_for(done), timeout_s)
        return self._entries.get(forget_id)

    async def changed(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    # -- what the books refuse ----------------------------------------------------------------------------------

    def of_user(self, user_id: str | None) -> list[Erasure]:
        if user_id is None:
            return []
        return [e for entry in self._by_user.get(user_id, {}).values() for e in entry.done.values()]

    def forgotten_query(self, query_id: str) -> bool:
        return query_id in self._queries

    def forget_query(self, query_id: str) -> None:
        self._queries[query_id] = None
        self._queries.move_to_end(query_id)
        while len(self._queries) > self.queries_capacity:
            self._queries.popitem(last=False)

    def forgets(self, query_id: str, user_id: str | None, when: datetime, content: object) -> bool:
        """A query's record (the query, a stage event, the answer) to refuse: its query went with an erasure
        already, or the record is covered by one (then the whole query goes)."""
        if self.forgotten_query(query_id):
            return True
        if any(e.covers(when, content) for e in self.of_user(user_id)):
            self.forget_query(query_id)
            return True
        return False

    def forgets_answer(self, answer: Answer) -> bool:
        return self.forgets(answer.query_id, answer.user_id, answer.ingest_time, answer)

    def forgets_letter(self, letter: DeadLetter) -> bool:
        return any(e.covers_letter(letter) for e in self.of_user(letter.user_id))

    def guard(self, answers: AnswerBook, dead_letters: DeadLetterFeed, traces: TraceStore | None) -> None:
        """Make the books refuse what has been forgotten (``dead_letters``: the feed that fills them)."""
        answers.refuse = self.forgets_answer
        dead_letters.refuse = self.forgets_letter
        if traces is not None:
            traces.refuse = self.forgets


def _trace_time(trace: Trace) -> datetime:
    times = [t for t in (trace.asked_at, trace.started_at, trace.answered_at) if t is not None]
    return min(times) if times else datetime.now(UTC)


# -- the purge --------------------------------------------------------------------------------------------------------


class Purger:
    """Applies each ``MemoryForgotten`` to the gateway's copies: answers, traces, dead letters, the outbox."""

    def __init__(
        self,
        forgets: Forgets,
        answers: AnswerBook,
        dead_letters: DeadLetterBook,
        outbox: Outbox | None = None,
        traces: TraceStore | None = None,
    ) -> None:
        self.forgets = forgets
        self.answers = answers
        self.dead_letters = dead_letters
        self.outbox = outbox
        self.traces = traces  # mounted later (``install_observability`` makes it)

    async def apply(self, done: MemoryForgotten) -> dict[str, int]:
        """Purge what ``done`` erased; returns how many copies of each kind went."""
        erasure, entry, completed = self.forgets.record(done)
        purged = {
            "answer": self._answers(erasure),
            "trace": self._traces(erasure),
            "dead_letter": self._dead_letters(erasure),
            "outbox": await self._outbox(erasure),
        }
        for what, count in purged.items():
            FORGET_PURGED.labels(what=what).inc(count)
        if completed:
            FORGETS_COMPLETED.labels(scope=entry.scope.value).inc()
        await self.forgets.changed()
        log.info(
            "forget_purged",
            forget_id=done.forget_id,
            user_id=done.user_id,
            source_topic=done.source_topic,
            scope=done.scope.value,
            complete=entry.complete,
            **purged,
        )
        return purged

    def _answers(self, erasure: Erasure) -> int:
        gone = [
            a.query_id
            for a in self.answers.answers()
            if a.user_id == erasure.announced.user_id and self._covers(erasure, a)
        ]
        return self.answers.remove(gone)

    def _covers(self, erasure: Erasure, answer: Answer) -> bool:
        if self.forgets.forgotten_query(answer.query_id) or erasure.covers(answer.ingest_time, answer):
            self.forgets.forget_query(answer.query_id)
            return True
        return False

    def _traces(self, erasure: Erasure) -> int:
        if self.traces is None:
            return 0
        gone = []
        for trace in self.traces.traces():
            if trace.user_id != erasure.announced.user_id:
                continue
            if self.forgets.forgotten_query(trace.query_id) or erasure.covers(_trace_time(trace), trace):
                self.forgets.forget_query(trace.query_id)
                gone.append(trace.query_id)
        return self.traces.remove(gone)

    def _dead_letters(self, erasure: Erasure) -> int:
        letters = self.dead_letters.select(user_id=erasure.announced.user_id)
        return self.dead_letters.remove(e.letter.event_id for e in letters if erasure.covers_letter(e.letter))

    async def _outbox(self, erasure: Erasure) -> int:
        """Rows holding the forgotten events' text: those whose memory was erased, and those the forget selects
        that were accepted before it (rows after it are new memory); and the tombstone's own row on its topic."""
        if self.outbox is None:
            return 0
        done = erasure.announced
        own = f"{done.forget_id}@{done.source_topic}"
        rows = [e for e in await _all_entries(self.outbox) if e.record.user_id == done.user_id]
        before = next((e.seq for e in rows if e.record.event_id == own), None)
        gone = {own} if before is not None else set()
        for row in rows:
            record = row.record
            if record.event_id in erasure.source_event_ids or (
                before is not None
                and row.seq < before
                and record.topic == done.source_topic
                and selects(done.scope, done.target, record.event_id, _payload(record.value))
            ):
                gone.add(record.event_id)
        if not gone:
            return 0
        removed = await self.outbox.remove(done.user_id, sorted(gone))
        if not await self.outbox.checkpoint():  # the removed rows' text must not stay in the WAL file
            log.warning("outbox_checkpoint_busy", forget_id=done.forget_id)
        return removed


async def _all_entries(outbox: Outbox) -> list[Any]:
    rows: list[Any] = []
    while chunk := await outbox.entries(rows[-1].seq if rows else 0, include_dead=True):
        rows.extend(chunk)
    return rows


def forgotten_records(records: Iterable[ConsumerRecord[bytes, bytes]]) -> list[MemoryForgotten]:
    """The ``MemoryForgotten`` among memory-update records (``memory_update`` and unknown kinds are skipped)."""
    found = []
    for record in records:
        raw = record.value or b""
        if b'"memory_forgotten"' not in raw or _payload(raw).get("kind") != "memory_forgotten":
            continue
        try:
            found.append(decode(record.value, MemoryForgotten))
        except InvalidEvent as exc:
            log.warning("memory_forgotten_invalid", topic=record.topic, offset=record.offset, error=str(exc)[:300])
    return found


class MemoryUpdatesFeed(TopicFeed):
    """Reads the memory-updates topic from its beginning and hands every ``MemoryForgotten`` to the ``Purger``."""

    def __init__(self, bootstrap: str, topic: str, purger: Purger, settings: Settings | None = None) -> None:
        super().__init__(
            bootstrap, (topic,), client_id="memstream-gateway-forgets", name="forget-feed", settings=settings
        )
        self.purger = purger
        #: called after each fetch that held any memory update (memory was written: a backlog may have drained)
        self.on_update: list[Callable[[], None]] = []

    async def handle(self, fetched: Fetch) -> None:
        if any(fetched.values()):
            for listener in self.on_update:
                listener()
        for records in fetched.values():
            for done in forgotten_records(records):
                try:
                    await self.purger.apply(done)
                except Exception as exc:  # recorded: what arrives later is still refused
                    log.error("forget_purge_failed", forget_id=done.forget_id, error=repr(exc))


# -- the routes -------------------------------------------------------------------------------------------------------


class ForgetAccepted(BaseModel):
    forget_id: str
    user_id: str
    scope: ForgetScope
    target: str | None
    topics: list[str]
    status: str = "pending"


def forget_router(book: Forgets, produce: Produce, limiter: RateLimiter) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/forget", status_code=202, response_model=ForgetAccepted)
    async def post_forget(request: Request, principal: Writer) -> Any:
        """Forget a message, a document, a conversation or a whole user: a tombstone on the topics, applied by
        every worker in order with the user's other events. Poll ``GET /v1/forget/{forget_id}`` for the outcome."""
        try:
            (forget,) = scoped_parse(lambda body: [inputs.forget(body)], principal, limiter, "write")(
                await inputs.json_body(request)
            )
        except inputs.InvalidInput as exc:
            return inputs.invalid_response("forget", exc)
        entry = book.sent(forget)
        for topic in entry.topics:
            await produce(topic, [forget])
        FORGETS_ACCEPTED.labels(scope=forget.scope.value).inc()
        log.info(
            "forget_accepted",
            forget_id=forget.event_id,
            user_id=forget.user_id,
            scope=forget.scope.value,
            target=forget.target,
            by=principal.id,
        )
        return ForgetAccepted(
            forget_id=forget.event_id,
            user_id=forget.user_id,
            scope=forget.scope,
            target=forget.target,
            topics=entry.topics,
        )

    @router.get("/v1/forget/{forget_id}", response_model=ForgetStatus)
    async def get_forget(
        request: Request, forget_id: str, wait: float = Query(0.0, ge=0.0, le=30.0, description="long-poll: seconds")
    ) -> Any:
        """The forget's progress; 404 for an unknown id and for another user's (ids cannot be probed). ``wait``
        waits that long for it to be done."""
        principal: Principal | None = getattr(request.state, "principal", None)
        if principal is None or not (principal.can(Action.WRITE) or principal.can(Action.READ)):
            raise HTTPException(status_code=403, detail="this credential lacks the 'write' or 'read' scope")
        entry = book.get(forget_id)
        if entry is not None and principal.covers(entry.user_id) and wait > 0:
            entry = await book.wait_done(forget_id, wait)
        if entry is None or not principal.covers(entry.user_id):
            return JSONResponse(status_code=404, content={"detail": f"no forget {forget_id} known here"})
        return ForgetStatus.of(entry)

    return router
