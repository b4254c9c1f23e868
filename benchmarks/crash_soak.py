"""Randomized kill test: exactly-once memory and announcements across ``kill -9`` of workers (and of the broker).

The rule-based scripted LLM, the real embedder and store, Faust worker processes. While messages of several users
are memorized, a kill comes whenever the applied-event count passes one of the ``--kills`` (+ ``--broker-kills``)
thresholds drawn from a seeded RNG; every kill and restart also rebalances the group. Then it waits, polling with
a deadline, until every event is applied, every change set written was seen on the memory-update topic and nothing
is pending announcement, and compares each user's memory with a clean run of the same messages (in-process
memorize handler over a fresh store, batches of 64 records). Near-duplicate merging is off
(``duplicate_min_similarity=1.0``): it depends on how messages fell into batches, crash or not.

Two ways in:

- default: messages produced straight onto the chat topic of an embedded Tansu broker, or of the Apache Kafka at
  ``--broker HOST:PORT`` (topics and consumer group of the run's own, so the broker can be shared); workers run
  apart (``memstream worker``), a random one is SIGKILLed and started again at once. The broker is not killed.
- ``--through-gateway``: ``memstream up --workers N`` on the embedded broker, messages POSTed through its gateway
  with an API key (one client per user, in order; a request not answered 202 is sent again, same event ids).
  A random live worker is SIGKILLed (``up`` restarts it, with its backoff), and ``--broker-kills`` times the
  embedded broker (``up`` restarts it with the gateway and workers above it; the gateway replays its outbox).
  The broker's records, memory updates included, die with it: a change set counts as announced when the observer
  (a consumer reading the memory-update topic from its beginning, reconnected to each new broker) saw it. Before
  each broker kill the observer reads up to the broker's end offsets; a change set written before that kill and
  never seen is reported apart (``unseen_written_before_a_broker_kill``: acked by a broker that then died), not
  as a failure; one written after it and never seen is.

  python benchmarks/crash_soak.py --messages 5000 --users 10 --kills 20 --workers 2 --seed 1
  python benchmarks/crash_soak.py --broker "$MEMSTREAM_BROKER" --messages 5000 --users 10 --kills 20 --seed 1
  python benchmarks/crash_soak.py --through-gateway --broker-kills 4 --messages 5000 --users 10 --kills 20

Prints a JSON summary as its last line; exits non-zero when anything was lost, duplicated or left unannounced.
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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential_jitter

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the gateway mode drives `memstream up` with the fault tests' helpers

from memstream.broker import EmbeddedBroker, free_port, free_port_block, wait_for_kafka  # noqa: E402
from memstream.processes import stop_process  # noqa: E402
from memstream.runtime import child_env  # noqa: E402
from schemas.events import ChatMessage, MemoryUpdate  # noqa: E402
from services.adapters.minilm import MiniLMEmbedder  # noqa: E402
from services.adapters.sqlite import SqliteMemoryStore  # noqa: E402
from services.llm.scripted import rule_based_llm  # noqa: E402
from services.logging import configure_logging  # noqa: E402
from services.memorize.service import MemorizeService  # noqa: E402
from services.settings import Settings  # noqa: E402
from streams.codec import encode  # noqa: E402
from streams.gateway.client import bearer  # noqa: E402
from streams.gateway.keys import create_key  # noqa: E402
from streams.handlers import MemorizeHandler, Record  # noqa: E402
from streams.topics import TopicNames, ensure_topics  # noqa: E402
from tests.test_durability import Up, children_of  # noqa: E402

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


def settings_for(data_dir: Path, broker: str | None = None, **overrides: Any) -> Settings:
    """Soak settings; on a shared Kafka (``broker``) the run gets topics and a group of its own."""
    run = f"soak-{os.getpid()}-{time.time_ns()}"
    values: dict[str, Any] = {
        "data_dir": data_dir,
        "broker": broker,
        "kafka_idempotence": broker is not None,  # the embedded Tansu has no idempotent producers
        "topic_prefix": run if broker else "memstream",
        "consumer_group": run if broker else "memstream",
        "llm": "scripted",
        "scripted_llm": "services.llm.scripted:rule_based_llm",
        "qa_engine": "simple",
        "partitions": 4,
        "broker_session_timeout_s": 6.0,
        "batch_wait_s": 0.2,
        "port": free_port(),
        "worker_web_port": free_port_block(8),  # workers use it and the ports after it
        "log_json": True,
        "log_level": "WARNING",
        # near-duplicate merging compares a fact with the theses already stored, so whether two similar messages
        # merge depends on whether they fell into one batch or two: memory would differ from the clean run's
        # however nothing crashed. Off here, so the content hash is a function of the events alone.
        "duplicate_min_similarity": 1.0,
        **overrides,
    }
    return Settings(_env_file=None, **values)


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
    """Every record on the memory-update topic since its beginning: count per change set, and the distinct bytes.

    ``connect`` again after an embedded broker was restarted: the new one starts empty, so reading it from its
    beginning misses nothing that was published to it."""

    def __init__(self, topic: str) -> None:
        self.topic = topic
        self.consumer: AIOKafkaConsumer | None = None
        self.copies: dict[str, set[bytes]] = {}
        self.records = 0

    async def connect(self, bootstrap: str) -> None:
        await self.close()
        consumer = AIOKafkaConsumer(
            self.topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", group_id=None
        )
        await consumer.start()
        self.consumer = consumer

    async def close(self) -> None:
        consumer, self.consumer = self.consumer, None
        if consumer is not None:
            await consumer.stop()

    async def poll(self) -> int:
        """Read what is there (waiting at most 200 ms); return how many records came."""
        if self.consumer is None:
            return 0
        got = 0
        for batch in (await self.consumer.getmany(timeout_ms=200)).values():
            for record in batch:
                update = MemoryUpdate.model_validate_json(record.value or b"")
                self.copies.setdefault(update.change_set_id, set()).add(record.value or b"")
                got += 1
        self.records += got
        return got

    async def drain(self, timeout_s: float = 30.0) -> None:
        """Read every record the broker holds now (up to its end offsets)."""
        consumer = self.consumer
        if consumer is None:
            return
        deadline = time.monotonic() + timeout_s
        while not consumer.assignment() and time.monotonic() < deadline:
            await self.poll()
        ends = await consumer.end_offsets(list(consumer.assignment()))
        while time.monotonic() < deadline:
            positions = {tp: await consumer.position(tp) for tp in ends}
            if all(positions[tp] >= end for tp, end in ends.items()):
                return
            await self.poll()
        raise TimeoutError("the memory-update observer could not read up to the end offsets")


async def clean_hashes(messages: list[ChatMessage], topics: TopicNames, settings: Settings) -> dict[str, str]:
    """The same messages memorized without any crash, in-process (batches of 64 records)."""

    class Discard:
        async def publish(self, topic: str, key: bytes | None, value: bytes) -> None:
            return None

    with tempfile.TemporaryDirectory() as tmp:
        embedder = MiniLMEmbedder()
        async with await SqliteMemoryStore.open(Path(tmp) / "clean.sqlite3", dim=embedder.dim) as store:
            service = MemorizeService(store.stores(), rule_based_llm(), embedder, settings)
            handler = MemorizeHandler(service, Discard(), topics)
            records = [Record(topics.chat, m.user_id.encode(), encode(m)) for m in messages]
            for i in range(0, len(records), 64):
                await handler.handle(records[i : i + 64])
            return await store.content_hashes()


#: kill(applied count) -> an entry for the kill log, or None when no victim is there now (try again later)
Kill = Callable[[int], Awaitable[dict[str, Any] | None]]


@dataclass
class Run:
    """The part both modes share: kill at the thresholds, wait until everything is applied and announced."""

    settings: Settings
    wanted: set[str]
    seen: Announcements
    thresholds: list[int]
    deadline: float
    started: float = field(default_factory=time.perf_counter)
    kill_log: list[dict[str, Any]] = field(default_factory=list)
    #: change sets already in the store when an embedded broker was killed: their announcement may have died
    #: with that broker's records before the observer read it
    before_broker_kills: set[str] = field(default_factory=set)

    def elapsed(self) -> float:
        return round(time.perf_counter() - self.started, 1)

    async def until_settled(self, kill: Kill, check: Callable[[], None], inputs_done: Callable[[], bool]) -> bool:
        """Kill at each threshold; return True once every wanted event is applied, nothing is pending and every
        change set was seen announced (or may have died with a killed broker), False at the deadline."""
        while time.monotonic() < self.deadline:
            check()
            await self.seen.poll()
            rows = applied_events(self.settings.store_path)
            while self.thresholds and len(rows) >= self.thresholds[0]:
                entry = await kill(len(rows))
                if entry is None:
                    break
                self.kill_log.append({"at_applied": len(rows), **entry, "t_s": self.elapsed()})
                self.thresholds.pop(0)
            unseen = {cs for _, _, cs in rows} - set(self.seen.copies) - self.before_broker_kills
            if inputs_done() and not self.thresholds and not unseen and self.wanted <= {e for _, e, _ in rows}:
                async with await SqliteMemoryStore.open(self.settings.store_path, dim=MiniLMEmbedder.dim) as store:
                    if await store.pending_count() == 0:
                        return True
        return False

    async def report(self, accepted: list[ChatMessage], settled: bool, **extra: Any) -> dict[str, Any]:
        elapsed = self.elapsed()
        rows = applied_events(self.settings.store_path)
        async with await SqliteMemoryStore.open(self.settings.store_path, dim=MiniLMEmbedder.dim) as store:
            hashes = await store.content_hashes()
            pending = await store.pending_count()
            vertices = len((await store.dump())["vertices"])
        clean = await clean_hashes(accepted, TopicNames.from_settings(self.settings), self.settings)
        events = [event for _, event, _ in rows]
        change_sets = {cs for _, _, cs in rows}
        unseen = change_sets - set(self.seen.copies)
        return {
            **extra,
            "settled": settled,
            "seconds": elapsed,
            "accepted": len(accepted),
            "lost": len({m.event_id for m in accepted} - set(events)),
            "duplicated_events": len(events) - len(set(events)),
            "users_differing_from_clean": sorted(u for u in clean if hashes.get(u) != clean[u]),
            "vertices": vertices,
            "change_sets": len(change_sets),
            "unannounced_change_sets": len(unseen - self.before_broker_kills),
            "unseen_written_before_a_broker_kill": len(unseen & self.before_broker_kills),
            "pending_announcements": pending,
            "memory_update_records": self.seen.records,
            "announced_again": self.seen.records - len(self.seen.copies),
            "ids_with_differing_copies": sum(len(c) > 1 for c in self.seen.copies.values()),
            "kill_log": self.kill_log,
        }


def default_deadline(messages: int, kills: int, timeout_s: float | None) -> float:
    return time.monotonic() + (timeout_s or max(600.0, messages * 0.6 + kills * 30))


async def soak(
    messages: int,
    users: int,
    kills: int,
    workers: int,
    seed: int,
    data_dir: Path,
    timeout_s: float | None = None,
    broker: str | None = None,
) -> dict[str, Any]:
    """Messages produced straight onto the chat topic of the embedded broker, or of the Kafka at ``broker``
    (topics and group of the run's own); workers run apart and are killed."""
    rng = random.Random(seed)
    batch = make_messages(messages, users, seed)
    settings = settings_for(data_dir, broker)
    topics = TopicNames.from_settings(settings)
    # kill whenever the applied count passes one of these (random moments of the ingest)
    thresholds = sorted(rng.sample(range(messages // 20, messages * 19 // 20), kills))
    embedded = EmbeddedBroker(data_dir / "broker") if broker is None else None
    if embedded is not None:
        bootstrap = await embedded.start()
    else:
        bootstrap = broker or ""
        await wait_for_kafka(bootstrap)
    crew = Workers(settings, bootstrap, workers)
    seen = Announcements(topics.memory_updates)
    run = Run(settings, {m.event_id for m in batch}, seen, thresholds, default_deadline(messages, kills, timeout_s))

    async def kill(applied: int) -> dict[str, Any]:
        victim = rng.randrange(workers)
        crew.kill(victim)
        crew.start(victim)
        return {"worker": victim}

    try:
        await ensure_topics(settings, bootstrap)
        for n in range(workers):
            crew.start(n)
        producer = AIOKafkaProducer(
            bootstrap_servers=bootstrap, acks="all", linger_ms=5, enable_idempotence=broker is not None
        )
        await producer.start()
        await seen.connect(bootstrap)
        try:
            for m in batch:
                await producer.send(topics.chat, encode(m), key=m.user_id.encode())
            await producer.flush()
            produced_s = run.elapsed()
            settled = await run.until_settled(kill, crew.check, lambda: True)
        finally:
            await producer.stop()
            await seen.close()
    finally:
        crew.stop()
        if embedded is not None:
            embedded.stop()
    return await run.report(
        batch,
        settled,
        broker=broker or "embedded",
        messages=messages,
        users=users,
        workers=workers,
        seed=seed,
        kills=len(run.kill_log),
        worker_starts=crew.starts,
        produce_s=produced_s,
    )


def broker_bootstrap(pid: int) -> str:
    """The address the embedded broker process ``pid`` advertises (its command line)."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return argv[argv.index("--advertised-listener-url") + 1].removeprefix("tcp://")


class Refused(Exception):
    """A POST the gateway did not accept (not 202): the client sends it again."""


@dataclass
class Poster:
    """Each user's messages POSTed in order, a few per request, one client per user; a request that is not
    answered 202 (the gateway restarting with the broker, 503, connection refused) is sent again, the same
    events with the same ids."""

    url: str
    key: str
    deadline: float
    accepted_ids: set[str]  # shared with the run, which waits for these
    per_request: int = 5
    accepted: list[ChatMessage] = field(default_factory=list)
    requests: int = 0
    refused: int = 0

    async def post_all(self, batch: list[ChatMessage]) -> None:
        users = sorted({m.user_id for m in batch})
        async with httpx.AsyncClient(base_url=self.url, timeout=30.0, headers=bearer(self.key)) as http:
            await asyncio.gather(*(self._post_user(http, [m for m in batch if m.user_id == u]) for u in users))

    async def _post_user(self, http: httpx.AsyncClient, mine: list[ChatMessage]) -> None:
        for i in range(0, len(mine), self.per_request):
            chunk = mine[i : i + self.per_request]
            body = [
                m.model_dump(mode="json", include={"event_id", "user_id", "speaker", "text", "event_time"})
                for m in chunk
            ]
            retrying = AsyncRetrying(
                retry=retry_if_exception_type((Refused, httpx.TransportError)),
                wait=wait_exponential_jitter(multiplier=0.2, max=3.0),
                stop=stop_after_delay(max(1.0, self.deadline - time.monotonic())),
                reraise=True,
            )
            try:
                async for attempt in retrying:
                    with attempt:
                        await self._post(http, body)
            except (Refused, httpx.TransportError):
                continue  # never accepted: not counted as accepted
            self.accepted.extend(chunk)
            self.accepted_ids.update(m.event_id for m in chunk)

    async def _post(self, http: httpx.AsyncClient, body: list[dict[str, Any]]) -> None:
        self.requests += 1
        try:
            response = await http.post("/v1/messages", json=body)
        except httpx.TransportError:
            self.refused += 1
            raise
        if response.status_code != 202:
            self.refused += 1
            if response.status_code < 500 and response.status_code != 429:
                raise RuntimeError(f"the gateway rejected a valid body: {response.status_code} {response.text}")
            raise Refused(response.status_code)


async def soak_through_gateway(
    messages: int,
    users: int,
    kills: int,
    broker_kills: int,
    workers: int,
    seed: int,
    data_dir: Path,
    timeout_s: float | None = None,
) -> dict[str, Any]:
    """`memstream up --workers N` on the embedded broker; messages POSTed through its gateway (API key, durable
    outbox); ``kills`` SIGKILLs of a worker and ``broker_kills`` of the embedded broker, which `up` restarts (with
    the gateway and workers above it; the gateway replays its outbox into the new, empty broker)."""
    rng = random.Random(seed)
    batch = make_messages(messages, users, seed)
    settings = settings_for(data_dir, rate_writes_per_min=0)
    topics = TopicNames.from_settings(settings)
    total = kills + broker_kills
    thresholds = sorted(rng.sample(range(messages // 20, messages * 19 // 20), total))
    broker_turns = set(rng.sample(range(total), broker_kills))
    key = create_key(settings, ["*"], ["admin"], label="crash-soak")
    up = Up(settings, data_dir / "up.log", workers)
    up.env["MEMSTREAM_API_KEY"] = key  # with a key there, `up` makes no admin key of its own
    seen = Announcements(topics.memory_updates)
    deadline = default_deadline(messages, total, timeout_s)
    run = Run(settings, set(), seen, thresholds, deadline)
    poster = Poster(up.url, key, deadline, run.wanted)
    counts = {"worker": 0, "broker": 0}

    def roles() -> dict[str, list[int]]:
        assert up.process is not None
        found: dict[str, list[int]] = {}
        for pid, role in children_of(up.process.pid).items():
            found.setdefault(role, []).append(pid)
        return found

    def check() -> None:
        assert up.process is not None
        if up.process.poll() is not None:
            raise RuntimeError(f"`memstream up` exited with {up.process.returncode}; see {up.log}")

    async def restarted(old: dict[str, list[int]]) -> dict[str, list[int]] | None:
        """The new broker, gateway and workers once the new gateway answers /healthz."""
        now = roles()
        if now.get("broker") in (None, old["broker"]) or now.get("gateway") in (None, old["gateway"]):
            return None
        if len(now.get("worker", [])) != workers:
            return None
        with contextlib.suppress(httpx.HTTPError, ValueError):
            async with httpx.AsyncClient(timeout=2.0) as http:
                body = (await http.get(f"{up.url}/healthz")).json()
            if body.get("pid") in now["gateway"]:
                return now
        return None

    async def kill(applied: int) -> dict[str, Any] | None:
        turn = len(run.kill_log)
        now = roles()
        if turn in broker_turns:
            if not now.get("broker") or not now.get("gateway"):
                return None
            await seen.drain()  # what the observer read before the broker died counts as announced
            run.before_broker_kills |= {cs for _, _, cs in applied_events(settings.store_path)}
            os.kill(now["broker"][0], signal.SIGKILL)
            killed = time.perf_counter()
            await seen.close()
            while (new := await restarted(now)) is None:
                check()
                if time.monotonic() > deadline:
                    raise TimeoutError("the broker and the processes above it did not come back")
                await asyncio.sleep(0.2)  # polling interval of a condition with a deadline
            await seen.connect(broker_bootstrap(new["broker"][0]))
            counts["broker"] += 1
            return {"broker": now["broker"][0], "back_after_s": round(time.perf_counter() - killed, 1)}
        live = sorted(now.get("worker", []))
        if not live:
            return None  # both workers wait for their restart (backoff): kill when one is back
        victim = rng.choice(live)
        os.kill(victim, signal.SIGKILL)
        counts["worker"] += 1
        return {"worker": victim}

    try:
        up.start()
        children = await asyncio.to_thread(up.wait_ready)
        await seen.connect(broker_bootstrap(next(p for p, r in children.items() if r == "broker")))
        posting = asyncio.create_task(poster.post_all(batch))
        try:
            settled = await run.until_settled(kill, check, posting.done)
        finally:
            if not posting.done():
                posting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await posting
            await seen.close()
        restarts = up.output().count('"process_restarted"')
    finally:
        await asyncio.to_thread(up.stop)
    return await run.report(
        poster.accepted,
        settled,
        broker="embedded, under `memstream up`",
        messages=messages,
        users=users,
        workers=workers,
        seed=seed,
        kills=counts["worker"],
        broker_kills=counts["broker"],
        restarts_logged_by_up=restarts,
        requests=poster.requests,
        requests_not_accepted=poster.refused,
    )


def failures(report: dict[str, Any]) -> list[str]:
    problems = [] if report["settled"] else ["not settled before the deadline"]
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
    parser.add_argument("--kills", type=int, default=20, help="SIGKILLs of a worker")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--broker", default=None, help="HOST:PORT of a Kafka to run on (default: embedded Tansu)")
    parser.add_argument(
        "--through-gateway", action="store_true", help="POST through the gateway of `memstream up` (embedded)"
    )
    parser.add_argument("--broker-kills", type=int, default=0, help="SIGKILLs of the embedded broker (gateway mode)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds (default: scales with the messages)")
    parser.add_argument("--data-dir", type=Path, default=None, help="keep the run's files here (default: a tmp dir)")
    args = parser.parse_args()
    if args.broker_kills and not args.through_gateway:
        parser.error("--broker-kills needs --through-gateway: only the gateway's outbox survives a broker kill")
    if args.through_gateway and args.broker:
        parser.error("--through-gateway runs the embedded broker under `memstream up`; leave out --broker")
    configure_logging("WARNING")
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = args.data_dir or Path(tmp)
        if args.through_gateway:
            work = soak_through_gateway(
                args.messages,
                args.users,
                args.kills,
                args.broker_kills,
                args.workers,
                args.seed,
                data_dir,
                args.timeout,
            )
        else:
            work = soak(
                args.messages, args.users, args.kills, args.workers, args.seed, data_dir, args.timeout, args.broker
            )
        report = asyncio.run(work)
    print(json.dumps(report))
    problems = failures(report)
    if problems:
        print("FAILED: " + "; ".join(problems), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
