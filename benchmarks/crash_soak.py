"""Randomized kill test on the embedded stack: exactly-once memory and announcements across ``kill -9`` of workers.

A real Tansu broker, Faust worker processes run apart from it (``memstream worker``), the rule-based scripted LLM
and the real embedder and store. Messages of several users go straight onto the chat topic; while they are
memorized, a random worker is killed with SIGKILL whenever the applied-event count passes one of ``--kills``
thresholds drawn from a seeded RNG, and started again at once (each kill and restart also rebalances the group).
Then it waits, polling with a deadline, until every event is applied, every change set written was seen on the
memory-update topic and nothing is pending announcement, and compares each user's memory with a clean run of the
same messages (in-process memorize handler over a fresh store, batches of 64 records). Near-duplicate merging is
off (``duplicate_min_similarity=1.0``): it depends on how messages fell into batches, crash or not.

  python benchmarks/crash_soak.py --messages 5000 --users 10 --kills 20 --workers 2 --seed 1

Prints a JSON summary as its last line; exits non-zero when anything was lost, duplicated or left unannounced.
The broker is not killed: the embedded broker keeps records in memory (durability of the embedded ingestion is
another piece of work).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from memstream.broker import EmbeddedBroker, free_port
from memstream.processes import stop_process
from memstream.runtime import child_env
from schemas.events import ChatMessage, MemoryUpdate
from services.adapters.minilm import MiniLMEmbedder
from services.adapters.sqlite import SqliteMemoryStore
from services.llm.scripted import rule_based_llm
from services.logging import configure_logging
from services.memorize.service import MemorizeService
from services.settings import Settings
from streams.codec import encode
from streams.handlers import MemorizeHandler, Record
from streams.topics import TopicNames, ensure_topics

T0 = datetime(2024, 1, 1, 8, 0, tzinfo=UTC)
NAMES = ("Maria", "Jonas", "Aiko", "Tomas", "Leila", "Priya", "Omar", "Greta", "Ivan", "Noor", "Elif", "Sven")
PLACES = ("Lisbon", "Oslo", "Kyoto", "Quito", "Dakar", "Perth", "Tartu", "Cusco", "Hanoi", "Bergen", "Malmo")
VERBS = ("visited", "called", "cooked for", "wrote to", "hiked with", "painted", "met", "helped")


def make_messages(count: int, users: int, seed: int) -> list[ChatMessage]:
    """``count`` messages of ``users`` users, interleaved; every text its own, every clock fixed by the seed."""
    rng = random.Random(seed)
    out = []
    for n in range(count):
        user = f"user{n % users}"
        text = f"I {rng.choice(VERBS)} {rng.choice(NAMES)} in {rng.choice(PLACES)} (note {n})."
        out.append(
            ChatMessage(
                event_id=f"m{n}-{user}",
                user_id=user,
                speaker=user.title(),
                text=text,
                event_time=T0 + timedelta(minutes=n),
                ingest_time=T0 + timedelta(days=1, seconds=n),
            )
        )
    return out


def settings_for(data_dir: Path) -> Settings:
    values: dict[str, Any] = {
        "data_dir": data_dir,
        "broker": None,
        "llm": "scripted",
        "scripted_llm": "services.llm.scripted:rule_based_llm",
        "qa_engine": "simple",
        "partitions": 4,
        "broker_session_timeout_s": 6.0,
        "batch_wait_s": 0.2,
        "port": free_port(),
        "worker_web_port": free_port(),
        "log_json": True,
        "log_level": "WARNING",
        # near-duplicate merging compares a fact with the theses already stored, so whether two similar messages
        # merge depends on whether they fell into one batch or two: memory would differ from the clean run's
        # however nothing crashed. Off here, so the content hash is a function of the events alone.
        "duplicate_min_similarity": 1.0,
    }
    return Settings(_env_file=None, **values)  # type: ignore[call-arg]


@dataclass
class Workers:
    """Worker processes (``memstream worker``), each restartable under its own name and log."""

    settings: Settings
    bootstrap: str
    count: int
    processes: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    starts: int = 0

    def start(self, n: int) -> None:
        log_dir = self.settings.data_dir / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        env = child_env(self.settings, self.bootstrap, None)
        port = str(self.settings.worker_web_port + n)
        with (log_dir / f"worker-{n}.log").open("ab") as out:
            self.processes[n] = subprocess.Popen(
                [sys.executable, "-m", "memstream.cli", "worker", "--bootstrap", self.bootstrap, "--web-port", port],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        self.starts += 1

    def kill(self, n: int) -> None:
        process = self.processes[n]
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=10)

    def check(self) -> None:
        for n, process in self.processes.items():
            if process.poll() is not None:
                raise RuntimeError(f"worker-{n} exited by itself with code {process.returncode}")

    def stop(self) -> None:
        for process in self.processes.values():
            stop_process(process, 20.0)


def applied_events(path: Path) -> list[tuple[str, str, str]]:
    """(user, event, change set) of every applied event, read beside the running workers (WAL readers)."""
    if not path.exists():
        return []
    conn = sqlite3.connect(path, timeout=10)
    try:
        return [tuple(row) for row in conn.execute("SELECT user_id, event_id, change_set_id FROM applied_events")]
    except sqlite3.OperationalError:  # the first worker is still creating the schema
        return []
    finally:
        conn.close()


class Announcements:
    """Every record on the memory-update topic since its beginning: count per change set, and the distinct bytes."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.consumer = AIOKafkaConsumer(
            topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", group_id=None
        )
        self.copies: dict[str, set[bytes]] = {}
        self.records = 0

    async def poll(self) -> None:
        for batch in (await self.consumer.getmany(timeout_ms=200)).values():
            for record in batch:
                update = MemoryUpdate.model_validate_json(record.value or b"")
                self.copies.setdefault(update.change_set_id, set()).add(record.value or b"")
                self.records += 1


async def clean_hashes(messages: list[ChatMessage], topics: TopicNames, settings: Settings) -> dict[str, str]:
    """The same messages memorized without any crash, in-process (batches of 64 records)."""

    class Discard:
        async def publish(self, topic: str, key: bytes | None, value: bytes) -> None:
            return None

    with tempfile.TemporaryDirectory() as tmp:
        embedder = MiniLMEmbedder()
        async with await SqliteMemoryStore.open(Path(tmp) / "clean.sqlite3", dim=embedder.dim) as store:
            service = MemorizeService(store, rule_based_llm(), embedder, settings)
            handler = MemorizeHandler(service, Discard(), topics)
            records = [Record(topics.chat, m.user_id.encode(), encode(m)) for m in messages]
            for i in range(0, len(records), 64):
                await handler.handle(records[i : i + 64])
            return await store.content_hashes()


async def soak(
    messages: int, users: int, kills: int, workers: int, seed: int, data_dir: Path, timeout_s: float | None = None
) -> dict[str, Any]:
    rng = random.Random(seed)
    batch = make_messages(messages, users, seed)
    settings = settings_for(data_dir)
    topics = TopicNames.from_settings(settings)
    deadline = time.monotonic() + (timeout_s or max(600.0, messages * 0.6 + kills * 30))
    # kill whenever the applied count passes one of these (random moments of the ingest)
    thresholds = sorted(rng.sample(range(messages // 20, messages * 19 // 20), kills))
    broker = EmbeddedBroker(data_dir / "broker")
    bootstrap = await broker.start()
    crew = Workers(settings, bootstrap, workers)
    kill_log: list[dict[str, Any]] = []
    started = time.perf_counter()
    try:
        await ensure_topics(settings, bootstrap)
        for n in range(workers):
            crew.start(n)
        seen = Announcements(bootstrap, topics.memory_updates)
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
        await producer.start()
        await seen.consumer.start()
        try:
            for m in batch:
                await producer.send(topics.chat, encode(m), key=m.user_id.encode())
            await producer.flush()
            produced_s = time.perf_counter() - started
            wanted = {m.event_id for m in batch}
            while True:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"not done before the deadline: {len(applied_events(settings.store_path))}")
                crew.check()
                await seen.poll()
                rows = applied_events(settings.store_path)
                while thresholds and len(rows) >= thresholds[0]:
                    victim = rng.randrange(workers)
                    crew.kill(victim)
                    crew.start(victim)
                    kill_log.append(
                        {"at_applied": len(rows), "worker": victim, "t_s": round(time.perf_counter() - started, 1)}
                    )
                    thresholds.pop(0)
                done = wanted <= {event for _, event, _ in rows}
                if done and not thresholds and {cs for _, _, cs in rows} <= set(seen.copies):
                    async with await SqliteMemoryStore.open(settings.store_path, dim=MiniLMEmbedder.dim) as store:
                        if await store.pending_count() == 0:
                            break
            elapsed = time.perf_counter() - started
        finally:
            await producer.stop()
            await seen.consumer.stop()
    finally:
        crew.stop()
        broker.stop()

    rows = applied_events(settings.store_path)
    async with await SqliteMemoryStore.open(settings.store_path, dim=MiniLMEmbedder.dim) as store:
        hashes = await store.content_hashes()
        pending = await store.pending_count()
        vertices = len((await store.dump())["vertices"])
    clean = await clean_hashes(batch, topics, settings)
    events = [event for _, event, _ in rows]
    change_sets = {cs for _, _, cs in rows}
    return {
        "messages": messages,
        "users": users,
        "workers": workers,
        "seed": seed,
        "kills": len(kill_log),
        "worker_starts": crew.starts,
        "produce_s": round(produced_s, 1),
        "seconds": round(elapsed, 1),
        "lost": len({m.event_id for m in batch} - set(events)),
        "duplicated_events": len(events) - len(set(events)),
        "users_differing_from_clean": sorted(u for u in clean if hashes.get(u) != clean[u]),
        "vertices": vertices,
        "change_sets": len(change_sets),
        "unannounced_change_sets": len(change_sets - set(seen.copies)),
        "pending_announcements": pending,
        "memory_update_records": seen.records,
        "announced_again": seen.records - len(seen.copies),
        "ids_with_differing_copies": sum(len(c) > 1 for c in seen.copies.values()),
        "kill_log": kill_log,
    }


def failures(report: dict[str, Any]) -> list[str]:
    problems = []
    for key in ("lost", "duplicated_events", "unannounced_change_sets", "pending_announcements"):
        if report[key]:
            problems.append(f"{key}={report[key]}")
    if report["users_differing_from_clean"]:
        problems.append(f"users differing from the clean run: {report['users_differing_from_clean']}")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--users", type=int, default=10)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=None, help="seconds (default: scales with the messages)")
    parser.add_argument("--data-dir", type=Path, default=None, help="keep the run's files here (default: a tmp dir)")
    args = parser.parse_args()
    configure_logging("WARNING")
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = args.data_dir or Path(tmp)
        report = asyncio.run(
            soak(args.messages, args.users, args.kills, args.workers, args.seed, data_dir, args.timeout)
        )
    print(json.dumps(report))
    problems = failures(report)
    if problems:
        print("FAILED: " + "; ".join(problems), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
