"""Dead letters an operator can see and replay.

The gateway reads the dead-letter topic from its beginning (a consumer without a group, like the answers feed)
into a ``DeadLetterBook``: per dead letter (its ``event_id``, e.g. ``dl_<event id>``) the latest record and a
status, ``dead`` or ``replayed`` (with the replay time). A replay re-publishes the dead letter's original payload,
validated again with the contract of its source topic, onto that topic, keyed by user and with the same event id:
memorize skips only events it applied, and a dead-lettered event never was. A record that arrives after a replay
(the event failed again) makes the dead letter ``dead`` again.

The status lives in the gateway's memory: after a restart every dead letter reads ``dead`` again, and replaying
one whose event has meanwhile been memorized changes nothing (the event id is the idempotency key).
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse
from prometheus_client import Counter
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, StringConstraints, ValidationError, model_validator

from schemas.events import ChatMessage, DeadLetter, Document, Event, UserId
from schemas.events import Query as QueryEvent
from services.logging import get_logger
from services.settings import Settings
from streams.background import Fetch, TopicFeed, decode_records
from streams.gateway import inputs
from streams.gateway.auth import Admin, Reader
from streams.topics import TopicNames

log = get_logger(__name__)

DEAD_LETTERS_REPLAYED = Counter(
    "memstream_dead_letters_replayed_total", "Dead letters replayed onto their source topic", ["topic", "reason"]
)

#: at most this many events are re-published per replay request (``remaining`` says how many more match)
MAX_REPLAY = 1000
MAX_PAGE = 1000

EventIdText = Annotated[str, StringConstraints(min_length=1, max_length=200)]
Produce = Callable[[str, Sequence[Event]], Awaitable[None]]


class DeadLetterStatus(StrEnum):
    DEAD = "dead"
    REPLAYED = "replayed"


@dataclass
class Entry:
    letter: DeadLetter  # the latest record
    status: DeadLetterStatus
    first_dead_lettered_at: datetime
    records: int = 1
    replays: int = 0
    replayed_at: datetime | None = None


class DeadLetterView(BaseModel):
    """One dead letter as the operator sees it: its latest record and its status."""

    event_id: str = Field(description="The dead letter's id (``dl_<event id>`` for memorize failures).")
    status: DeadLetterStatus
    replayed_at: AwareDatetime | None = None
    replays: int = Field(description="Replays through this gateway since it started.")
    records: int = Field(description="Dead-letter records seen with this id (each failure adds one).")
    user_id: str | None
    source_topic: str
    reason: str
    error: str
    failed_event_ids: list[str]
    attempts: int
    dead_lettered_at: AwareDatetime = Field(description="When the latest record was written.")
    first_dead_lettered_at: AwareDatetime
    payload: str | None = Field(default=None, description="The original event (only with include_payload=true).")

    @classmethod
    def of(cls, entry: Entry, include_payload: bool = False) -> DeadLetterView:
        letter = entry.letter
        return cls(
            event_id=letter.event_id,
            status=entry.status,
            replayed_at=entry.replayed_at,
            replays=entry.replays,
            records=entry.records,
            user_id=letter.user_id,
            source_topic=letter.source_topic,
            reason=letter.reason,
            error=letter.error,
            failed_event_ids=letter.failed_event_ids,
            attempts=letter.attempts,
            dead_lettered_at=letter.ingest_time,
            first_dead_lettered_at=entry.first_dead_lettered_at,
            payload=letter.payload if include_payload else None,
        )


class DeadLetterPage(BaseModel):
    total: int = Field(description="Dead letters matching the filters (the page holds at most ``limit``).")
    complete: bool = Field(description="False while the gateway is still reading the topic's backlog.")
    dead_letters: list[DeadLetterView] = Field(description="Newest first (by their latest record).")


class ReplayRequest(BaseModel):
    """``{"event_ids": [...]}`` (dead-letter ids or the failed events' ids), or ``{"all": true}`` with optional
    ``user_id`` and ``reason`` filters (then only dead letters whose status is ``dead``)."""

    model_config = ConfigDict(extra="forbid")

    event_ids: list[EventIdText] | None = Field(default=None, min_length=1, max_length=MAX_REPLAY)
    all: bool = False
    user_id: UserId | None = None
    reason: Annotated[str, StringConstraints(min_length=1, max_length=200)] | None = None

    @model_validator(mode="after")
    def _one_selection(self) -> ReplayRequest:
        if self.event_ids is not None and self.all:
            raise ValueError("give either event_ids or all: true, not both")
        if self.event_ids is None and not self.all:
            raise ValueError("give event_ids, or all: true (optionally with user_id and reason filters)")
        if self.event_ids is not None and (self.user_id is not None or self.reason is not None):
            raise ValueError("user_id and reason filter all: true; with event_ids name the dead letters instead")
        return self


class Replayed(BaseModel):
    event_id: str = Field(description="The re-published event's id (the same as before).")
    user_id: str
    source_topic: str
    dead_letters: list[str]


class NotReplayable(BaseModel):
    event_id: str = Field(description="The dead letter's id.")
    error: str


class ReplayResult(BaseModel):
    replayed: list[Replayed]
    skipped: list[NotReplayable] = Field(description="Matching dead letters whose payload cannot be replayed.")
    remaining: int = Field(description="Replayable dead letters that matched beyond this request's limit.")


class DeadLetterBook:
    """dead-letter id -> ``Entry``, most recently received last; at most ``capacity`` (the oldest go first)."""

    def __init__(self, capacity: int = 50_000) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self._by_event: dict[str, set[str]] = {}  # failed event id -> dead-letter ids

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, event_id: str) -> Entry | None:
        return self._entries.get(event_id)

    def add(self, letter: DeadLetter) -> Entry:
        """Record ``letter``; one that arrives after a replay of its id means the event failed again."""
        entry = self._entries.get(letter.event_id)
        if entry is None:
            entry = Entry(letter, DeadLetterStatus.DEAD, first_dead_lettered_at=letter.ingest_time)
            self._entries[letter.event_id] = entry
            for failed in letter.failed_event_ids:
                self._by_event.setdefault(failed, set()).add(letter.event_id)
            self._evict()
            return entry
        entry.letter = letter
        entry.records += 1
        entry.status = DeadLetterStatus.DEAD
        self._entries.move_to_end(letter.event_id)
        return entry

    def _evict(self) -> None:
        while len(self._entries) > self.capacity:
            dropped_id, dropped = self._entries.popitem(last=False)
            self._unindex(dropped_id, dropped)
            log.warning("dead_letter_forgotten", dead_letter=dropped_id, capacity=self.capacity)

    def _unindex(self, letter_id: str, entry: Entry) -> None:
        for failed in entry.letter.failed_event_ids:
            ids = self._by_event.get(failed, set())
            ids.discard(letter_id)
            if not ids:
                self._by_event.pop(failed, None)

    def remove(self, letter_ids: Iterable[str]) -> int:
        """Drop these dead letters (their events were forgotten); returns how many were held."""
        removed = 0
        for letter_id in set(letter_ids):
            entry = self._entries.pop(letter_id, None)
            if entry is not None:
                self._unindex(letter_id, entry)
                removed += 1
        return removed

    def select(
        self, user_id: str | None = None, reason: str | None = None, status: DeadLetterStatus | None = None
    ) -> list[Entry]:
        """Matching entries, newest (latest record) first: by the records' time, as records of different users
        come from different partitions, in no particular order; then the later arrival first."""
        matching = [
            e
            for e in reversed(self._entries.values())
            if (user_id is None or e.letter.user_id == user_id)
            and (reason is None or e.letter.reason == reason)
            and (status is None or e.status is status)
        ]
        return sorted(matching, key=lambda e: e.letter.ingest_time, reverse=True)

    def resolve(self, ids: Iterable[str]) -> tuple[list[Entry], list[str]]:
        """The entries named by ``ids`` (dead-letter ids, or ids of the events that failed), and the unknown ids."""
        found: dict[str, Entry] = {}
        unknown: list[str] = []
        for name in ids:
            if name in self._entries:
                found.setdefault(name, self._entries[name])
            elif name in self._by_event:
                for letter_id in sorted(self._by_event[name]):
                    found.setdefault(letter_id, self._entries[letter_id])
            elif name not in unknown:
                unknown.append(name)
        return list(found.values()), unknown


class DeadLetterFeed(TopicFeed):
    """Consumes the dead-letter topic into a ``DeadLetterBook`` until stopped; ``caught_up`` once it has read what
    the topic held when the feed started (a replay before then could miss a newer failure)."""

    def __init__(self, bootstrap: str, topic: str, book: DeadLetterBook, settings: Settings | None = None) -> None:
        super().__init__(
            bootstrap, (topic,), client_id="memstream-gateway-dead-letters", name="dead-letter-feed", settings=settings
        )
        self.topic = topic
        self.book = book
        #: called with every dead letter read (the outbox marks its events dead); must not raise
        self.listeners: list[Callable[[DeadLetter], Awaitable[None]]] = []
        #: ``True`` for a dead letter of forgotten events: neither kept nor told to the listeners
        self.refuse: Callable[[DeadLetter], bool] = lambda _letter: False

    async def handle(self, fetched: Fetch) -> None:
        for records in fetched.values():
            for letter in decode_records(records, DeadLetter, "dead_letter"):
                if self.refuse(letter):
                    continue
                self.book.add(letter)
                for listener in self.listeners:
                    await listener(letter)

    async def on_loaded(self) -> None:
        log.info("dead_letters_loaded", dead_letters=len(self.book))


def _contracts(topics: TopicNames) -> dict[str, type[Event]]:
    """What a replay may put on each topic: the events the gateway itself accepts there."""
    return {topics.chat: ChatMessage, topics.documents: Document, topics.queries: QueryEvent}


def replayable_event(entry: Entry, contracts: dict[str, type[Event]]) -> Event:
    """The dead letter's original event, validated with its source topic's contract; ``InvalidInput`` otherwise."""
    letter = entry.letter
    model = contracts.get(letter.source_topic)
    if model is None:
        raise inputs.InvalidInput(f"nothing can be replayed onto topic {letter.source_topic!r}")
    try:
        item = json.loads(letter.payload)
    except ValueError as exc:
        raise inputs.InvalidInput(f"the payload is not valid JSON: {exc}") from exc
    if not isinstance(item, dict):
        raise inputs.InvalidInput("the payload is not a JSON object")
    event = inputs.validate(model, item, "payload")
    if letter.user_id is not None and event.user_id != letter.user_id:
        raise inputs.InvalidInput(f"the payload is user {event.user_id!r}'s, the dead letter user {letter.user_id!r}'s")
    return event


def _prepare(
    entries: Sequence[Entry], contracts: dict[str, type[Event]]
) -> tuple[list[tuple[Entry, Event]], list[NotReplayable]]:
    good, bad = [], []
    for entry in entries:
        try:
            good.append((entry, replayable_event(entry, contracts)))
        except inputs.InvalidInput as exc:
            bad.append(NotReplayable(event_id=entry.letter.event_id, error=str(exc)))
    return good, bad


def dead_letter_router(book: DeadLetterBook, feed: DeadLetterFeed, topics: TopicNames, produce: Produce) -> APIRouter:
    router = APIRouter()
    contracts = _contracts(topics)
    replay_lock = asyncio.Lock()  # one replay at a time: a dead letter is never re-published twice concurrently

    @router.get("/v1/dead-letters", response_model=DeadLetterPage)
    async def list_dead_letters(
        principal: Reader,
        user_id: Annotated[str | None, Query(description="only this user's")] = None,
        reason: Annotated[str | None, Query(max_length=200, description="e.g. extraction_failed")] = None,
        status: Annotated[DeadLetterStatus | None, Query(description="dead or replayed")] = None,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
        offset: Annotated[int, Query(ge=0)] = 0,
        include_payload: bool = False,
    ) -> Any:
        """Dead letters, newest first, with their status: only those of the users the credential acts for."""
        if user_id is not None:
            try:
                inputs.check_user_id(user_id)
            except inputs.InvalidInput as exc:
                return JSONResponse(status_code=422, content={"detail": str(exc)})
            principal.check_user(user_id)
        matching = [e for e in book.select(user_id, reason, status) if principal.covers(e.letter.user_id)]
        page = [DeadLetterView.of(e, include_payload) for e in matching[offset : offset + limit]]
        return DeadLetterPage(total=len(matching), complete=feed.caught_up, dead_letters=page)

    @router.post("/v1/dead-letters/replay", status_code=202, response_model=ReplayResult)
    async def replay_dead_letters(request: Request, _: Admin) -> Any:
        """Re-publish dead letters' original events onto their source topics (same event id, keyed by user)."""
        try:
            body = await inputs.json_body(request)
            wanted = ReplayRequest.model_validate(body)
        except inputs.InvalidInput as exc:
            return JSONResponse(status_code=exc.status, content={"detail": str(exc), "errors": exc.errors})
        except ValidationError as exc:
            invalid = inputs.invalid_input(exc, "replay request")
            return JSONResponse(status_code=422, content={"detail": str(invalid), "errors": invalid.errors})
        if not feed.caught_up:
            return JSONResponse(
                status_code=503,
                content={"detail": "the gateway is still reading the dead-letter topic; try again in a moment"},
            )
        async with replay_lock:
            skipped: list[NotReplayable] = []
            remaining = 0
            if wanted.event_ids is not None:
                entries, unknown = book.resolve(wanted.event_ids)
                if unknown:
                    return JSONResponse(
                        status_code=404,
                        content={"detail": f"unknown dead letters: {', '.join(unknown)}", "unknown": unknown},
                    )
                chosen, bad = _prepare(entries, contracts)
                if bad:
                    detail = "not replayable: " + "; ".join(f"{b.event_id}: {b.error}" for b in bad)
                    listed = [b.model_dump() for b in bad]
                    return JSONResponse(status_code=422, content={"detail": detail, "not_replayable": listed})
            else:
                chosen, skipped = _prepare(book.select(wanted.user_id, wanted.reason, DeadLetterStatus.DEAD), contracts)
                remaining = max(0, len(chosen) - MAX_REPLAY)
                chosen = chosen[:MAX_REPLAY]
            replayed = await _replay(chosen, produce)
        return ReplayResult(replayed=replayed, skipped=skipped, remaining=remaining)

    return router


async def _replay(chosen: Sequence[tuple[Entry, Event]], produce: Produce) -> list[Replayed]:
    """Publish each distinct event once, marking its dead letters replayed first: a record of a new failure can
    arrive as soon as the broker has the event, and it must find the dead letter replayed to make it dead again."""
    by_event: dict[tuple[str, str], tuple[Event, list[Entry]]] = {}
    for entry, event in chosen:
        by_event.setdefault((entry.letter.source_topic, event.event_id), (event, []))[1].append(entry)
    now = datetime.now(UTC)
    before = [(e, e.status, e.replayed_at, e.replays) for _, entries in by_event.values() for e in entries]
    for _, entries in by_event.values():
        for entry in entries:
            entry.status, entry.replayed_at, entry.replays = DeadLetterStatus.REPLAYED, now, entry.replays + 1
    by_topic: dict[str, list[Event]] = {}
    for (topic, _), (event, _) in by_event.items():
        by_topic.setdefault(topic, []).append(event)
    try:
        for topic, events in by_topic.items():
            await produce(topic, events)
    except BaseException:
        for entry, status, replayed_at, replays in before:  # not (all) published: the caller gets a 503
            entry.status, entry.replayed_at, entry.replays = status, replayed_at, replays
        raise
    result = []
    for (topic, _), (event, entries) in by_event.items():
        for entry in entries:
            DEAD_LETTERS_REPLAYED.labels(topic=topic, reason=entry.letter.reason).inc()
        log.info("dead_letter_replayed", event_id=event.event_id, user_id=event.user_id, source_topic=topic)
        result.append(
            Replayed(
                event_id=event.event_id,
                user_id=event.user_id,
                source_topic=topic,
                dead_letters=[e.letter.event_id for e in entries],
            )
        )
    return result
