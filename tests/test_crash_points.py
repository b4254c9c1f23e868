"""Exactly-once effect across crashes, deterministically: a crash injected at each point of the memorize path.

A run consumes the records in batches the way the worker does (the offset moves only after ``handle`` returned);
a ``Crash`` at the chosen point kills the "process" (it is a BaseException: nothing in the handler may catch it),
and a new store, service and handler over the same SQLite file get the records again from the last committed
offset, in batches of another size. Afterwards every user's memory equals a clean run's (content hash), every
event is applied once, and every change set was announced, duplicates carrying the same id and the same bytes.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from pytest import MonkeyPatch

from schemas.events import ChatMessage, MemoryUpdate
from services.adapters.minilm import MiniLMEmbedder
from services.adapters.sqlite import SqliteMemoryStore
from services.adapters.sqlite import write as sqlite_write
from services.domain import ApplyResult, ChangeSet
from services.llm.scripted import rule_based_llm
from services.memorize.service import MemorizeService
from services.ports import VectorItem
from services.settings import Settings
from streams.codec import encode
from streams.handlers import MemorizeHandler, Record
from streams.topics import TopicNames

T0 = datetime(2024, 2, 1, 9, 0, tzinfo=UTC)
USERS = ("ada", "ben", "cleo")
PLACES = ("Lisbon", "Oslo", "Kyoto", "Quito", "Dakar", "Perth", "Tartu", "Cusco", "Hanoi", "Bergen", "Malmo")


class Crash(BaseException):
    """The process dies here (kill -9): nothing that catches Exception stops it."""


@dataclass
class Faults:
    """Raise ``Crash`` the ``at``-th time ``point`` is reached."""

    point: str | None = None
    at: int = 1
    seen: Counter[str] = field(default_factory=Counter)
    crashed_change_set: ChangeSet | None = None
    progress: asyncio.Event = field(default_factory=asyncio.Event)

    def hit(self, point: str) -> None:
        self.seen[point] += 1
        self.progress.set()
        if point == self.point and self.seen[point] == self.at:
            raise Crash(point)

    async def reached(self, point: str, times: int, deadline_s: float = 60.0) -> None:
        """Return once ``point`` was hit ``times`` times (a condition, not a sleep)."""
        async with asyncio.timeout(deadline_s):
            while self.seen[point] < times:
                self.progress.clear()
                await self.progress.wait()


class FaultyStore(SqliteMemoryStore):
    """The real embedded store with crash points around its writes."""

    faults = Faults()

    async def apply(self, change_set: ChangeSet, vectors: Any) -> ApplyResult:
        self.faults.crashed_change_set = change_set
        self.faults.hit("before_write")
        result = await super().apply(change_set, vectors)
        self.faults.hit("after_write")
        return result

    async def mark_announced(self, user_id: str, change_set_ids: Any) -> None:
        self.faults.hit("before_mark")
        await super().mark_announced(user_id, change_set_ids)
        self.faults.hit("after_mark")


class Broker:
    """One worker's publisher: a publish is acknowledged once appended to ``sent`` (the topics, shared by every
    worker), with crash points around it."""

    def __init__(self, topics: TopicNames, sent: list[tuple[str, bytes | None, bytes]], faults: Faults) -> None:
        self.topics = topics
        self.sent = sent
        self.faults = faults

    async def publish(self, topic: str, key: bytes | None, value: bytes) -> None:
        announce = topic == self.topics.memory_updates
        if announce:
            self.faults.hit("before_announce")
        self.sent.append((topic, key, value))
        if announce:
            self.faults.hit("during_announce")


def messages() -> list[ChatMessage]:
    out = []
    for n in range(30):
        user = USERS[n % len(USERS)]
        place = PLACES[n % len(PLACES)]
        out.append(
            ChatMessage(
                event_id=f"{user}-{n}",
                user_id=user,
                speaker=user.title(),
                text=f"I flew to {place} on trip number {n} with Maria.",
                event_time=T0 + timedelta(minutes=n),
                ingest_time=T0 + timedelta(hours=1, seconds=n),
            )
        )
    return out


@pytest.fixture(scope="module")
def embedder() -> MiniLMEmbedder:
    return MiniLMEmbedder()


@dataclass
class World:
    path: Path
    embedder: MiniLMEmbedder
    settings: Settings
    topics: TopicNames
    records: list[Record]
    sent: list[tuple[str, bytes | None, bytes]] = field(default_factory=list)
    committed: int = 0  # the consumer group's offset: advanced only after a batch was handled

    async def open(self, faults: Faults | None = None) -> tuple[FaultyStore, MemorizeHandler]:
        faults = faults or Faults()
        store = await FaultyStore.open(self.path, dim=self.embedder.dim)
        store.faults = faults
        service = MemorizeService(store.stores(), rule_based_llm(), self.embedder, self.settings)
        return store, MemorizeHandler(service, Broker(self.topics, self.sent, faults), self.topics)

    def updates(self) -> list[bytes]:
        return [value for topic, _, value in self.sent if topic == self.topics.memory_updates]

    async def consume(self, handler: MemorizeHandler, batch: int) -> None:
        """Handle the records from the committed offset on, committing after each batch."""
        while self.committed < len(self.records):
            part = self.records[self.committed : self.committed + batch]
            await handler.handle(part)
            self.committed += len(part)


def make_world(tmp_path: Path, embedder: MiniLMEmbedder, name: str) -> World:
    settings = Settings(_env_file=None, data_dir=tmp_path)  # type: ignore[call-arg]
    topics = TopicNames.from_settings(settings)
    records = [Record(topics.chat, m.user_id.encode(), encode(m)) for m in messages()]
    return World(tmp_path / f"{name}.sqlite3", embedder, settings, topics, records)


async def clean_run(world: World) -> dict[str, str]:
    store, handler = await world.open()
    await world.consume(handler, 8)
    hashes = await store.content_hashes()
    ids = [MemoryUpdate.model_validate_json(v).change_set_id for v in world.updates()]
    assert len(ids) == len(set(ids)) > 0 and await store.pending_count() == 0
    await store.close()
    return hashes


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory, embedder: MiniLMEmbedder) -> dict[str, str]:
    """Per-user content hashes of a run without crashes (each change set announced once)."""
    return asyncio.run(clean_run(make_world(tmp_path_factory.mktemp("clean"), embedder, "clean")))


async def check(world: World, clean: dict[str, str]) -> None:
    """Memory equals the clean run's; each event applied once; every change set announced, repeats identical."""
    store = await SqliteMemoryStore.open(world.path, dim=world.embedder.dim)
    try:
        assert await store.content_hashes() == clean
        applied = (await store.dump())["applied_events"]
        events = [row[1] for row in applied]
        assert sorted(events) == sorted(json.loads(r.value or b"")["event_id"] for r in world.records)
        assert len(events) == len(set(events))
        assert await store.pending_count() == 0
    finally:
        await store.close()
    by_id: dict[str, set[bytes]] = {}
    announced_events: set[str] = set()
    for value in world.updates():
        update = MemoryUpdate.model_validate_json(value)
        assert update.event_id == update.change_set_id
        by_id.setdefault(update.change_set_id, set()).add(value)
        announced_events.update(update.source_event_ids)
    assert {row[2] for row in applied} <= set(by_id)  # every change set written was announced
    assert all(len(copies) == 1 for copies in by_id.values())  # a repeat is the same record, byte for byte
    assert set(events) <= announced_events


POINTS = ["before_write", "during_write", "after_write", "before_announce", "during_announce", "before_mark"]


def crash_inside_the_transaction(monkeypatch: MonkeyPatch, faults: Faults) -> None:
    """The sqlite write path raises after writing every row, before COMMIT: the transaction must roll back."""
    original: Callable[..., ApplyResult] = sqlite_write._write

    def writing_then_crashing(conn: Any, change_set: ChangeSet, vectors: list[VectorItem], dim: int) -> ApplyResult:
        result = original(conn, change_set, vectors, dim)
        faults.hit("during_write")
        return result

    monkeypatch.setattr(sqlite_write, "_write", writing_then_crashing)


@pytest.mark.parametrize("at", [1, 3])
@pytest.mark.parametrize("point", POINTS)
async def test_a_crash_at_any_point_ends_with_memory_once_and_every_change_set_announced(
    point: str,
    at: int,
    tmp_path: Path,
    embedder: MiniLMEmbedder,
    clean: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    world = make_world(tmp_path, embedder, point)
    faults = Faults(point, at)
    if point == "during_write":
        crash_inside_the_transaction(monkeypatch, faults)
    store, handler = await world.open(faults)
    with pytest.raises(Crash):
        await world.consume(handler, 8)
    crashed = faults.crashed_change_set
    assert crashed is not None and world.committed < len(world.records)
    if point in ("before_write", "during_write"):  # nothing of the crashed write is there (rolled back)
        assert await store.seen_events(crashed.user_id, crashed.event_ids) == set()
    elif point in ("after_write", "before_announce"):  # written, never announced: pending in the store
        assert [a.change_set_id for a in await store.pending_announcements(crashed.user_id, crashed.event_ids)]
    await store.close()
    monkeypatch.undo()

    store, handler = await world.open()  # the restarted worker: no faults, and its batches fall differently
    await world.consume(handler, 5)
    await store.close()
    await check(world, clean)


async def test_a_crash_after_the_announcements_were_marked_announces_nothing_twice(
    tmp_path: Path, embedder: MiniLMEmbedder, clean: dict[str, str]
) -> None:
    world = make_world(tmp_path, embedder, "after_mark")
    store, handler = await world.open(Faults("after_mark", 5))  # in the second batch (three users a batch)
    with pytest.raises(Crash):
        await world.consume(handler, 8)
    assert world.committed == 8
    await store.close()
    store, handler = await world.open()
    world.committed = 0  # redelivered from even further back: every batch before the crash comes again
    await world.consume(handler, 8)
    await store.close()
    await check(world, clean)
    ids = [MemoryUpdate.model_validate_json(v).change_set_id for v in world.updates()]
    assert len(ids) == len(set(ids))  # marked means announced: nothing is published twice


@pytest.mark.parametrize("zombie_crashes", [None, "after_write", "during_announce"])
async def test_a_rebalance_that_hands_a_batch_to_a_second_worker_while_the_first_still_works(
    zombie_crashes: str | None, tmp_path: Path, embedder: MiniLMEmbedder, clean: dict[str, str]
) -> None:
    """Worker A lost its partitions mid-batch (its offset commit fails); B got them and redelivers the batch while
    A finishes it (or crashes doing so), both over the same store."""
    world = make_world(tmp_path, embedder, "rebalance")
    faults_a = Faults(zombie_crashes, at=4)  # its first batch wrote three change sets
    store_a, worker_a = await world.open(faults_a)
    store_b, worker_b = await world.open()
    await worker_a.handle(world.records[:8])  # A's first batch, committed
    world.committed = 8
    batch = world.records[8:16]

    async def redelivered() -> None:
        # B starts once A has written the batch's first change set and not yet announced it: otherwise B may apply
        # and announce the whole batch before A gets that far, and A has nothing left to crash in
        await faults_a.reached("after_write", 4)
        await worker_b.handle(batch)

    outcomes = await asyncio.gather(worker_a.handle(batch), redelivered(), return_exceptions=True)
    assert outcomes[1] is None and (zombie_crashes is None) == (outcomes[0] is None)
    await store_a.close()
    await world.consume(worker_b, 6)  # B goes on from the last commit A made: the batch comes a third time
    await store_b.close()
    await check(world, clean)
