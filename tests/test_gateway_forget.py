"""Forgetting at the gateway: ``POST /v1/forget`` puts a tombstone on the topics (ids made by the server, topics by
scope, the write scope and the user checked, rate limited), ``GET /v1/forget/{id}`` follows it, and every
``MemoryForgotten`` purges the gateway's own copies: answers, traces, dead letters, outbox rows. Records read after
the erasure (a restarted gateway reads its topics again) are refused too. The worker side is faked: the tests
publish the ``MemoryForgotten`` a worker would."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from aiokafka.structs import ConsumerRecord
from fastapi import FastAPI
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from memstream.broker import EmbeddedBroker, free_port
from memstream.cli import app as cli
from schemas.events import (
    Answer,
    AnswerStatus,
    ChatMessage,
    DeadLetter,
    Document,
    EvidenceTriplet,
    Forget,
    ForgetScope,
    MemoryForgotten,
    Query,
    StageEvent,
)
from services.logging import configure_logging
from services.observability.traces import TraceStore
from services.settings import Settings
from streams.codec import encode
from streams.gateway.answers import AnswerBook
from streams.gateway.app import create_app
from streams.gateway.client import bearer
from streams.gateway.dead_letters import DeadLetterBook, DeadLetterFeed
from streams.gateway.forget import Forgets, ForgetStatus, Purger
from streams.outbox import Outbox, OutboxRecord, OutboxRelay
from streams.topics import TopicNames
from tests.test_auth import Keys as TenantKeys
from tests.test_auth import wait_until
from tests.test_gateway import produce, read_topic

T0 = datetime(2024, 3, 2, 10, 0, tzinfo=UTC)
T1 = T0 + timedelta(hours=1)  # the erasure commits
T2 = T0 + timedelta(hours=2)  # after it: new memory
CHAT, DOCS = "memstream.chat", "memstream.documents"


def answer(query_id: str, *evidence: str, user: str = "alice", at: datetime = T0) -> Answer:
    return Answer(
        event_id=f"ans_{query_id}",
        user_id=user,
        event_time=at,
        ingest_time=at,
        query_id=query_id,
        trace_id=f"tr_{query_id}",
        question="What is my locker code?",
        answer="4711",
        status=AnswerStatus.ANSWERED,
        evidence=[EvidenceTriplet(id=e, text=f"fact {e}") for e in evidence],
    )


def stage(query_id: str, detail: dict[str, object], user: str = "alice", at: datetime = T0) -> StageEvent:
    return StageEvent(
        event_id=f"st_{query_id}_{len(detail)}",
        user_id=user,
        event_time=at,
        query_id=query_id,
        trace_id=f"tr_{query_id}",
        stage=7,
        stage_name="filter",
        started_at=at,
        duration_ms=1.0,
        detail=detail,
    )


def chat(event_id: str, conversation: str = "c1", user: str = "alice") -> ChatMessage:
    return ChatMessage(
        event_id=event_id, user_id=user, event_time=T0, conversation_id=conversation, speaker="Anna", text="4711"
    )


def letter(event: ChatMessage | Document, topic: str = CHAT, at: datetime = T0) -> DeadLetter:
    return DeadLetter(
        event_id=f"dl_{event.event_id}" + ("" if event.user_id == "alice" else f"_{event.user_id}"),
        user_id=event.user_id,
        source_topic=topic,
        reason="extraction_failed",
        error="no",
        payload=event.model_dump_json(),
        failed_event_ids=[event.event_id],
        ingest_time=at,
    )


def forgotten(
    scope: ForgetScope,
    target: str | None,
    *,
    forget_id: str = "f_1",
    user: str = "alice",
    topic: str = CHAT,
    removed: tuple[str, ...] = ("r_1",),
    sources: tuple[str, ...] = ("m_1",),
    at: datetime = T1,
) -> MemoryForgotten:
    return MemoryForgotten(
        event_id=forget_id,
        user_id=user,
        event_time=at,
        forget_id=forget_id,
        source_topic=topic,
        scope=scope,
        target=target,
        removed_all=scope is ForgetScope.USER,
        source_event_ids=list(sources),
        removed_ids=list(removed) if scope is not ForgetScope.USER else [],
        vertices_removed=3,
        edges_removed=2,
        theses_restored=1,
        cache_entries_removed=4,
        committed_at=at,
    )


def record(value: DeadLetter, offset: int = 0) -> ConsumerRecord[bytes, bytes]:
    raw = encode(value)
    return ConsumerRecord("memstream.dead-letters", 0, offset, 0, 0, None, raw, None, 0, len(raw), ())


class Books:
    """The gateway's copies, guarded by one record of forgets, purged by one purger (no broker: nothing is started)."""

    def __init__(self, settings: Settings, outbox: Outbox | None = None) -> None:
        self.topics = TopicNames.from_settings(settings)
        self.answers = AnswerBook()
        self.traces = TraceStore()
        self.dead_letters = DeadLetterBook()
        self.feed = DeadLetterFeed("localhost:1", self.topics.dead_letters, self.dead_letters)
        self.forgets = Forgets(self.topics)
        self.purger = Purger(self.forgets, self.answers, self.dead_letters, outbox, self.traces)
        self.forgets.guard(self.answers, self.feed, self.traces)

    async def hold(self, *answers: Answer) -> None:
        for a in answers:
            await self.answers.put(a)
            self.traces.add_answer(a)

    def letters(self) -> set[str]:
        return {e.letter.event_id for e in self.dead_letters.select()}


# -- the purge, without a broker ------------------------------------------------------------------------------------


async def test_a_forget_purges_the_answers_traces_and_dead_letters_built_from_it(settings: Settings) -> None:
    books = Books(settings)
    await books.hold(
        answer("q1", "r_1", "r_5"),  # cites a removed edge
        answer("q2", "r_2"),  # does not
        answer("q3", "r_1", user="bob"),  # another user's memory: the same id means nothing
        answer("q4", "r_1", at=T2),  # made after the erasure (the user said it again): new memory
    )
    books.traces.add_stage(stage("q5", {"evidence": [{"id": "r_1", "text": "fact"}]}))  # a trace citing it
    books.traces.add_stage(stage("q6", {"evidence": ["r_2"]}))
    for dead in (
        letter(chat("m_1", "c9")),  # its memory was erased (a source event)
        letter(chat("m_7", "c1")),  # in the forgotten conversation
        letter(chat("m_8", "c2")),  # in another one
        letter(chat("m_1", "c1", user="bob")),  # bob's: neither the event id nor the conversation is alice's
        letter(chat("m_9", "c1"), at=T2),  # after the erasure: new
    ):
        books.dead_letters.add(dead)

    purged = await books.purger.apply(forgotten(ForgetScope.CONVERSATION, "c1"))

    assert purged == {"answer": 1, "trace": 2, "dead_letter": 2, "outbox": 0}
    assert [q for q in ("q1", "q2", "q3", "q4") if books.answers.get(q)] == ["q2", "q3", "q4"]
    assert {t.query_id for t in books.traces.traces()} == {"q2", "q3", "q4", "q6"}
    assert books.letters() == {"dl_m_8", "dl_m_1_bob", "dl_m_9"}

    # what arrives after the erasure (a restarted gateway reading its topics again) is refused the same way
    await books.hold(answer("q1", "r_1", "r_5"), answer("q7", "r_1"), answer("q8", "r_2"), answer("q9", "r_1", at=T2))
    assert [q for q in ("q1", "q7", "q8", "q9") if books.answers.get(q)] == ["q8", "q9"]
    books.traces.add_stage(stage("q1", {"evidence": []}))  # a forgotten query's later stage does not bring it back
    assert books.traces.get("q1") is None and books.traces.get("q7") is None
    told: list[DeadLetter] = []

    async def listener(dead: DeadLetter) -> None:
        told.append(dead)

    books.feed.listeners.append(listener)
    again = [letter(chat("m_1", "c9")), letter(chat("m_7", "c1")), letter(chat("m_10", "c3"))]
    await books.feed.handle({None: [record(d, n) for n, d in enumerate(again)]})  # type: ignore[dict-item]
    assert [d.event_id for d in told] == ["dl_m_10"]  # the outbox is not told of refused ones either
    assert "dl_m_1" not in books.letters() and "dl_m_7" not in books.letters()


async def test_forgetting_a_user_purges_everything_of_theirs_from_before_and_completes_on_both_topics(
    settings: Settings,
) -> None:
    books = Books(settings)
    topics = books.topics
    accepted = books.forgets.sent(Forget(event_id="f_u", user_id="alice", event_time=T1, scope=ForgetScope.USER))
    assert accepted.topics == [topics.chat, topics.documents]
    await books.hold(answer("q1"), answer("q2", "r_9", at=T2), answer("q3", user="bob"))
    books.traces.add_query(Query(event_id="q4", user_id="alice", event_time=T0, ingest_time=T0, question="?"))
    document = Document(event_id="d_1", user_id="alice", event_time=T0, document_id="cv", text="CV")
    books.dead_letters.add(letter(document, DOCS))

    first = forgotten(ForgetScope.USER, None, forget_id="f_u", topic=topics.chat, sources=("m_1", "m_2"))
    await books.purger.apply(first)
    assert books.forgets.get("f_u") is not None and not books.forgets.get("f_u").complete  # type: ignore[union-attr]
    assert [q for q in ("q1", "q2", "q3") if books.answers.get(q)] == ["q2", "q3"]
    assert {t.query_id for t in books.traces.traces()} == {"q2", "q3"}
    assert books.letters() == set()
    books.traces.add_query(Query(event_id="q5", user_id="alice", event_time=T0, ingest_time=T0, question="?"))
    assert books.traces.get("q5") is None  # asked before the erasure: refused when read again

    second = forgotten(ForgetScope.USER, None, forget_id="f_u", topic=topics.documents, sources=("d_1", "m_1"))
    await books.purger.apply(second)
    entry = books.forgets.get("f_u")
    assert entry is not None and entry.complete
    done = await books.forgets.wait_done("f_u", 0.01)
    assert done is entry
    status = ForgetStatus.of(entry)
    assert status.status == "done" and status.removed_all and status.topics_done == [topics.chat, topics.documents]
    assert (status.source_events, status.vertices_removed, status.cache_entries_removed) == (3, 6, 8)


async def test_one_record_of_forgets_shows_their_status_and_refuses_copies_until_it_lets_the_oldest_go(
    settings: Settings,
) -> None:
    forgets = Forgets(TopicNames.from_settings(settings), capacity=2)
    answers = AnswerBook()
    forgets.guard(answers, DeadLetterFeed("localhost:1", "dl", DeadLetterBook()), None)
    first, _, completed = forgets.record(forgotten(ForgetScope.MESSAGE, "m_1", forget_id="f_1", removed=("r_1",)))
    assert completed and forgets.get("f_1") is not None and forgets.of_user("alice") == [first]
    assert forgets.forgets_answer(answer("q1", "r_1")) and not forgets.forgets_answer(answer("q2", "r_1", user="bob"))

    forgets.sent(Forget(event_id="f_2", user_id="alice", event_time=T1, scope=ForgetScope.USER))  # still pending
    forgets.record(forgotten(ForgetScope.MESSAGE, "m_3", forget_id="f_3", removed=("r_3",)))
    # the oldest forget went, status and refusal together: copies of its memory are no longer refused
    assert forgets.get("f_1") is None and [e.announced.forget_id for e in forgets.of_user("alice")] == ["f_3"]
    assert not forgets.forgets_answer(answer("q3", "r_1")) and forgets.forgets_answer(answer("q4", "r_3"))
    pending = forgets.get("f_2")
    assert pending is not None and not pending.complete and len(forgets) == 2


async def test_a_followed_trace_that_is_forgotten_ends_its_stream(settings: Settings) -> None:
    books = Books(settings)
    books.traces.add_stage(stage("q1", {"evidence": ["r_3"]}))
    seen: list[str] = []
    reading = asyncio.Event()

    async def follow() -> None:
        async for update in books.traces.follow("q1", heartbeat_s=5.0):
            if update is not None:
                seen.append(update.kind)
                reading.set()

    follower = asyncio.create_task(follow())
    await asyncio.wait_for(reading.wait(), 5.0)  # the follower has read what there is and waits for more
    await books.purger.apply(forgotten(ForgetScope.MESSAGE, "m_1", removed=("r_3",)))
    await asyncio.wait_for(follower, 5.0)  # ended, not left waiting for an answer that will never come
    assert seen == ["stage"] and books.traces.get("q1") is None


async def test_the_outbox_loses_the_forgotten_events_rows_but_keeps_what_came_after(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path / "outbox.sqlite")
    await outbox.open()
    try:

        def row(event: ChatMessage | Forget, event_id: str | None = None) -> OutboxRecord:
            return OutboxRecord(CHAT, event.user_id, event_id or event.event_id, encode(event))

        tombstone = Forget(event_id="f_1", user_id="alice", event_time=T1, scope="conversation", target="c1")
        await outbox.add([row(chat("m_1")), row(chat("m_2", "c2")), row(chat("m_4")), row(chat("m_5", user="bob"))])
        await outbox.mark_dead("alice", ["m_4"], "extraction_failed")  # dead-lettered: never applied, still on disk
        await outbox.add([row(tombstone, "f_1@" + CHAT), row(chat("m_3"))])  # m_3: said again after the forget
        purged = await purger_with(tmp_path, outbox).apply(forgotten(ForgetScope.CONVERSATION, "c1", sources=("m_1",)))
        left = {(e.record.user_id, e.record.event_id) for e in await outbox.entries(include_dead=True)}
        assert left == {("alice", "m_2"), ("alice", "m_3"), ("bob", "m_5")}
        assert purged["outbox"] == 3  # m_1, m_4 and the tombstone's own row

        # and the relay's own pruning: the worker records forgotten events as applied, so their rows go too
        await outbox.add([row(chat("m_6"))])
        relay = OutboxRelay(outbox, publish=_never, applied=_applied({"m_6", "m_3"}))
        assert await relay.prune() == 2
        left = {e.record.event_id for e in await outbox.entries(include_dead=True)}
        assert left == {"m_2", "m_5"}
    finally:
        await outbox.close()


def purger_with(tmp_path: Path, outbox: Outbox) -> Purger:
    settings = Settings(_env_file=None, data_dir=tmp_path)  # type: ignore[call-arg]
    topics = TopicNames.from_settings(settings)
    return Purger(Forgets(topics), AnswerBook(), DeadLetterBook(), outbox, TraceStore())


async def _never(records: Any) -> None:
    raise AssertionError("nothing is published by a prune")


def _applied(ids: set[str]) -> Callable[[str, Any], Any]:
    async def applied(user_id: str, event_ids: Any) -> set[str]:
        return set(event_ids) & ids

    return applied


# -- the routes, on a real embedded broker --------------------------------------------------------------------------


class Keys(TenantKeys):
    def __init__(self, settings: Settings, make: Callable[..., str]) -> None:
        super().__init__(settings, make)
        self.alice_asker = make(settings, ["alice"], ["ask"])


@pytest.fixture
def keys(settings: Settings, key_factory: Callable[..., str]) -> Keys:
    return Keys(settings, key_factory)


@pytest.fixture
def gateway(broker: EmbeddedBroker, settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings, broker.bootstrap)) as client:
        yield client


def publish(broker: EmbeddedBroker, topic: str, *events: Any) -> None:
    for event in events:
        asyncio.run(produce(broker.bootstrap, topic, encode(event), (event.user_id or "").encode()))


@pytest.mark.server
def test_forget_puts_tombstones_with_server_made_ids_on_the_topics_of_what_it_forgets(
    gateway: TestClient, broker: EmbeddedBroker, settings: Settings, keys: Keys
) -> None:
    topics = TopicNames.from_settings(settings)
    alice = bearer(keys.alice)
    made: dict[str, dict[str, Any]] = {}
    for scope, target in (("message", "m_1"), ("document", "cv"), ("conversation", "c1"), ("user", None)):
        body = {"scope": scope, **({"target": target} if target else {})}  # a one-user key fills in the user
        response = gateway.post("/v1/forget", json=body, headers=alice)
        assert response.status_code == 202, response.text
        made[scope] = response.json()
        assert made[scope]["forget_id"].startswith("f_") and len(made[scope]["forget_id"]) >= 32
    again = gateway.post("/v1/forget", json={"scope": "message", "target": "m_1"}, headers=alice).json()
    assert again["forget_id"] != made["message"]["forget_id"]  # every request a new, unguessable id
    assert made["message"]["topics"] == made["conversation"]["topics"] == [topics.chat]
    assert made["document"]["topics"] == [topics.documents]
    assert made["user"]["topics"] == [topics.chat, topics.documents]

    on_chat = [(k, Forget.model_validate_json(v)) for k, v in asyncio.run(read_topic(broker.bootstrap, topics.chat, 4))]
    on_docs = [
        (k, Forget.model_validate_json(v)) for k, v in asyncio.run(read_topic(broker.bootstrap, topics.documents, 2))
    ]
    assert {k for k, _ in on_chat + on_docs} == {b"alice"}
    assert [f.scope for _, f in on_chat] == ["message", "conversation", "user", "message"]
    assert [(f.scope, f.event_id) for _, f in on_docs] == [
        ("document", made["document"]["forget_id"]),
        ("user", made["user"]["forget_id"]),  # the same forget id on both topics
    ]
    assert on_chat[2][1].event_id == made["user"]["forget_id"]

    status = gateway.get(f"/v1/forget/{made['message']['forget_id']}", headers=bearer(keys.alice_reader))
    assert status.status_code == 200 and status.json()["status"] == "pending"
    # another tenant cannot learn whether the id exists: the same 404 as for an unknown id
    assert gateway.get(f"/v1/forget/{made['message']['forget_id']}", headers=bearer(keys.bob)).status_code == 404
    assert gateway.get("/v1/forget/f_unknown", headers=alice).status_code == 404


INVALID_FORGETS: list[tuple[Any, str]] = [
    ({"user_id": "alice", "scope": "message"}, "a message, document or conversation forget names one"),
    ({"user_id": "alice", "scope": "user", "target": "x"}, "a user forget names no target"),
    ({"user_id": "alice", "scope": "everything"}, "scope: Input should be"),
    ({"user_id": "alice", "scope": "message", "target": "has space"}, "target: String should match pattern"),
    ({"user_id": "alice", "scope": "user", "event_id": "f_mine"}, "not event_id"),
    ({"scope": "user"}, "user_id: Field required"),
    ([{"user_id": "alice", "scope": "user"}], "expected a JSON object"),
]


@pytest.mark.server
def test_invalid_forgets_are_refused_with_a_clear_message(gateway: TestClient, keys: Keys) -> None:
    admin = bearer(keys.admin)
    for body, detail in INVALID_FORGETS:
        response = gateway.post("/v1/forget", json=body, headers=admin)
        assert response.status_code == 422, (body, response.text)
        assert detail in response.json()["detail"], (body, response.json())
    broken = gateway.post("/v1/forget", content=b"{", headers={**admin, "content-type": "application/json"})
    assert broken.status_code == 422 and "JSON" in broken.json()["detail"]
    assert gateway.post("/v1/forget", content=b"x", headers={**admin, "content-type": "text/plain"}).status_code == 415
    assert len(gateway.app.state.forgets) == 0  # type: ignore[attr-defined]


@pytest.mark.server
def test_forget_needs_the_write_scope_for_that_user_and_is_rate_limited(
    broker: EmbeddedBroker, settings_factory: Callable[..., Settings], data_dir: Path, key_factory: Callable[..., str]
) -> None:
    settings = settings_factory(data_dir, rate_writes_per_min=2)
    keys = Keys(settings, key_factory)
    body = {"user_id": "alice", "scope": "user"}
    with TestClient(create_app(settings, broker.bootstrap)) as gateway:
        assert gateway.post("/v1/forget", json=body).status_code == 401
        assert gateway.get("/v1/forget/f_x").status_code == 401
        for other in (keys.bob, keys.alice_reader, keys.alice_asker):
            assert gateway.post("/v1/forget", json=body, headers=bearer(other)).status_code == 403
        assert gateway.post("/v1/forget", json={"scope": "user"}, headers=bearer(keys.admin)).status_code == 422
        statuses = [gateway.post("/v1/forget", json=body, headers=bearer(keys.alice)).status_code for _ in range(3)]
        assert statuses == [202, 202, 429]
        assert len(gateway.app.state.forgets) == 2  # type: ignore[attr-defined]


@pytest.mark.server
def test_a_forget_is_done_once_the_worker_announced_it_and_the_gateway_shows_nothing_of_it(
    gateway: TestClient, broker: EmbeddedBroker, settings: Settings, keys: Keys
) -> None:
    topics = TopicNames.from_settings(settings)
    alice = bearer(keys.alice)
    publish(broker, topics.answers, answer("q_kept", "r_2"), answer("q_gone", "r_1", "r_2"))
    wait_until(lambda: gateway.get("/v1/answers/q_gone", headers=alice).status_code == 200, "the answer")
    wait_until(lambda: gateway.get("/v1/traces/q_gone", headers=alice).status_code == 200, "its trace")
    forget_id = gateway.post("/v1/forget", json={"scope": "message", "target": "m_1"}, headers=alice).json()[
        "forget_id"
    ]
    # the worker erased m_1's memory (edge r_1 with it) and announces it; a memory_update is skipped
    publish(
        broker,
        topics.memory_updates,
        forgotten(ForgetScope.MESSAGE, "m_1", forget_id=forget_id, topic=topics.chat, at=datetime.now(UTC)),
    )
    status = gateway.get(f"/v1/forget/{forget_id}", params={"wait": 15}, headers=alice).json()
    assert status["status"] == "done", status
    assert (status["source_events"], status["vertices_removed"], status["edges_removed"]) == (1, 3, 2)
    assert gateway.get("/v1/answers/q_gone", headers=alice).status_code == 404
    assert gateway.get("/v1/traces/q_gone", headers=alice).status_code == 404
    assert gateway.get("/v1/answers/q_kept", headers=alice).status_code == 200
    # a dead letter of the forgotten message read after the erasure is not kept (a replay would bring it back)
    publish(broker, topics.dead_letters, letter(chat("m_1")), letter(chat("m_marker")))
    wait_until(lambda: gateway.get("/v1/dead-letters", headers=alice).json()["total"] >= 1, "the marker's dead letter")
    listed = [d["event_id"] for d in gateway.get("/v1/dead-letters", headers=alice).json()["dead_letters"]]
    assert listed == ["dl_m_marker"]


# -- the CLI ----------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def served(app: FastAPI) -> Iterator[str]:
    """The app behind a real HTTP server on a free port, in a thread, for the CLI to call."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, lifespan="on"))
    thread = threading.Thread(target=server.run, name="gateway", daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, "the gateway to listen", 30.0)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30.0)


def run_cli(*args: str, code: int = 0, stdin: str | None = None) -> Any:
    try:
        result = CliRunner().invoke(cli, list(args), input=stdin)
    finally:
        configure_logging("INFO", json=True)  # the command configured logging onto the runner's closed stderr
    assert result.exit_code == code, f"{args}: {result.output}"
    return result


@pytest.mark.server
def test_the_cli_forgets_and_waits_for_the_erasure(broker: EmbeddedBroker, settings: Settings, keys: Keys) -> None:
    topics = TopicNames.from_settings(settings)
    app = create_app(settings, broker.bootstrap)

    def worker() -> None:
        """The worker's part: read the tombstone, announce its erasure."""
        (_, raw), *_ = asyncio.run(read_topic(broker.bootstrap, topics.chat, 1, timeout_s=30.0))
        tombstone = Forget.model_validate_json(raw)
        publish(
            broker,
            topics.memory_updates,
            forgotten(tombstone.scope, tombstone.target, forget_id=tombstone.event_id, at=datetime.now(UTC)),
        )

    with served(app) as url:
        run_cli("forget", "alice", "--url", url, "--key", keys.alice, code=2)  # nothing named
        run_cli("forget", "alice", "--message", "m_1", "--all", "--url", url, "--key", keys.alice, code=2)
        refused = run_cli("forget", "alice", "--all", "--url", url, "--key", keys.alice, stdin="n\n", code=1)
        assert "Aborted" in refused.output and len(app.state.forgets) == 0
        run_cli("forget", "bob", "--message", "m_1", "--url", url, "--key", keys.alice, code=1)  # not alice's key's
        fake = threading.Thread(target=worker, daemon=True)
        fake.start()
        result = run_cli("forget", "alice", "--message", "m_1", "--wait", "30", "--url", url, "--key", keys.alice)
        fake.join(30.0)
        assert "accepted: message m_1" in result.output
        assert "done: the memory of 1 event(s) erased, 3 vertices and 2 edges removed" in result.output
        as_json = run_cli("forget", "alice", "--all", "--yes", "--json", "--url", url, "--key", keys.alice).stdout
        assert json.loads(as_json)["topics"] == [topics.chat, topics.documents]
