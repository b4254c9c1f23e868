"""Dead letters an operator can see and replay: the gateway's book of the dead-letter topic (list with filters,
status dead/replayed), the replay route (the original event, validated again, back on its source topic with the
same id and key), the `memstream dead-letters` commands, and the `up --demo` progress and failure report.

The pipeline tests run a real broker, worker and gateway with the rule-based scripted LLM, which rejects (answers
with invalid JSON) every extraction whose input holds a marker listed in a "poison" file: the test decides when
the model gets better by editing that file.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from typer.testing import CliRunner

from memstream.broker import EmbeddedBroker
from memstream.cli import REPLAY_HINT, _demo
from memstream.cli import app as cli
from memstream.runtime import Stack
from schemas.events import ChatMessage, DeadLetter, Document
from services.llm.scripted import ScriptedLLM, rule_based_llm
from services.logging import configure_logging
from services.ports import LLMRequest
from services.settings import Settings
from streams.codec import encode
from streams.gateway.app import create_app
from streams.gateway.client import GatewayClient, bearer
from streams.gateway.dead_letters import DeadLetterBook, DeadLetterStatus
from streams.topics import TopicNames, ensure_topics

T0 = datetime(2024, 3, 2, 10, 0, tzinfo=UTC)
T1 = T0 + timedelta(hours=1)

# -- the worker's LLM (MEMSTREAM_SCRIPTED_LLM points here) ----------------------------------------------------------

POISON_FILE_ENV = "MEMSTREAM_TEST_POISON_FILE"


def poisoned_llm() -> ScriptedLLM:
    """The rule-based LLM, except that an extraction whose input holds a line of ``$MEMSTREAM_TEST_POISON_FILE``
    gets invalid JSON back (every attempt, retries too: the feedback follows the input)."""
    llm = rule_based_llm()
    extract = llm.responders["extract"]
    poison_file = Path(os.environ[POISON_FILE_ENV])

    def rejecting(request: LLMRequest) -> str | dict[str, Any]:
        markers = [m for m in poison_file.read_text().splitlines() if m.strip()] if poison_file.exists() else []
        if any(marker in message.content for marker in markers for message in request.messages):
            return "sorry, this is not JSON"
        return extract(request)

    llm.responders["extract"] = rejecting
    return llm


# -- helpers --------------------------------------------------------------------------------------------------------


def wait_for(
    condition: Callable[[], Any], what: str, timeout_s: float = 30.0, check: Callable[[], None] = lambda: None
) -> Any:
    """Poll ``condition`` until it returns something truthy (returned), failing at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        check()
        if result := condition():
            return result
        assert time.monotonic() < deadline, f"not within {timeout_s}s: {what}"
        time.sleep(0.05)


def chat(event_id: str, text: str, user: str = "alice") -> ChatMessage:
    return ChatMessage(event_id=event_id, user_id=user, event_time=T0, speaker="Anna", text=text, ingest_time=T0)


def letter(
    event: ChatMessage | Document | None,
    topic: str,
    reason: str = "extraction_failed",
    *,
    dl_id: str | None = None,
    payload: str | None = None,
    user: str | None = None,
    at: datetime = T0,
) -> DeadLetter:
    return DeadLetter(
        event_id=dl_id or f"dl_{event.event_id if event else 'garbage'}",
        user_id=user or (event.user_id if event else None),
        source_topic=topic,
        reason=reason,
        error=f"{reason}: the model said no",
        payload=payload if payload is not None else (event.model_dump_json() if event else ""),
        failed_event_ids=[event.event_id] if event else [],
        attempts=3,
        ingest_time=at,
    )


async def produce_all(bootstrap: str, topic: str, letters: list[DeadLetter]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        for item in letters:
            await producer.send_and_wait(topic, encode(item), key=(item.user_id or "").encode() or None)
    finally:
        await producer.stop()


async def read_topic(bootstrap: str, topic: str, count: int, timeout_s: float = 10.0) -> list[tuple[bytes, bytes]]:
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", group_id=None)
    await consumer.start()
    found: list[tuple[bytes, bytes]] = []
    try:
        deadline = time.monotonic() + timeout_s
        while len(found) < count and time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=200)).values():
                found.extend((r.key or b"", r.value or b"") for r in records)
    finally:
        await consumer.stop()
    return found


def listed(client: TestClient, **params: Any) -> dict[str, Any]:
    response = client.get("/v1/dead-letters", params=params)
    assert response.status_code == 200, response.text
    page: dict[str, Any] = response.json()
    return page


def run_cli(*args: str, code: int = 0) -> Any:
    try:
        result = CliRunner().invoke(cli, list(args))
    finally:
        configure_logging("INFO", json=True)  # the command configured logging onto the runner's closed stderr
    assert result.exit_code == code, f"{args}: {result.output}"
    return result


# -- the book, without a broker -------------------------------------------------------------------------------------


def test_the_book_keeps_the_latest_record_and_the_status() -> None:
    book = DeadLetterBook(capacity=3)
    a, b = chat("a", "one"), chat("b", "two", user="bob")
    book.add(letter(a, "memstream.chat"))
    book.add(letter(b, "memstream.chat", "store_failed", at=T1))
    assert [e.letter.event_id for e in book.select()] == ["dl_b", "dl_a"]  # newest first
    assert [e.letter.event_id for e in book.select(user_id="alice")] == ["dl_a"]
    assert [e.letter.event_id for e in book.select(reason="store_failed")] == ["dl_b"]

    entry = book.get("dl_a")
    assert entry is not None and entry.status is DeadLetterStatus.DEAD
    entry.status, entry.replayed_at = DeadLetterStatus.REPLAYED, T0  # what a replay does
    assert book.select(status=DeadLetterStatus.DEAD)[0].letter.event_id == "dl_b"
    again = book.add(letter(a, "memstream.chat", at=T1 + timedelta(minutes=5)))  # it failed again
    assert again is entry and entry.status is DeadLetterStatus.DEAD and entry.records == 2
    assert entry.letter.ingest_time == T1 + timedelta(minutes=5) and entry.first_dead_lettered_at == T0
    assert book.select()[0] is entry  # the latest record makes it the newest

    # dead letters are named by their own id or by the id of the event that failed
    found, unknown = book.resolve(["a", "dl_b", "nope", "dl_a"])
    assert [e.letter.event_id for e in found] == ["dl_a", "dl_b"] and unknown == ["nope"]

    for n in range(3):  # at capacity the oldest go, and so do their event ids
        book.add(letter(chat(f"c{n}", "x"), "memstream.chat"))
    assert len(book) == 3 and book.get("dl_b") is None
    assert book.resolve(["b"]) == ([], ["b"])


# -- the gateway: list and replay (real broker) ---------------------------------------------------------------------


@pytest.fixture
def topics(settings: Settings) -> TopicNames:
    return TopicNames.from_settings(settings)


@pytest.fixture
def with_letters(
    broker: EmbeddedBroker, settings: Settings, topics: TopicNames, key_factory: Callable[..., str]
) -> Iterator[Callable[[list[DeadLetter]], TestClient]]:
    """Put dead letters on the topic, then start a gateway and wait until it has read them all."""
    clients: list[TestClient] = []

    def start(letters: list[DeadLetter]) -> TestClient:
        asyncio.run(ensure_topics(settings, broker.bootstrap))
        asyncio.run(produce_all(broker.bootstrap, topics.dead_letters, letters))
        client = TestClient(create_app(settings, broker.bootstrap), headers=bearer(key_factory(settings)))
        client.__enter__()
        clients.append(client)
        wait_for(lambda: listed(client)["complete"], "the gateway read the dead-letter topic")
        return client

    yield start
    for client in clients:
        client.__exit__(None, None, None)


@pytest.mark.server
def test_dead_letters_are_listed_newest_first_with_filters(
    with_letters: Callable[[list[DeadLetter]], TestClient], topics: TopicNames
) -> None:
    m1, m2 = chat("m1", "I work at Siemens."), chat("m2", "I live in Oslo.", user="bob")
    doc = Document(event_id="d1", user_id="bob", event_time=T0, document_id="d1", text="A CV.")
    gateway = with_letters(
        [
            letter(m1, topics.chat),
            letter(None, topics.chat, "invalid_event", dl_id="dl_garbage", payload="\x00garbage", user="alice", at=T1),
            letter(m2, topics.chat, "store_failed", at=T1 + timedelta(seconds=1)),
            letter(doc, topics.documents, at=T1 + timedelta(seconds=2)),
        ]
    )
    page = listed(gateway)
    assert page["total"] == 4 and page["complete"]
    assert [d["event_id"] for d in page["dead_letters"]] == ["dl_d1", "dl_m2", "dl_garbage", "dl_m1"]
    first = page["dead_letters"][-1]
    assert first["status"] == "dead" and first["replayed_at"] is None and first["records"] == 1
    assert first["user_id"] == "alice" and first["source_topic"] == topics.chat and first["attempts"] == 3
    assert first["failed_event_ids"] == ["m1"] and "the model said no" in first["error"]
    assert first["payload"] is None  # only on request
    assert ChatMessage.model_validate_json(listed(gateway, include_payload=True)["dead_letters"][-1]["payload"]) == m1

    def ids(**params: Any) -> list[str]:
        return [d["event_id"] for d in listed(gateway, **params)["dead_letters"]]

    assert ids(user_id="alice") == ["dl_garbage", "dl_m1"]
    assert ids(reason="extraction_failed") == ["dl_d1", "dl_m1"]
    assert ids(user_id="bob", reason="extraction_failed") == ["dl_d1"]
    assert ids(status="dead") == ids() and ids(status="replayed") == []
    paged = listed(gateway, limit=2, offset=1)
    assert paged["total"] == 4 and [d["event_id"] for d in paged["dead_letters"]] == ["dl_m2", "dl_garbage"]
    for bad in ({"limit": 0}, {"limit": 100_000}, {"offset": -1}, {"status": "zombie"}, {"user_id": "not valid"}):
        assert gateway.get("/v1/dead-letters", params=bad).status_code == 422, bad
    assert gateway.get("/healthz").json()["dead_letters"] == 4


@pytest.mark.server
def test_replay_publishes_the_original_event_with_the_same_id_and_key(
    with_letters: Callable[[list[DeadLetter]], TestClient], broker: EmbeddedBroker, topics: TopicNames
) -> None:
    m1, m2 = chat("m1", "I work at Siemens."), chat("m2", "I live in Oslo.", user="bob")
    doc = Document(event_id="d1", user_id="bob", event_time=T0, document_id="d1", title="CV", text="A nurse.")
    gateway = with_letters([letter(m1, topics.chat), letter(m2, topics.chat), letter(doc, topics.documents)])

    # by dead-letter id and by the failed event's id
    response = gateway.post("/v1/dead-letters/replay", json={"event_ids": ["dl_m1", "d1"]})
    assert response.status_code == 202, response.text
    result = response.json()
    assert {(r["event_id"], r["user_id"], r["source_topic"]) for r in result["replayed"]} == {
        ("m1", "alice", topics.chat),
        ("d1", "bob", topics.documents),
    }
    assert result["skipped"] == [] and result["remaining"] == 0
    ((key, value),) = asyncio.run(read_topic(broker.bootstrap, topics.chat, 1))
    assert key == b"alice" and ChatMessage.model_validate_json(value) == m1  # same id, same content, same times
    ((key, value),) = asyncio.run(read_topic(broker.bootstrap, topics.documents, 1))
    assert key == b"bob" and Document.model_validate_json(value) == doc

    replayed = {d["event_id"]: d for d in listed(gateway, status="replayed")["dead_letters"]}
    assert set(replayed) == {"dl_m1", "dl_d1"} and replayed["dl_m1"]["replays"] == 1
    assert datetime.fromisoformat(replayed["dl_m1"]["replayed_at"]) > datetime.now(UTC) - timedelta(minutes=1)

    # --all replays what is still dead, narrowed by the filters; replayed ones are not replayed again
    assert gateway.post("/v1/dead-letters/replay", json={"all": True, "user_id": "alice"}).json()["replayed"] == []
    everything = gateway.post("/v1/dead-letters/replay", json={"all": True}).json()
    assert [r["event_id"] for r in everything["replayed"]] == ["m2"]
    assert listed(gateway, status="dead")["total"] == 0

    # the replayed event failed again: a new record makes its dead letter dead again
    asyncio.run(produce_all(broker.bootstrap, topics.dead_letters, [letter(m1, topics.chat, at=datetime.now(UTC))]))
    again = wait_for(
        lambda: [d for d in listed(gateway, status="dead")["dead_letters"] if d["event_id"] == "dl_m1"],
        "dl_m1 dead again",
    )
    assert again[0]["records"] == 2 and again[0]["replays"] == 1


@pytest.mark.server
def test_unknown_ids_are_404_and_nothing_is_published(
    with_letters: Callable[[list[DeadLetter]], TestClient], broker: EmbeddedBroker, topics: TopicNames
) -> None:
    m1, m2 = chat("m1", "I work at Siemens."), chat("m2", "I live in Oslo.")
    gateway = with_letters([letter(m1, topics.chat), letter(m2, topics.chat)])
    response = gateway.post("/v1/dead-letters/replay", json={"event_ids": ["dl_m1", "nope", "dl_nope"]})
    assert response.status_code == 404
    assert response.json()["unknown"] == ["nope", "dl_nope"] and "nope, dl_nope" in response.json()["detail"]
    assert listed(gateway, status="replayed")["total"] == 0
    # nothing of the rejected request was published: the first record on the topic is the next replay's
    assert gateway.post("/v1/dead-letters/replay", json={"event_ids": ["m2"]}).status_code == 202
    records = asyncio.run(read_topic(broker.bootstrap, topics.chat, 1))
    assert [ChatMessage.model_validate_json(v).event_id for _, v in records] == ["m2"]


INVALID_REPLAYS: list[tuple[Any, str]] = [
    ("not json", "not valid JSON"),
    ([], "replay request"),
    ({}, "give event_ids, or all: true"),
    ({"event_ids": []}, "event_ids: List should have at least 1 item"),
    ({"event_ids": "dl_m1"}, "event_ids: Input should be a valid list"),
    ({"event_ids": [""]}, "event_ids.0: String should have at least 1 character"),
    ({"event_ids": [7]}, "event_ids.0: Input should be a valid string"),
    ({"event_ids": ["dl_m1"], "all": True}, "not both"),
    ({"event_ids": ["dl_m1"], "user_id": "alice"}, "user_id and reason filter all: true"),
    ({"user_id": "alice"}, "give event_ids, or all: true"),
    ({"all": True, "user_id": "not valid"}, "user_id: String should match pattern"),
    ({"all": "yes please"}, "all: Input should be a valid boolean"),
    ({"all": True, "colour": "red"}, "colour: Extra inputs are not permitted"),
]


@pytest.mark.server
def test_malformed_bodies_and_unreplayable_payloads_are_422(
    with_letters: Callable[[list[DeadLetter]], TestClient], broker: EmbeddedBroker, topics: TopicNames
) -> None:
    m1 = chat("m1", "I work at Siemens.")
    gateway = with_letters(
        [
            letter(m1, topics.chat),
            letter(None, topics.chat, "invalid_event", dl_id="dl_garbage", payload="\x00garbage", user="alice"),
            letter(chat("m9", "x"), "elsewhere.topic", dl_id="dl_elsewhere"),
            letter(chat("m8", "x", user="mallory"), topics.chat, dl_id="dl_stolen", user="alice"),
        ]
    )
    for body, detail in INVALID_REPLAYS:
        raw = body if isinstance(body, str) else json.dumps(body)
        response = gateway.post("/v1/dead-letters/replay", content=raw, headers={"content-type": "application/json"})
        assert response.status_code == 422, (body, response.text)
        assert detail in response.json()["detail"], (body, response.json())

    # named explicitly, a dead letter whose payload is no valid event fails the whole request
    response = gateway.post("/v1/dead-letters/replay", json={"event_ids": ["dl_m1", "dl_garbage", "dl_elsewhere"]})
    assert response.status_code == 422
    reasons = {d["event_id"]: d["error"] for d in response.json()["not_replayable"]}
    assert set(reasons) == {"dl_garbage", "dl_elsewhere"}
    assert "not valid JSON" in reasons["dl_garbage"] and "elsewhere.topic" in reasons["dl_elsewhere"]
    stolen = gateway.post("/v1/dead-letters/replay", json={"event_ids": ["dl_stolen"]})
    assert stolen.status_code == 422 and "mallory" in stolen.json()["detail"]
    assert listed(gateway, status="replayed")["total"] == 0

    # with --all, they are skipped (and say why) while the rest is replayed
    result = gateway.post("/v1/dead-letters/replay", json={"all": True, "user_id": "alice"}).json()
    assert [r["event_id"] for r in result["replayed"]] == ["m1"]
    assert {s["event_id"] for s in result["skipped"]} == {"dl_garbage", "dl_elsewhere", "dl_stolen"}
    records = asyncio.run(read_topic(broker.bootstrap, topics.chat, 1))
    assert [ChatMessage.model_validate_json(v).event_id for _, v in records] == ["m1"]


# -- the whole pipeline: dead-lettered, replayed, memorized; and the demo --------------------------------------------


@pytest.fixture(scope="module")
def poison(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("poison") / "markers.txt"
    path.write_text("")
    return path


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory,
    settings_factory: Callable[..., Settings],
    poison: Path,
    admin_key_env: Callable[[Settings], AbstractContextManager[str]],
) -> Iterator[Stack]:
    settings = settings_factory(
        tmp_path_factory.mktemp("dead-letters"),
        batch_wait_s=0.2,
        extraction_attempts=2,
        scripted_llm="tests.test_dead_letters:poisoned_llm",
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(POISON_FILE_ENV, str(poison))
        running = Stack(settings, settings.host, settings.port, workers=1, startup_timeout_s=60)
        asyncio.run(running.start())
    try:
        with admin_key_env(settings):
            yield running
    finally:
        running.stop()


def dead_letter_of(client: GatewayClient, user: str, event_id: str) -> dict[str, Any] | None:
    found = [d for d in client.dead_letters(user_id=user)["dead_letters"] if event_id in d["failed_event_ids"]]
    return found[0] if found else None


@pytest.mark.server
@pytest.mark.slow
def test_a_dead_lettered_event_is_replayed_and_then_memorized(stack: Stack, poison: Path) -> None:
    poison.write_text("Porto\n")  # the model cannot handle this message, for now
    event = ChatMessage(event_id="dora-1", user_id="dora", event_time=T0, speaker="Dora", text="I keep bees in Porto.")
    with GatewayClient(stack.url) as client:
        client.post_messages([event])
        dead = wait_for(
            lambda: dead_letter_of(client, "dora", "dora-1"), "dora-1 dead-lettered", check=stack.check_children
        )
        assert dead["status"] == "dead" and dead["reason"] == "extraction_failed"
        assert client.stats("dora")["events"] == 0

        listing = run_cli("dead-letters", "list", "--user", "dora", "--url", stack.url).stdout
        assert "extraction_failed" in listing and "dora-1" in listing and "dead" in listing
        as_json = json.loads(run_cli("dead-letters", "list", "--user", "dora", "--json", "--url", stack.url).stdout)
        assert [d["event_id"] for d in as_json["dead_letters"]] == [dead["event_id"]]

        # replayed while the model still fails: dead-lettered again
        replayed = run_cli("dead-letters", "replay", "--all", "--user", "dora", "--url", stack.url).stdout
        assert "replayed dora-1" in replayed
        again = wait_for(
            lambda: (
                (d := dead_letter_of(client, "dora", "dora-1")) and d["records"] == 2 and d["status"] == "dead" and d
            ),
            "dora-1 dead-lettered a second time",
            check=stack.check_children,
        )
        assert again["replays"] == 1

        # the model got better: a replay by the event's own id is memorized
        poison.write_text("")
        assert "replayed dora-1" in run_cli("dead-letters", "replay", "dora-1", "--url", stack.url).stdout
        wait_for(lambda: client.stats("dora")["events"] == 1, "dora-1 memorized", check=stack.check_children)
        final = dead_letter_of(client, "dora", "dora-1")
        assert final is not None and final["status"] == "replayed" and final["records"] == 2
        assert client.stats("dora")["theses_valid"] >= 1

    # the commands' own errors
    assert "unknown dead letters: nope" in run_cli("dead-letters", "replay", "nope", "--url", stack.url, code=1).output
    assert "or give --all" in run_cli("dead-letters", "replay", "--url", stack.url, code=2).output
    assert "filter --all" in run_cli("dead-letters", "replay", "x", "--user", "dora", "--url", stack.url, code=2).output
    assert (
        "nothing to replay" in run_cli("dead-letters", "replay", "--all", "--user", "nobody", "--url", stack.url).stdout
    )


@pytest.mark.server
@pytest.mark.slow
def test_the_demo_shows_progress_and_what_failed(stack: Stack, poison: Path) -> None:
    poison.write_text("Miso\n")  # the demo's third message never extracts
    lines: list[str] = []
    ok = asyncio.run(
        _demo(
            stack.url,
            stack.log_dir,
            memorize_timeout_s=120,
            answer_timeout_s=60,
            progress_every_s=15,
            poll_s=0.1,
            echo=lines.append,
            api_key=os.environ["MEMSTREAM_API_KEY"],
        )
    )
    text = "\n".join(lines)
    assert not ok, text
    assert "demo: sent 4 messages for user 'demo'" in text and str(stack.log_dir) in text
    progress = [
        re.search(r"memorized (\d)/4, dead-lettered (\d), LLM calls in flight: \d+, done: (\d+)", line)
        for line in lines
    ]
    memorized, dead, calls = (int(g) for g in [m for m in progress if m][-1].groups())
    assert memorized + dead == 4 and memorized >= 1 and dead >= 1 and calls >= 1, text
    # the first measure counts what was sent (or says it is measuring); the last shows the drain
    backlogs = [line.split("memorize backlog: ")[-1] for line in lines if "memorize backlog: " in line]
    assert not backlogs[0].startswith("0 waiting"), text
    assert backlogs[-1].startswith("0 waiting, caught up"), text
    assert re.search(r"demo:   .*demo:3.*: extraction_failed after \d attempt", text), text
    assert f"{REPLAY_HINT} --user demo" in text
    assert "demo: memory of 'demo': " in text and f"demo: logs: {stack.log_dir}" in text
    assert re.search(r"^demo: A: .+ \(answered\)$", text, re.MULTILINE), text  # from what memory holds
    with GatewayClient(stack.url) as client:
        assert client.stats("demo")["events"] == memorized


# -- the demo against a stub gateway: deadlines --------------------------------------------------------------------


def stub_gateway(events: int, answer: dict[str, Any] | None = None) -> FastAPI:
    """A gateway that memorizes ``events`` of the demo's messages, never dead-letters, and answers with ``answer``."""
    registry = CollectorRegistry()
    calls = Counter("memstream_llm_calls_total", "", ["model", "task", "outcome"], registry=registry)
    latency = Histogram("memstream_llm_latency_seconds", "", ["model", "task"], registry=registry)
    calls.labels("m", "extract", "ok").inc(2)
    calls.labels("m", "extract", "error").inc()
    latency.labels("m", "extract").observe(100.0)
    latency.labels("m", "extract").observe(140.0)
    stub = FastAPI()

    @stub.post("/v1/messages", status_code=202)
    async def messages() -> dict[str, Any]:
        return {"accepted": 4, "event_ids": []}

    @stub.get("/v1/dead-letters")
    async def dead_letters() -> dict[str, Any]:
        return {"total": 0, "complete": True, "dead_letters": []}

    @stub.get("/v1/stats/{user_id}")
    async def stats(user_id: str) -> dict[str, Any]:
        return {"user_id": user_id, "vertices": {"episodic": events}, "edges": {}, "theses_valid": events,
                "theses_invalidated": 0, "events": events}  # fmt: skip

    @stub.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type="text/plain")

    @stub.post("/v1/questions", status_code=202)
    async def questions() -> dict[str, Any]:
        return {"query_id": "q1"}

    @stub.get("/v1/answers/{query_id}")
    async def answers(query_id: str) -> Any:
        return answer if answer is not None else JSONResponse(status_code=404, content={"detail": "not yet"})

    @stub.get("/v1/traces/{query_id}")
    async def trace(query_id: str) -> dict[str, Any]:
        return {"query_id": query_id, "timeline": [{}, {}, {}]}

    return stub


async def run_stub_demo(stub: FastAPI, **kwargs: Any) -> tuple[bool, list[str]]:
    lines: list[str] = []
    ok = await _demo(
        "http://stub",
        Path("/var/memstream/logs"),
        transport=httpx.ASGITransport(app=stub),
        echo=lines.append,
        poll_s=0.01,
        **kwargs,
    )
    return ok, lines


async def test_the_demo_says_when_memorize_runs_out_of_time() -> None:
    ok, lines = await run_stub_demo(
        stub_gateway(events=1), memorize_timeout_s=1.0, answer_timeout_s=0.5, progress_every_s=0.0
    )
    text = "\n".join(lines)
    assert not ok
    assert (
        "memorized 1/4, dead-lettered 0, LLM calls in flight: 0, done: 3 (2 ok, 1 failed, 0 cached), 120.0s per call"
        in text
    )
    assert len([line for line in lines if "memorized 1/4" in line]) >= 2  # a line per poll with progress_every_s=0
    assert "memorize did not finish within 1s: 3 of 4 messages still pending" in text
    assert "MEMSTREAM_DEMO_MEMORIZE_TIMEOUT_S" in text and "demo: logs: /var/memstream/logs" in text
    assert "demo: Q:" in text  # one message is in memory: the question is still asked
    assert "no answer within" in text


async def test_the_demo_waits_for_the_answer_with_its_own_deadline() -> None:
    ok, lines = await run_stub_demo(
        stub_gateway(events=4), memorize_timeout_s=30.0, answer_timeout_s=1.0, progress_every_s=0.0
    )
    text = "\n".join(lines)
    assert not ok
    assert "memorized 4/4, dead-lettered 0" in text and "did not finish" not in text
    assert "waiting for the answer: 3 QA stage run(s) done" in text
    assert "no answer within 1s" in text and "MEMSTREAM_DEMO_ANSWER_TIMEOUT_S" in text
    assert "/var/memstream/logs" in text

    answer = {"answer": "At St. Mary's hospital.", "status": "answered"}
    ok, lines = await run_stub_demo(stub_gateway(events=4, answer=answer), memorize_timeout_s=30.0)
    assert ok and "demo: A: At St. Mary's hospital.  (answered)" in lines

    ok, lines = await run_stub_demo(stub_gateway(events=0), memorize_timeout_s=0.5)
    assert not ok and "demo: nothing was memorized, so no question is asked" in lines
