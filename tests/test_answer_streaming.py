"""Answers streamed as they are written, and queries cancelled, inside the worker and the gateway's trace store:
the relay that publishes the answer's text, the QA handler that stops a cancelled query's work, and the store that
turns whole texts into deltas for readers.

The routes that carry them to clients (SSE, WebSocket, DELETE) are tested over a real server in
``test_answer_routes.py``; the whole path with workers and the broker in ``test_answer_stream_stack.py``.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

import pytest

from schemas.events import Answer, AnswerStatus, AnswerText, Query, QueryCancel, StageEvent
from services import metrics
from services.observability.traces import TextPiece, TraceStore
from streams.answer_text import TextRelay
from streams.cancels import Cancellations
from streams.codec import decode, encode
from streams.handlers import QAHandler, Record
from streams.topics import TopicNames

T0 = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)
TOPICS = TopicNames(
    *(f"t.{n}" for n in ("chat", "docs", "updates", "queries", "stages", "answers", "dead", "text", "control"))
)


def query(query_id: str = "q1", user_id: str = "ana") -> Query:
    return Query(event_id=query_id, user_id=user_id, event_time=T0, question="Where does Ana work?")


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 5.0) -> None:
    """Wait for ``condition`` with a deadline (yielding to the loop between looks)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s}s"
        await asyncio.sleep(0.01)


class Publisher:
    """Records what the worker publishes; ``gate`` (when set) holds every publish until opened."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes | None, bytes]] = []
        self.gate: asyncio.Event | None = None

    async def publish(self, topic: str, key: bytes | None, value: bytes) -> None:
        if self.gate is not None:
            await self.gate.wait()
        self.sent.append((topic, key, value))

    def texts(self) -> list[AnswerText]:
        return [decode(v, AnswerText) for t, _, v in self.sent if t == TOPICS.answer_text]

    def answers(self) -> list[Answer]:
        return [decode(v, Answer) for t, _, v in self.sent if t == TOPICS.answers]


class Writer:
    """An answerer that writes ``words`` one at a time through ``on_text``, each after ``step`` is released (the
    model decoding); records whether it was cancelled mid-way."""

    def __init__(self, words: list[str], stop_after: int | None = None) -> None:
        self.words = words
        self.stop_after = stop_after  # hang (a slow model) after this many words
        self.written = 0
        self.cancelled = False
        self.calls = 0

    async def answer(
        self,
        query: Query,
        emit: Callable[[StageEvent], Awaitable[None]] | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> Answer:
        self.calls += 1
        try:
            for n in range(1, len(self.words) + 1):
                if self.stop_after is not None and n > self.stop_after:
                    await asyncio.Event().wait()  # decoding the next token, for ever
                if on_text is not None:
                    on_text(" ".join(self.words[:n]))
                self.written = n
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        return Answer.to(query, answer=" ".join(self.words), status=AnswerStatus.ANSWERED)


def record(q: Query) -> Record:
    return Record(TOPICS.queries, q.user_id.encode(), encode(q))


# -- the relay ------------------------------------------------------------------------------------------------------


async def test_the_relay_publishes_each_text_in_order_and_the_last_one_before_it_closes() -> None:
    sent: list[AnswerText] = []

    async def publish(text: AnswerText) -> None:
        sent.append(text)

    relay = TextRelay(query(), publish)
    for text in ("Ana", "Ana works", "Ana works at", "Ana works at St. Mary's"):
        relay(text)
        await until(lambda t=text: bool(sent) and sent[-1].text == t, "published")  # type: ignore[misc]
    await relay.close()
    assert [t.text for t in sent] == ["Ana", "Ana works", "Ana works at", "Ana works at St. Mary's"]
    assert [t.seq for t in sent] == [1, 2, 3, 4]
    assert {t.query_id for t in sent} == {"q1"} and {t.user_id for t in sent} == {"ana"}
    assert relay.first_text_s is not None


async def test_a_slow_broker_gets_the_newest_text_not_every_piece() -> None:
    """Publishing waits for the broker's ack; the model does not wait for the broker: pieces that came meanwhile
    are coalesced into the newest text, still in order, the last one never lost."""
    gate = asyncio.Event()
    sent: list[AnswerText] = []

    async def publish(text: AnswerText) -> None:
        await gate.wait()
        sent.append(text)

    relay = TextRelay(query(), publish)
    words = ["Ana", "works", "as", "a", "nurse", "at", "St.", "Mary's", "hospital"]
    for n in range(1, len(words) + 1):
        relay(" ".join(words[:n]))  # the model goes on while the first publish waits
    gate.set()
    await relay.close()
    texts = [t.text for t in sent]
    assert texts[-1] == " ".join(words) and len(texts) < len(words)
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))  # only ever grows
    assert [t.seq for t in sent] == list(range(1, len(sent) + 1))


# -- the QA handler -------------------------------------------------------------------------------------------------


async def test_the_handler_streams_the_answer_text_before_the_answer() -> None:
    publisher = Publisher()
    handler = QAHandler(Writer(["Ana", "works", "as", "a", "nurse"]), publisher, TOPICS)
    await handler.handle(record(query()))
    texts = publisher.texts()
    assert [t.text for t in texts][-1] == "Ana works as a nurse"
    assert all(b.text.startswith(a.text) for a, b in itertools.pairwise(texts))
    last_text = max(i for i, (t, _, _) in enumerate(publisher.sent) if t == TOPICS.answer_text)
    answer_at = next(i for i, (t, _, _) in enumerate(publisher.sent) if t == TOPICS.answers)
    assert last_text < answer_at
    (answer,) = publisher.answers()
    assert answer.status is AnswerStatus.ANSWERED and answer.answer == "Ana works as a nurse"


async def test_a_cancel_stops_the_answering_at_once_and_the_answer_says_cancelled() -> None:
    publisher = Publisher()
    cancels = Cancellations()
    writer = Writer(["Ana", "works", "as", "a", "nurse", "at", "St.", "Mary's"], stop_after=2)
    handler = QAHandler(writer, publisher, TOPICS, cancels)
    before = metrics.QA_CANCELLED.labels(reason="deleted", when="answering")._value.get()
    handling = asyncio.create_task(handler.handle(record(query())))
    await until(lambda: writer.written == 2, "the first words written")
    assert cancels.cancel(QueryCancel.of("q1", "ana", "deleted")) is True
    await asyncio.wait_for(handling, 5)
    assert writer.cancelled and writer.written == 2
    (answer,) = publisher.answers()
    assert answer.status is AnswerStatus.CANCELLED and answer.error == "cancelled: deleted"
    assert answer.answer == ""  # the text so far was a preview, not an answer
    assert metrics.QA_CANCELLED.labels(reason="deleted", when="answering")._value.get() == before + 1


async def test_a_query_cancelled_before_it_is_taken_up_is_not_answered() -> None:
    publisher = Publisher()
    cancels = Cancellations()
    writer = Writer(["never"])
    cancels.cancel(QueryCancel.of("q1", "ana", "disconnected"))
    await QAHandler(writer, publisher, TOPICS, cancels).handle(record(query()))
    assert writer.calls == 0
    (answer,) = publisher.answers()
    assert answer.status is AnswerStatus.CANCELLED and answer.error == "cancelled: disconnected"


async def test_a_cancel_for_another_query_changes_nothing() -> None:
    publisher = Publisher()
    cancels = Cancellations()
    handler = QAHandler(Writer(["Ana", "works"]), publisher, TOPICS, cancels)
    assert cancels.cancel(QueryCancel.of("q-other", "ana", "deleted")) is False
    await handler.handle(record(query()))
    (answer,) = publisher.answers()
    assert answer.status is AnswerStatus.ANSWERED


async def test_a_worker_stopping_mid_answer_stops_the_answering_too() -> None:
    """The agent itself cancelled (shutdown): the answering task goes with it, nothing is published as answered."""
    publisher = Publisher()
    writer = Writer(["Ana", "works", "as", "a", "nurse"], stop_after=1)
    handling = asyncio.create_task(QAHandler(writer, publisher, TOPICS).handle(record(query())))
    await until(lambda: writer.written == 1, "a word written")
    handling.cancel()
    with pytest.raises(asyncio.CancelledError):
        await handling
    await until(lambda: writer.cancelled, "the answering stopped")
    assert publisher.answers() == []


def test_cancellations_keep_the_newest() -> None:
    cancels = Cancellations(capacity=2)
    for n in range(3):
        cancels.cancel(QueryCancel.of(f"q{n}", "ana", "deleted"))
    assert cancels.cancelled("q0") is None and cancels.cancelled("q2") is not None


# -- the gateway's trace store --------------------------------------------------------------------------------------


def text(seq: int, value: str, query_id: str = "q1") -> AnswerText:
    return AnswerText(
        event_id=f"txt_{query_id}_{seq}", user_id="ana", event_time=T0, query_id=query_id, seq=seq, text=value
    )


def test_the_store_keeps_what_each_text_added() -> None:
    store = TraceStore()
    store.add_query(query())
    assert store.add_text(text(1, "Ana")) == TextPiece("Ana")
    assert store.add_text(text(2, "Ana works")) == TextPiece(" works")
    assert store.add_text(text(2, "Ana works")) is None  # redelivered
    assert store.add_text(text(1, "Ana")) is None  # older than what is held
    assert store.add_text(text(4, "She")) == TextPiece("She", reset=True)  # a retried call started again
    trace = store.get("q1")
    assert trace is not None and trace.answer_text == "She" and trace.status == "waiting"
    store.add_answer(Answer.to(query(), answer="She works at St. Mary's.", status=AnswerStatus.ANSWERED))
    assert store.add_text(text(5, "She works")) is None  # after the answer: the answer is the text
    trace = store.get("q1")
    assert trace is not None and trace.answer_text == "She works at St. Mary's."


async def test_a_follower_gets_the_text_pieces_then_the_answer() -> None:
    store = TraceStore()
    seen: list[str] = []

    async def follow() -> None:
        async for update in store.follow("q1", heartbeat_s=5):
            assert update is not None
            seen.append(update.kind)

    following = asyncio.create_task(follow())
    store.add_query(query())
    store.add_text(text(1, "Ana"))
    store.add_text(text(2, "Ana works"))
    store.add_answer(Answer.to(query(), answer="Ana works.", status=AnswerStatus.ANSWERED))
    await asyncio.wait_for(following, 5)
    assert seen == ["query", "text", "text", "answer"]
