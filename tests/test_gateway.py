"""Validation where events enter: the HTTP gateway (422 for bad input, events produced keyed by user) and the
agents' handlers (anything undecodable on a topic becomes a dead letter and the next record is still processed)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from datetime import UTC, datetime
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from fastapi.testclient import TestClient

from memstream.broker import EmbeddedBroker
from schemas.events import Answer, AnswerStatus, ChatMessage, DeadLetter, MemoryUpdate, Query, StageEvent
from services.container import Services, build_services
from services.llm.scripted import rule_based_llm
from services.settings import Settings
from streams.codec import encode
from streams.gateway.app import create_app
from streams.gateway.client import bearer
from streams.handlers import MemorizeHandler, QAHandler, Record
from streams.topics import TopicNames

T0 = datetime(2024, 3, 2, 10, 0, tzinfo=UTC)


async def read_topic(bootstrap: str, topic: str, count: int, timeout_s: float = 10.0) -> list[tuple[bytes, bytes]]:
    """The first ``count`` records (key, value) of a topic, waiting up to ``timeout_s`` for them."""
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", group_id=None)
    await consumer.start()
    found: list[tuple[bytes, bytes]] = []
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while len(found) < count and loop.time() < deadline:
            for records in (await consumer.getmany(timeout_ms=200)).values():
                found.extend((r.key or b"", r.value or b"") for r in records)
    finally:
        await consumer.stop()
    return found


async def produce(bootstrap: str, topic: str, value: bytes, key: bytes | None = None) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    try:
        await producer.send_and_wait(topic, value, key=key)
    finally:
        await producer.stop()


@pytest.fixture
def gateway(broker: EmbeddedBroker, settings: Settings, key_factory: Callable[..., str]) -> Iterator[TestClient]:
    with TestClient(create_app(settings, broker.bootstrap), headers=bearer(key_factory(settings))) as client:
        yield client


def message(**fields: Any) -> dict[str, Any]:
    return {"user_id": "alice", "speaker": "Anna", "text": "I work at Siemens.", "event_time": T0.isoformat(), **fields}


pytestmark = pytest.mark.server


def test_messages_are_produced_keyed_by_user_with_server_fields(
    gateway: TestClient, broker: EmbeddedBroker, settings: Settings
) -> None:
    body = [message(), message(text="I live in Munich.", ingest_time="2000-01-01T00:00:00Z", event_id="given-1")]
    response = gateway.post("/v1/messages", json=body)
    assert response.status_code == 202, response.text
    accepted = response.json()
    assert accepted["accepted"] == 2
    generated, given = accepted["event_ids"]
    assert generated.startswith("m_") and given == "given-1"
    # the same content again is the same event (a retried POST is a replay, not a new fact)
    assert gateway.post("/v1/messages", json=message()).json()["event_ids"] == [generated]

    records = asyncio.run(read_topic(broker.bootstrap, TopicNames.from_settings(settings).chat, 3))
    assert len(records) == 3
    assert {key for key, _ in records} == {b"alice"}
    events = [ChatMessage.model_validate_json(value) for _, value in records]
    assert [e.event_id for e in events].count(generated) == 2
    assert all(e.ingest_time.year >= 2025 for e in events)  # the server's clock, not the client's
    assert events[0].event_time == T0


INVALID_MESSAGES: list[tuple[Any, str]] = [
    ("not json", "not valid JSON"),
    ([], "non-empty list"),
    (["text"], "message #0 is not a JSON object"),
    ({"user_id": "alice", "speaker": "Anna"}, "text: Field required"),
    (message(text=""), "text: String should have at least 1 character"),
    (message(user_id="not a valid id"), "user_id: String should match pattern"),
    (message(schema_version=2), "schema_version: Input should be 1"),
    (message(colour="red"), "colour: Extra inputs are not permitted"),
    (message(event_time="2024-03-02T10:00:00"), "event_time: Input should have timezone info"),
    ([message(text="valid"), message(speaker="")], "message #1"),
]


def test_invalid_messages_are_422_with_a_clear_message_and_nothing_is_produced(
    gateway: TestClient, broker: EmbeddedBroker, settings: Settings
) -> None:
    for body, detail in INVALID_MESSAGES:
        raw = body if isinstance(body, str) else json.dumps(body)
        response = gateway.post("/v1/messages", content=raw, headers={"content-type": "application/json"})
        assert response.status_code == 422, body
        assert detail in response.json()["detail"], (body, response.json())
    # nothing of a rejected request is produced, not even its valid items: the first record is the marker
    assert gateway.post("/v1/messages", json=message(text="marker")).status_code == 202
    records = asyncio.run(read_topic(broker.bootstrap, TopicNames.from_settings(settings).chat, 1))
    assert [ChatMessage.model_validate_json(v).text for _, v in records] == ["marker"]


def test_documents_and_questions(gateway: TestClient, broker: EmbeddedBroker, settings: Settings) -> None:
    topics = TopicNames.from_settings(settings)
    doc = gateway.post("/v1/documents", json={"user_id": "alice", "title": "CV", "text": "Anna: nurse since 2024."})
    assert doc.status_code == 202, doc.text
    assert gateway.post("/v1/documents", json={"user_id": "alice", "title": "CV"}).status_code == 422
    ((_, raw_doc),) = asyncio.run(read_topic(broker.bootstrap, topics.documents, 1))
    assert json.loads(raw_doc)["document_id"] == doc.json()["event_ids"][0]

    asked = gateway.post("/v1/questions", json={"user_id": "alice", "question": "Where does Anna work?"})
    assert asked.status_code == 202, asked.text
    query_id = asked.json()["query_id"]
    assert gateway.post("/v1/questions", json={"user_id": "alice"}).status_code == 422
    assert gateway.post("/v1/questions", json=[{"user_id": "alice", "question": "?"}]).status_code == 422
    ((key, raw_query),) = asyncio.run(read_topic(broker.bootstrap, topics.queries, 1))
    assert key == b"alice" and Query.model_validate_json(raw_query).query_id == query_id


def test_answers_come_from_the_answers_topic(gateway: TestClient, broker: EmbeddedBroker, settings: Settings) -> None:
    assert gateway.get("/v1/answers/q-1").status_code == 404
    answer = Answer(
        event_id="ans_q-1",
        user_id="alice",
        event_time=T0,
        query_id="q-1",
        trace_id="tr_q-1",
        question="Where does Anna work?",
        answer="At St. Mary's hospital.",
        status=AnswerStatus.ANSWERED,
    )
    asyncio.run(produce(broker.bootstrap, TopicNames.from_settings(settings).answers, encode(answer), b"alice"))
    response = gateway.get("/v1/answers/q-1", params={"wait": 10})
    assert response.status_code == 200
    assert Answer.model_validate(response.json()) == answer


def test_stats_health_and_metrics(gateway: TestClient) -> None:
    stats = gateway.get("/v1/stats/nobody")
    assert stats.status_code == 200, stats.text
    assert stats.json()["user_id"] == "nobody" and stats.json()["theses_valid"] == 0
    assert gateway.get("/v1/stats/not valid").status_code == 422
    health = gateway.get("/healthz")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    gateway.post("/v1/messages", json=message())
    metrics = gateway.get("/metrics")
    assert metrics.status_code == 200
    assert 'memstream_gateway_events_total{kind="chat_message"}' in metrics.text


# -- the agents' side: what arrives on a topic is validated again -----------------------------------------------


class Captured:
    """A Publisher that keeps what it was asked to publish."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes | None, bytes]] = []

    async def publish(self, topic: str, key: bytes | None, value: bytes) -> None:
        self.sent.append((topic, key, value))

    def on(self, topic: str) -> list[dict[str, Any]]:
        return [json.loads(value) for t, _, value in self.sent if t == topic]


@pytest.fixture
async def services(settings: Settings) -> AsyncIterator[Services]:
    built = await build_services(settings, llm=rule_based_llm())
    yield built
    await built.close()


def chat(n: int, text: str, user: str = "alice") -> ChatMessage:
    return ChatMessage(event_id=f"m{n}", user_id=user, event_time=T0, speaker="Anna", text=text)


async def test_garbage_on_the_chat_topic_becomes_a_dead_letter_and_the_batch_goes_on(
    services: Services, settings: Settings
) -> None:
    topics = TopicNames.from_settings(settings)
    published = Captured()
    handler = MemorizeHandler(services.memorize, published, topics)
    future_version = json.loads(chat(2, "x").model_dump_json()) | {"schema_version": 7}
    await handler.handle(
        [
            Record(topics.chat, b"alice", b"\x00\xffgarbage"),
            Record(topics.chat, b"alice", json.dumps(future_version).encode()),
            Record(topics.chat, b"alice", encode(chat(1, "I work at Siemens in Munich."))),
        ]
    )
    letters = [DeadLetter.model_validate(d) for d in published.on(topics.dead_letters)]
    assert [d.reason for d in letters] == ["invalid_event", "invalid_event"]
    assert letters[0].payload.endswith("garbage") and letters[0].user_id is None
    assert "not valid JSON" in letters[0].error
    assert letters[1].user_id == "alice" and letters[1].failed_event_ids == ["m2"]
    assert "schema_version" in letters[1].error
    updates = [MemoryUpdate.model_validate(u) for u in published.on(topics.memory_updates)]
    assert [u.source_event_ids for u in updates] == [["m1"]]
    assert all(key == b"alice" for t, key, _ in published.sent if t == topics.memory_updates)


async def test_a_failing_memorize_turns_its_events_into_dead_letters(settings: Settings) -> None:
    class Broken:
        async def memorize(self, events: Sequence[Any], source_topic: str = "") -> Any:
            raise RuntimeError("store is on fire")

    topics = TopicNames.from_settings(settings)
    published = Captured()
    await MemorizeHandler(Broken(), published, topics).handle(
        [
            Record(topics.chat, b"alice", encode(chat(1, "one"))),
            Record(topics.chat, b"bob", encode(chat(2, "two", "bob"))),
        ]
    )
    letters = [DeadLetter.model_validate(d) for d in published.on(topics.dead_letters)]
    assert [(d.reason, d.user_id, d.failed_event_ids) for d in letters] == [
        ("processing_failed", "alice", ["m1"]),
        ("processing_failed", "bob", ["m2"]),
    ]
    assert "store is on fire" in letters[0].error
    assert ChatMessage.model_validate_json(letters[0].payload).event_id == "m1"  # the event can be replayed


async def test_qa_handler_answers_reports_stages_and_survives_failures(services: Services, settings: Settings) -> None:
    topics = TopicNames.from_settings(settings)
    published = Captured()
    query = Query(event_id="q1", user_id="alice", event_time=T0, question="Where does Anna work?")
    await QAHandler(services.qa, published, topics).handle(Record(topics.queries, b"alice", encode(query)))
    (answer,) = [Answer.model_validate(a) for a in published.on(topics.answers)]
    assert answer.query_id == "q1" and answer.status is not AnswerStatus.ERROR
    assert [StageEvent.model_validate(s).query_id for s in published.on(topics.stages)]  # at least one stage

    class Broken:
        async def answer(self, query: Query, emit: Any = None, on_text: Any = None) -> Answer:
            raise RuntimeError("model crashed")

    failing = Captured()
    handler = QAHandler(Broken(), failing, topics)
    await handler.handle(Record(topics.queries, b"alice", b"{}"))
    await handler.handle(Record(topics.queries, b"alice", encode(query)))
    assert [d["reason"] for d in failing.on(topics.dead_letters)] == ["invalid_event", "processing_failed"]
    (failed,) = [Answer.model_validate(a) for a in failing.on(topics.answers)]
    assert failed.status is AnswerStatus.ERROR and "model crashed" in (failed.error or "")
