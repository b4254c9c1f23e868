"""The gateway's write-ahead outbox and its relay, on a real SQLite file."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import pytest

from schemas.events import ChatMessage, MemoryUpdate
from services.adapters.minilm import MiniLMEmbedder
from services.adapters.sqlite import SqliteMemoryStore
from services.llm.scripted import rule_based_llm
from services.memorize.service import MemorizeService
from streams.codec import encode
from streams.gateway.app import StoreStats
from streams.handlers import MemorizeHandler, Record
from streams.outbox import Outbox, OutboxRecord, OutboxRelay
from streams.topics import TopicNames
from tests.conftest import make_settings

T0 = datetime(2024, 1, 1, 8, 0, tzinfo=UTC)


def record(user: str, n: int, topic: str = "memstream.chat") -> OutboxRecord:
    return OutboxRecord(topic, user, f"m_{user}_{n}", f"{user}:{n}".encode())


class Memory:
    """Stands in for the store's ``seen_events`` and the broker: what was applied, what was published."""

    def __init__(self) -> None:
        self.applied: dict[str, set[str]] = {}
        self.published: list[OutboxRecord] = []
        self.fail_publish = False

    async def seen(self, user_id: str, event_ids: Sequence[str]) -> set[str]:
        return self.applied.get(user_id, set()) & set(event_ids)

    async def publish(self, records: Sequence[OutboxRecord]) -> None:
        if self.fail_publish:
            raise ConnectionError("broker down")
        self.published.extend(records)

    def apply(self, *records: OutboxRecord) -> None:
        for r in records:
            self.applied.setdefault(r.user_id, set()).add(r.event_id)


async def opened(path: Path) -> Outbox:
    outbox = Outbox(path)
    await outbox.open()
    return outbox


async def test_a_commit_is_on_disk_and_fsynced_before_add_returns(tmp_path: Path) -> None:
    outbox = await opened(tmp_path / "o.sqlite3")
    assert (await outbox.pragma("journal_mode"), await outbox.pragma("synchronous")) == ("wal", 2)  # 2: FULL
    await outbox.add([record("alice", 1), record("bob", 1)])
    # a second connection (another process after a crash) sees what add() returned for
    reopened = await opened(tmp_path / "o.sqlite3")
    assert [e.record for e in await reopened.entries()] == [record("alice", 1), record("bob", 1)]
    await reopened.close()
    await outbox.close()


async def test_concurrent_adds_share_commits_and_all_land(tmp_path: Path) -> None:
    from services import metrics

    outbox = await opened(tmp_path / "o.sqlite3")
    before = metrics.OUTBOX_COMMITS._value.get()
    await asyncio.gather(*(outbox.add([record("alice", n)]) for n in range(50)))
    commits = metrics.OUTBOX_COMMITS._value.get() - before
    assert len(await outbox.entries(limit=1000)) == 50
    assert 1 <= commits < 50  # requests that arrived during a commit shared the next one
    await outbox.close()


async def test_replay_publishes_pending_in_acceptance_order_per_user_and_prunes_applied(tmp_path: Path) -> None:
    outbox = await opened(tmp_path / "o.sqlite3")
    accepted = [record(user, n) for n in range(4) for user in ("alice", "bob")]
    for r in accepted:
        await outbox.add([r])
    memory = Memory()
    memory.apply(record("alice", 0), record("bob", 0), record("bob", 1))
    relay = OutboxRelay(outbox, memory.publish, memory.seen)
    assert await relay.replay() == 5
    assert [r.event_id for r in memory.published if r.user_id == "alice"] == ["m_alice_1", "m_alice_2", "m_alice_3"]
    assert [r.event_id for r in memory.published if r.user_id == "bob"] == ["m_bob_2", "m_bob_3"]
    assert (await outbox.counts())["pending"] == 5  # the applied ones are gone

    memory.apply(*accepted)
    assert await relay.prune() == 0
    assert await outbox.counts() == {"pending": 0, "dead": 0}
    await outbox.close()


async def test_a_dead_lettered_event_is_not_replayed_until_accepted_again(tmp_path: Path) -> None:
    outbox = await opened(tmp_path / "o.sqlite3")
    await outbox.add([record("alice", 1), record("alice", 2)])
    await outbox.mark_dead("alice", ["m_alice_1"], "extraction_failed")
    memory = Memory()
    relay = OutboxRelay(outbox, memory.publish, memory.seen)
    assert await relay.replay() == 1
    assert [r.event_id for r in memory.published] == ["m_alice_2"]
    assert await outbox.counts() == {"pending": 1, "dead": 1}

    await outbox.add([record("alice", 1)])  # an operator replayed the dead letter: pending again
    memory.published.clear()
    assert await relay.replay() == 2
    assert [r.event_id for r in memory.published] == ["m_alice_1", "m_alice_2"]  # its first place in the order

    memory.apply(record("alice", 1), record("alice", 2))
    await outbox.mark_dead("alice", ["m_alice_1"], "extraction_failed")
    assert await relay.prune() == 0  # memorized after all: dead or not, it goes
    await outbox.close()


async def test_a_failed_publish_is_retried_by_the_next_pass(tmp_path: Path) -> None:
    outbox = await opened(tmp_path / "o.sqlite3")
    memory = Memory()
    relay = OutboxRelay(outbox, memory.publish, memory.seen)
    await outbox.add([record("alice", 1), record("alice", 2)])
    memory.published.append(record("alice", 2))  # this one made it
    relay.publish_failed([record("alice", 1)])
    memory.fail_publish = True
    await relay.pass_once()  # broker still down: kept for the next pass
    memory.fail_publish = False
    await relay.pass_once()
    assert [r.event_id for r in memory.published] == ["m_alice_2", "m_alice_1"]
    await relay.pass_once()
    assert [r.event_id for r in memory.published] == ["m_alice_2", "m_alice_1"]  # once, not every pass
    await outbox.close()


async def test_the_relay_replays_on_start_once_ready(tmp_path: Path) -> None:
    outbox = await opened(tmp_path / "o.sqlite3")
    await outbox.add([record("alice", 1)])
    memory = Memory()
    ready = asyncio.Event()
    relay = OutboxRelay(outbox, memory.publish, memory.seen, interval_s=0.05)
    await relay.start(ready=ready.wait)
    await outbox.add([record("alice", 2)])  # accepted by this gateway: its own request publishes it
    await asyncio.sleep(0)
    assert memory.published == []  # the dead letters are not known yet
    ready.set()
    await asyncio.wait_for(relay.replayed.wait(), 10)
    assert memory.published == [record("alice", 1)]
    await relay.stop()
    await outbox.close()


@pytest.mark.parametrize("users", [1, 3])
async def test_entries_page_through_everything(tmp_path: Path, users: int) -> None:
    outbox = await opened(tmp_path / "o.sqlite3")
    await outbox.add([record(f"u{u}", n) for n in range(700) for u in range(users)])
    memory = Memory()
    relay = OutboxRelay(outbox, memory.publish, memory.seen)
    assert await relay.replay() == 700 * users
    await outbox.close()


class Publisher:
    """A worker's publisher: ``down`` refuses every publish (the broker died), else records what was sent."""

    def __init__(self, down: bool) -> None:
        self.down = down
        self.sent: list[tuple[str, bytes | None, bytes]] = []

    async def publish(self, topic: str, key: bytes | None, value: bytes) -> None:
        if self.down:
            raise ConnectionError("broker down")
        self.sent.append((topic, key, value))


async def test_an_applied_event_whose_memory_update_is_pending_stays_in_the_outbox_until_its_replay_announces_it(
    tmp_path: Path,
) -> None:
    """The broker dies after the worker's store commit and before its memory update was acked: the outbox must
    keep the event, or nothing would ever bring it back to a worker to publish the pending update."""
    settings = make_settings(tmp_path)
    topics = TopicNames.from_settings(settings)
    message = ChatMessage(
        event_id="m_ana_1", user_id="ana", speaker="Ana", text="I moved to Lisbon with Maria.", event_time=T0
    )
    record = OutboxRecord(topics.chat, message.user_id, message.event_id, encode(message))
    embedder = MiniLMEmbedder()
    reader = StoreStats(settings)
    outbox = await opened(settings.outbox_path)
    relayed: list[OutboxRecord] = []

    async def relay_publish(records: Sequence[OutboxRecord]) -> None:
        relayed.extend(records)

    relay = OutboxRelay(outbox, relay_publish, reader.applied)
    async with await SqliteMemoryStore.open(settings.store_path, dim=embedder.dim) as store:
        service = MemorizeService(store.stores(), rule_based_llm(), embedder, settings)
        await outbox.add([record])
        await MemorizeHandler(service, Publisher(down=True), topics).handle([Record(topics.chat, b"ana", record.value)])
        assert await store.pending_count() == 1
        assert await reader.applied("ana", [message.event_id]) == set()
        assert await relay.replay() == 1 and relayed == [record]  # what a restarted gateway does

        worker = Publisher(down=False)
        await MemorizeHandler(service, worker, topics).handle([Record(topics.chat, b"ana", record.value)])
        updates = [MemoryUpdate.model_validate_json(v) for t, _, v in worker.sent if t == topics.memory_updates]
        assert [u.source_event_ids for u in updates] == [[message.event_id]]
        assert await store.pending_count() == 0
        assert await reader.applied("ana", [message.event_id]) == {message.event_id}
        assert await relay.prune() == 0
    await reader.close()
    await outbox.close()
