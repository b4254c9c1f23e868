"""What the agents do with a batch of records, independent of Faust so it reads (and tests) as plain code.

Delivery is at-least-once: the agent acks a batch only after ``handle`` returned, i.e. after the store write
committed and its events were published. A replay is harmless because the memorize service skips events it has
already applied, and it announces again those memory updates the store still holds as pending (written, never
marked announced): a crash between the store write and the publish loses no announcement. A handler never raises:
whatever fails becomes a dead letter and the worker keeps going.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from tenacity import AsyncRetrying, stop_after_attempt, wait_exponential

from schemas.events import (
    Answer,
    AnswerStatus,
    AnswerText,
    ChatMessage,
    DeadLetter,
    Document,
    Event,
    Forget,
    MemoryForgotten,
    MemoryUpdate,
    Query,
    QueryCancel,
    StageEvent,
)
from services import metrics
from services.llm.layers import TRANSIENT_ERRORS
from services.logging import get_logger
from services.observability.context import bind, log_context
from streams.answer_text import TextRelay
from streams.cancels import Cancellations
from streams.codec import (
    INVALID_EVENT,
    PROCESSING_FAILED,
    InvalidEvent,
    dead_letter,
    decode_keyed,
    encode,
    is_tombstone,
    user_key,
)
from streams.topics import TopicNames

log = get_logger(__name__)

MemoryEvent = ChatMessage | Document
E = TypeVar("E", bound=Event)


@dataclass(frozen=True)
class Record:
    """One consumed Kafka record, as bytes."""

    topic: str
    key: bytes | None
    value: bytes | None


class Publisher(Protocol):
    async def publish(self, topic: str, key: bytes | None, value: bytes) -> None:
        """Return once the broker acknowledged the record."""


class MemorizeOutcomeLike(Protocol):
    @property
    def updates(self) -> Sequence[MemoryUpdate]: ...
    @property
    def dead_letters(self) -> Sequence[DeadLetter]: ...


class Memorizer(Protocol):
    async def memorize(self, events: Sequence[MemoryEvent], source_topic: str = ...) -> MemorizeOutcomeLike: ...

    async def announced(self, updates: Sequence[MemoryUpdate]) -> None:
        """These updates were published: the store stops keeping them for a replay to announce."""


class Forgetter(Protocol):
    async def forget(self, tombstone: Forget, source_topic: str) -> MemoryForgotten:
        """Apply the tombstone (again, if it was: the same outcome comes back)."""


class Answerer(Protocol):
    async def answer(
        self,
        query: Query,
        emit: Callable[[StageEvent], Awaitable[None]] | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> Answer: ...


async def publish_reliably(publisher: Publisher, topic: str, key: bytes | None, value: bytes) -> bool:
    """Publish with a few retries; False (logged) if the broker keeps refusing. Never raises."""
    try:
        async for attempt in AsyncRetrying(
            stop=stop_after_attempt(4), wait=wait_exponential(multiplier=0.2, max=2), reraise=True
        ):
            with attempt:
                await publisher.publish(topic, key, value)
    except Exception as exc:
        log.error("publish_failed", topic=topic, error=repr(exc))
        return False
    return True


async def send_dead_letter(publisher: Publisher, topics: TopicNames, letter: DeadLetter, counted: bool = False) -> None:
    if not counted:
        metrics.DEAD_LETTERS.labels(topic=letter.source_topic, reason=letter.reason).inc()
    log.warning(
        "dead_letter",
        source_topic=letter.source_topic,
        reason=letter.reason,
        user_id=letter.user_id,
        failed_event_ids=letter.failed_event_ids,
        error=letter.error[:300],
    )
    await publish_reliably(publisher, topics.dead_letters, user_key(letter.user_id), encode(letter))


async def decoded(publisher: Publisher, topics: TopicNames, record: Record, model: type[E]) -> E | None:
    """The record's event, or None once it went to the dead letters: records are decoded one at a time, before
    any batching, so a bad one never takes a neighbour with it."""
    try:
        return decode_keyed(record.key, record.value, model)
    except InvalidEvent as exc:
        letter = dead_letter(
            source_topic=record.topic,
            reason=exc.reason,
            error=str(exc),
            raw=record.value,
            user_id=exc.user_id,
            failed_event_ids=[exc.event_id] if exc.event_id else [],
        )
    except Exception as exc:  # decode raises only InvalidEvent; were that wrong, the agent must still not die
        log.exception("decode_failed", topic=record.topic)
        letter = dead_letter(source_topic=record.topic, reason=INVALID_EVENT, error=repr(exc), raw=record.value)
    await send_dead_letter(publisher, topics, letter)
    return None


class MemorizeHandler:
    """Chat messages and documents -> memorize service -> memory updates (and dead letters)."""

    def __init__(
        self, memorizer: Memorizer, publisher: Publisher, topics: TopicNames, forgetter: Forgetter | None = None
    ) -> None:
        """``forgetter``: applies the tombstones on these topics; without one they are dead-lettered, never
        skipped."""
        self.memorizer = memorizer
        self.forgetter = forgetter
        self.publisher = publisher
        self.topics = topics
        self.models: dict[str, type[ChatMessage] | type[Document]] = {
            topics.chat: ChatMessage,
            topics.documents: Document,
        }

    async def handle(self, records: Sequence[Record]) -> None:
        by_topic: dict[str, list[tuple[MemoryEvent | Forget, Record]]] = {}
        for record in records:
            model = self.models.get(record.topic)
            if model is None:
                continue
            # the memory topics carry tombstones too, in order with the user's events
            kind: type[MemoryEvent] | type[Forget] = Forget if is_tombstone(record.value) else model
            event = await decoded(self.publisher, self.topics, record, kind)
            if event is None:
                continue
            by_topic.setdefault(record.topic, []).append((event, record))
        for topic, items in by_topic.items():
            # one call per user (the service works user by user anyway), so its log lines carry the user's ids
            by_user: dict[str, list[tuple[MemoryEvent | Forget, Record]]] = {}
            for item in items:
                by_user.setdefault(item[0].user_id, []).append(item)
            for user_id, user_items in by_user.items():
                with log_context(user_id=user_id, event_ids=[event.event_id for event, _ in user_items]):
                    await self._in_order(topic, user_items)

    async def _in_order(self, topic: str, items: list[tuple[MemoryEvent | Forget, Record]]) -> None:
        """A user's events up to a tombstone are memorized before it is applied, the rest after it."""
        run: list[tuple[MemoryEvent, Record]] = []
        for event, record in items:
            if not isinstance(event, Forget):
                run.append((event, record))
                continue
            if run:
                await self._memorize(topic, run)
                run = []
            await self._forget(topic, event, record)
        if run:
            await self._memorize(topic, run)

    async def _forget(self, topic: str, tombstone: Forget, record: Record) -> None:
        try:
            if self.forgetter is None:
                raise RuntimeError("this worker was built without a forgetter: the tombstone cannot be applied")
            outcome = await self.forgetter.forget(tombstone, topic)
        except Exception as exc:
            log.exception("forget_failed", topic=topic, forget_id=tombstone.event_id)
            reason = "store_unavailable" if isinstance(exc, TRANSIENT_ERRORS) else PROCESSING_FAILED
            letter = dead_letter(
                source_topic=topic,
                reason=reason,
                error=repr(exc),
                raw=record.value,
                user_id=tombstone.user_id,
                failed_event_ids=[tombstone.event_id],
            )
            await send_dead_letter(self.publisher, self.topics, letter)
            return
        # on the memory-update topic, so the gateway drops the answers, traces and dead letters that quote it
        topic_out = self.topics.memory_updates
        await publish_reliably(self.publisher, topic_out, user_key(outcome.user_id), encode(outcome))

    async def _memorize(self, topic: str, items: Sequence[tuple[MemoryEvent, Record]]) -> None:
        try:
            outcome = await self.memorizer.memorize([event for event, _ in items], topic)
        except Exception as exc:
            if len(items) > 1 and not isinstance(exc, TRANSIENT_ERRORS):
                # maybe one event's data broke it: halves until the culprit is alone, its neighbours memorized
                log.warning("memorize_failed_splitting", topic=topic, events=len(items), error=repr(exc))
                half = len(items) // 2
                await self._memorize(topic, items[:half])
                await self._memorize(topic, items[half:])
                return
            log.exception("memorize_failed", topic=topic, events=len(items))
            for event, record in items:
                letter = dead_letter(
                    source_topic=topic,
                    reason=PROCESSING_FAILED,
                    error=repr(exc),
                    raw=record.value,
                    user_id=event.user_id,
                    failed_event_ids=[event.event_id],
                )
                await send_dead_letter(self.publisher, self.topics, letter)
            return
        await self._announce(outcome.updates)
        for letter in outcome.dead_letters:
            # the memorize service counts its own dead letters
            await send_dead_letter(self.publisher, self.topics, letter, counted=True)

    async def _announce(self, updates: Sequence[MemoryUpdate]) -> None:
        """Publish each memory update, then mark the acknowledged ones announced.

        A crash before the mark leaves them pending in the store, and the replay publishes them again with the
        same id: announcements are at-least-once, and a consumer that counts them dedupes by ``change_set_id``."""
        topic = self.topics.memory_updates
        published = []
        for update in updates:
            if await publish_reliably(self.publisher, topic, user_key(update.user_id), encode(update)):
                published.append(update)
        if not published:
            return
        try:
            await self.memorizer.announced(published)
        except Exception:  # still pending: the next replay of their events announces them again, same id
            log.exception("mark_announced_failed", change_set_ids=[u.change_set_id for u in published])


class QAHandler:
    """Queries -> QA service -> stage events and the answer's text while it works, then the answer.

    A query cancelled (``cancels``) while it is answered stops at the model's next token; one cancelled before it
    was taken up is not started. Either way its answer event says ``cancelled``, so no reader waits in vain."""

    def __init__(
        self, answerer: Answerer, publisher: Publisher, topics: TopicNames, cancels: Cancellations | None = None
    ) -> None:
        self.answerer = answerer
        self.publisher = publisher
        self.topics = topics
        self.cancels = cancels or Cancellations()

    async def handle(self, record: Record) -> None:
        query = await decoded(self.publisher, self.topics, record, Query)
        if query is None:
            return
        with log_context(query_id=query.query_id, user_id=query.user_id, event_id=query.event_id):
            await self._answer(query, record)

    async def _answer(self, query: Query, record: Record) -> None:
        key = user_key(query.user_id)

        async def emit(stage: StageEvent) -> None:
            bind(trace_id=stage.trace_id)  # known from the first stage on; log_context drops it after the query
            await publish_reliably(self.publisher, self.topics.stages, key, encode(stage))

        async def publish_text(text: AnswerText) -> None:
            if self.topics.answer_text:
                await self.publisher.publish(self.topics.answer_text, key, encode(text))

        early = self.cancels.cancelled(query.query_id)
        if early is not None:
            answer = cancelled_answer(query, early, started=False)
        else:
            answer = await self._run(query, record, emit, TextRelay(query, publish_text))
        await publish_reliably(self.publisher, self.topics.answers, key, encode(answer))

    async def _run(
        self, query: Query, record: Record, emit: Callable[[StageEvent], Awaitable[None]], relay: TextRelay
    ) -> Answer:
        """The answer, in a task of its own that a cancel can stop without touching the agent that runs this."""
        job: asyncio.Task[Answer] = asyncio.create_task(self.answerer.answer(query, emit, relay))
        self.cancels.running(query.query_id, job)
        try:
            await asyncio.wait({job})
        finally:
            self.cancels.finished(query.query_id)
            if not job.done():  # this agent itself is being stopped: the answering goes with it
                job.cancel()
                await relay.abort()
        cancel = self.cancels.cancelled(query.query_id)
        if job.cancelled() and cancel is not None:
            await relay.abort()
            return cancelled_answer(query, cancel, started=True)
        await relay.close()
        try:
            answer = job.result()
        except (Exception, asyncio.CancelledError) as exc:
            log.exception("qa_failed", query_id=query.query_id, user_id=query.user_id)
            letter = dead_letter(
                source_topic=record.topic,
                reason=PROCESSING_FAILED,
                error=repr(exc),
                raw=record.value,
                user_id=query.user_id,
                failed_event_ids=[query.event_id],
            )
            await send_dead_letter(self.publisher, self.topics, letter)
            # whoever waits for this query gets an answer that says it failed, not a timeout
            answer = error_answer(query, repr(exc))
            metrics.QA_ANSWERS.labels(status=answer.status.value).inc()  # the QA service counted none
        if relay.first_text_s is not None:
            log.info("answer_streamed", first_text_s=round(relay.first_text_s, 2))
        return answer


def error_answer(query: Query, error: str) -> Answer:
    return Answer.to(query, answer="", status=AnswerStatus.ERROR, error=error[:2000])


def cancelled_answer(query: Query, cancel: QueryCancel, started: bool) -> Answer:
    """The answer event of a cancelled query: readers waiting for it learn why it ended."""
    when = "answering" if started else "before_start"
    metrics.QA_CANCELLED.labels(reason=cancel.reason, when=when).inc()
    metrics.QA_ANSWERS.labels(status=AnswerStatus.CANCELLED.value).inc()
    log.info("query_cancelled", reason=cancel.reason, when=when)
    return Answer.to(query, answer="", status=AnswerStatus.CANCELLED, error=f"cancelled: {cancel.reason}")
