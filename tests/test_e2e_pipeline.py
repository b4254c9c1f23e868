"""End to end, as `memstream up` runs it: the real embedded broker, a Faust worker process and the gateway process.

The worker uses the rule-based scripted LLM (``MEMSTREAM_LLM=scripted``): the pipeline is real, only the model's
replies are canned. Input goes in through the CLI and the gateway; the checks read the output topics.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from typer.testing import CliRunner

from memstream.cli import app as cli
from memstream.runtime import Stack
from schemas.events import ChatMessage, DeadLetter, MemoryUpdate
from services.ingest import load_conversation
from services.logging import configure_logging
from services.settings import Settings
from streams.codec import encode
from streams.gateway.client import GatewayClient
from streams.topics import TopicNames

pytestmark = [pytest.mark.server, pytest.mark.slow]

CONVERSATION = [
    {
        "speaker": "Anna",
        "text": "I just started my new job as a nurse at St. Mary's hospital.",
        "time": "2024-03-02T10:00:00Z",
    },
    {"speaker": "Ben", "text": "Congrats! I'm still in Munich, training for the Berlin marathon."},
    {"speaker": "Anna", "text": "I also adopted a cat called Miso last week."},
]


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory,
    settings_factory: Callable[..., Settings],
    admin_key_env: Callable[[Settings], AbstractContextManager[str]],
) -> Iterator[Stack]:
    settings = settings_factory(tmp_path_factory.mktemp("e2e"), batch_wait_s=0.2)
    running = Stack(settings, settings.host, settings.port, workers=1, startup_timeout_s=60)
    asyncio.run(running.start())
    try:
        with admin_key_env(settings):
            yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def topics(stack: Stack) -> TopicNames:
    return TopicNames.from_settings(stack.settings)


def records(
    stack: Stack, topic: str, done: Callable[[list[bytes]], bool], timeout_s: float = 30.0, drain: bool = False
) -> list[bytes]:
    """Values of ``topic`` from the beginning, read until ``done(values)`` or the deadline (then: fail).

    ``drain``: then go on reading until a poll comes back empty, i.e. to the end of what the topic holds now.
    """

    async def read() -> list[bytes]:
        consumer = AIOKafkaConsumer(
            topic, bootstrap_servers=stack.bootstrap, auto_offset_reset="earliest", group_id=None
        )
        await consumer.start()
        values: list[bytes] = []
        try:
            deadline = time.monotonic() + timeout_s
            while not done(values):
                stack.check_children()  # a dead worker fails the test now, with its log, not at the deadline
                if time.monotonic() > deadline:
                    raise AssertionError(f"{topic}: condition not met within {timeout_s}s; got {values[-5:]}")
                for batch in (await consumer.getmany(timeout_ms=200)).values():
                    values.extend(r.value or b"" for r in batch)
            while drain and (batches := await consumer.getmany(timeout_ms=500)):
                for batch in batches.values():
                    values.extend(r.value or b"" for r in batch)
        finally:
            await consumer.stop()
        return values

    return asyncio.run(read())


def memory_updates_for(stack: Stack, topics: TopicNames, event_ids: set[str]) -> list[MemoryUpdate]:
    def updates(values: list[bytes]) -> list[MemoryUpdate]:
        # the topic carries MemoryForgotten records too
        return [MemoryUpdate.model_validate_json(v) for v in values if json.loads(v)["kind"] == "memory_update"]

    def covered(values: list[bytes]) -> bool:
        return event_ids <= {e for u in updates(values) for e in u.source_event_ids}

    values = records(stack, topics.memory_updates, covered)
    return [u for u in updates(values) if event_ids & set(u.source_event_ids)]


def run_cli(*args: str) -> Any:
    try:
        result = CliRunner().invoke(cli, list(args))
    finally:
        # the command configured logging onto the runner's stderr, which is closed now
        configure_logging("INFO", json=True)
    assert result.exit_code == 0, f"{args}: {result.output}"
    return result


def test_a_conversation_is_memorized_and_a_question_is_answered_from_it(
    stack: Stack, topics: TopicNames, tmp_path: Path
) -> None:
    chat = tmp_path / "chat.jsonl"
    chat.write_text("\n".join(json.dumps(line) for line in CONVERSATION))
    sent = run_cli("ingest", str(chat), "--user", "alice", "--ids", "--url", stack.url).stdout

    expected = {m.event_id for m in load_conversation(chat, "alice")}
    # what `memstream forget alice --message ID` and `--conversation chat` would take
    assert "(conversation chat)" in sent and expected == {line.split("\t")[0] for line in sent.splitlines()[1:]}
    updates = memory_updates_for(stack, topics, expected)
    assert all(u.user_id == "alice" for u in updates)
    assert sum(u.theses_added for u in updates) >= len(CONVERSATION)
    # micro-batching: the three messages arrive together and share extraction calls
    assert sum(u.llm_calls for u in updates) < len(CONVERSATION)

    answer = json.loads(
        run_cli("ask", "Where does Anna work now?", "--user", "alice", "--json", "--url", stack.url).stdout
    )
    assert answer["status"] == "answered"
    assert "St. Mary's hospital" in answer["answer"]
    assert any("St. Mary's hospital" in e["text"] for e in answer["evidence"])

    stats = json.loads(run_cli("stats", "--user", "alice", "--json", "--url", stack.url).stdout)
    assert stats["events"] == len(CONVERSATION)
    assert stats["theses_valid"] >= len(CONVERSATION) and stats["theses_invalidated"] == 0
    # another user's memory is empty: nothing leaks across tenants
    other = GatewayClient(stack.url).ask("mallory", "Where does Anna work now?")
    assert GatewayClient(stack.url).wait_answer(other, 30)["status"] == "no_answer"


def test_ask_traces_stages_and_honours_as_of_and_options(stack: Stack, topics: TopicNames, tmp_path: Path) -> None:
    chat = tmp_path / "trace.jsonl"
    said = {"speaker": "Tom", "text": "I play the cello in Leipzig.", "time": "2024-05-01T09:00:00Z"}
    chat.write_text(json.dumps(said))
    run_cli("ingest", str(chat), "--user", "tom", "--url", stack.url)
    memory_updates_for(stack, topics, {m.event_id for m in load_conversation(chat, "tom")})

    runner = CliRunner()
    try:
        result = runner.invoke(
            cli, ["ask", "What does Tom play in Leipzig?", "--user", "tom", "--trace", "--json", "--url", stack.url]
        )
    finally:
        configure_logging("INFO", json=True)
    assert result.exit_code == 0, result.output
    assert "[ 6] traversal" in result.stderr and "[13] combine" in result.stderr
    answer = json.loads(result.stdout)
    assert "cello" in answer["answer"]

    # before the fact was said, memory had nothing to answer with
    past = json.loads(
        run_cli(
            "ask", "What does Tom play in Leipzig?", "--user", "tom", "--as-of", "2024-01-01", "--json",
            "--retriever", "flat", "--url", stack.url,
        ).stdout
    )  # fmt: skip
    assert past["status"] == "no_answer" and past["evidence"] == []


def test_garbage_on_the_topic_is_dead_lettered_and_the_worker_goes_on(stack: Stack, topics: TopicNames) -> None:
    async def send_garbage() -> None:
        producer = AIOKafkaProducer(bootstrap_servers=stack.bootstrap)
        await producer.start()
        try:
            await producer.send_and_wait(topics.chat, b"\x00\x01 definitely not an event", key=b"bob")
        finally:
            await producer.stop()

    asyncio.run(send_garbage())
    with GatewayClient(stack.url) as client:
        accepted = client.post_messages(
            [
                ChatMessage(
                    event_id="bob-1", user_id="bob", event_time=datetime.now(UTC), speaker="Bob", text="I live in Oslo."
                )
            ]
        )
    assert accepted["event_ids"] == ["bob-1"]

    def garbage_seen(values: list[bytes]) -> bool:
        return any("definitely not an event" in DeadLetter.model_validate_json(v).payload for v in values)

    letters = [DeadLetter.model_validate_json(v) for v in records(stack, topics.dead_letters, garbage_seen)]
    letter = next(d for d in letters if "definitely not an event" in d.payload)
    assert letter.reason == "invalid_event" and letter.source_topic == topics.chat
    assert memory_updates_for(stack, topics, {"bob-1"})  # the next message on the same partition got through


def test_replayed_events_change_nothing(stack: Stack, topics: TopicNames) -> None:
    events = [
        ChatMessage(event_id=f"carol-{n}", user_id="carol", event_time=datetime.now(UTC), speaker="Carol", text=text)
        for n, text in enumerate(["I moved to Lisbon in May.", "My brother Tom is a pilot at TAP."])
    ]
    with GatewayClient(stack.url) as client:
        client.post_messages(events)
        memory_updates_for(stack, topics, {e.event_id for e in events})
        before = client.stats("carol")
        client.post_messages(events)  # the same events again, through the gateway...
    last = asyncio.run(replay_directly(stack.bootstrap, topics.chat, events))  # ...and straight onto the topic
    wait_committed(stack, topics.chat, last)

    with GatewayClient(stack.url) as client:
        assert client.stats("carol") == before

    # every update the worker would emit for the replay is on the topic by now: it publishes before it commits
    def carols(values: list[bytes]) -> list[MemoryUpdate]:
        return [u for v in values if (u := MemoryUpdate.model_validate_json(v)).user_id == "carol"]

    values = records(stack, topics.memory_updates, lambda v: bool(carols(v)), drain=True)
    assert len(carols(values)) == 1  # one change set, never re-emitted


async def replay_directly(bootstrap: str, topic: str, events: list[ChatMessage]) -> tuple[int, int]:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        metas = [await producer.send_and_wait(topic, encode(e), key=e.user_id.encode()) for e in events]
    finally:
        await producer.stop()
    return metas[-1].partition, metas[-1].offset


def wait_committed(stack: Stack, topic: str, last: tuple[int, int], timeout_s: float = 30.0) -> None:
    """Wait until the worker group committed past ``last`` (partition, offset): it was processed and written."""

    async def wait() -> None:
        partition, offset = last
        tp = TopicPartition(topic, partition)
        # the admin API reads the group's offsets without joining it (a join would rebalance the worker)
        admin = AIOKafkaAdminClient(bootstrap_servers=stack.bootstrap)
        await admin.start()
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                offsets = await admin.list_consumer_group_offsets(stack.settings.consumer_group, partitions=[tp])
                committed = offsets.get(tp)
                if committed is not None and committed.offset > offset:
                    return
                assert time.monotonic() < deadline, f"offset {offset} of {topic}[{partition}] never committed"
                await asyncio.sleep(0.2)
        finally:
            await admin.close()

    asyncio.run(wait())


def test_poison_records_are_dead_lettered_alone_and_offsets_pass_them(stack: Stack, topics: TopicNames) -> None:
    """The measured poison of issue 9 among good messages of one user, straight onto the chat topic: a 100,000-deep
    JSON record (it crashed the agent), a far-future event_time (it failed its whole batch's store write) and an
    event under another user's key. The good ones are memorized, each bad one is its own dead letter, and the
    group's committed offsets pass them all."""

    def good(n: int) -> ChatMessage:
        return ChatMessage(
            event_id=f"dana-{n}", user_id="dana", event_time=datetime.now(UTC), speaker="Dana", text=f"I own {n} cats."
        )

    far_future = json.loads(encode(good(90))) | {"event_id": "dana-future", "event_time": "9999-12-31T23:59:59-14:00"}
    poison = {
        "deep": (b"dana", b"[" * 100_000 + b"]" * 100_000),
        "future": (b"dana", json.dumps(far_future).encode()),
        "wrong_key": (b"erin", encode(good(91))),  # dana's event under erin's key
    }
    sent = [(b"dana", encode(good(1))), poison["deep"], (b"dana", encode(good(2))), poison["future"]]
    sent += [(b"dana", encode(good(3))), poison["wrong_key"], (b"dana", encode(good(4)))]

    async def publish() -> dict[int, int]:
        producer = AIOKafkaProducer(bootstrap_servers=stack.bootstrap, acks="all")
        await producer.start()
        last: dict[int, int] = {}
        try:
            for key, value in sent:
                meta = await producer.send_and_wait(topics.chat, value, key=key)
                last[meta.partition] = max(meta.offset, last.get(meta.partition, -1))
        finally:
            await producer.stop()
        return last

    last = asyncio.run(publish())
    assert memory_updates_for(stack, topics, {f"dana-{n}" for n in range(1, 5)})  # every good neighbour memorized

    def letters_of(values: list[bytes]) -> dict[str, DeadLetter]:
        letters = [DeadLetter.model_validate_json(v) for v in values]
        found = {"deep": [d for d in letters if d.payload_bytes == len(poison["deep"][1])]}
        found["future"] = [d for d in letters if d.failed_event_ids == ["dana-future"]]
        found["wrong_key"] = [d for d in letters if d.failed_event_ids == ["dana-91"]]
        return {name: hits[0] for name, hits in found.items() if hits}

    letters = letters_of(records(stack, topics.dead_letters, lambda v: len(letters_of(v)) == 3))
    assert letters["deep"].reason == "invalid_event" and "levels deep" in letters["deep"].error
    assert letters["future"].reason == "invalid_event" and "event_time" in letters["future"].error
    assert letters["wrong_key"].reason == "key_mismatch" and letters["wrong_key"].user_id == "dana"
    # no good message was dead-lettered along with them
    everything = records(stack, topics.dead_letters, bool, drain=True)
    dead = {e for v in everything for e in DeadLetter.model_validate_json(v).failed_event_ids}
    assert not dead & {f"dana-{n}" for n in range(1, 5)}
    for partition, offset in last.items():  # no stuck lag: the group committed past every record sent
        wait_committed(stack, topics.chat, (partition, offset))


def test_forgetting_a_message_erases_it_everywhere_and_it_is_not_memorized_again(
    stack: Stack, topics: TopicNames
) -> None:
    """Through the CLI and the gateway to the worker and back: the locker code said in one message is in memory and
    in an answer; after `memstream forget USER --message ID --wait`, no answer, search or stat shows it, the cached
    answer citing it is gone, and the same message delivered again stays forgotten."""
    said = [
        ChatMessage(
            event_id="zoe-1",
            user_id="zoe",
            speaker="Zoe",
            text="My locker code at Zephyrgym is 4711.",
            event_time=datetime(2024, 6, 1, 9, tzinfo=UTC),
        ),
        ChatMessage(
            event_id="zoe-2",
            user_id="zoe",
            speaker="Zoe",
            text="I row with Ugo on Sundays.",
            event_time=datetime(2024, 6, 1, 10, tzinfo=UTC),
        ),
    ]
    client = GatewayClient(stack.url)
    client.post_messages(said)
    memory_updates_for(stack, topics, {"zoe-1", "zoe-2"})
    before = client.stats("zoe")
    asked = client.ask("zoe", "What is my locker code at Zephyrgym?")
    answer = client.wait_answer(asked, 30)
    assert "4711" in answer["answer"]

    done = json.loads(
        run_cli("forget", "zoe", "--message", "zoe-1", "--wait", "60", "--json", "--url", stack.url).stdout
    )
    assert done["status"] == "done" and done["vertices_removed"] >= 3
    # the answer that quoted it is gone from the gateway, the graph around its evidence is empty, and a new
    # question finds nothing of it
    assert client.answer(asked) is None
    evidence = [e["id"] for e in answer["evidence"]]
    quoting = {e["id"] for e in answer["evidence"] if "4711" in e["text"]}
    graph = client._check(client._request("GET", "/v1/graph/zoe/neighbourhood", params={"ids": ",".join(evidence)}))
    assert quoting and not quoting & set(graph["found"])
    assert not any("4711" in json.dumps(n) for n in [*graph["nodes"], *graph["edges"]])
    again = client.wait_answer(client.ask("zoe", "What is my locker code at Zephyrgym?"), 30)
    assert "4711" not in again["answer"] and not any("4711" in e["text"] for e in again["evidence"])
    after = client.stats("zoe")
    assert after["events"] == before["events"] - 1 and after["theses_valid"] == before["theses_valid"] - 1
    # the same message delivered again (a producer's retry, a replayed outbox) is not memorized again
    marker = ChatMessage(
        event_id="zoe-3", user_id="zoe", speaker="Zoe", text="I swim.", event_time=datetime(2024, 6, 2, tzinfo=UTC)
    )
    asyncio.run(replay_directly(stack.bootstrap, topics.chat, [said[0], marker]))
    memory_updates_for(stack, topics, {"zoe-3"})  # the worker read past the redelivery
    assert client.stats("zoe")["events"] == after["events"] + 1
    final = client.wait_answer(client.ask("zoe", "What is my locker code at Zephyrgym?"), 30)
    assert "4711" not in final["answer"]
