"""The embedded Tansu broker: starts on a free loopback port, serves a consumer group, stops by PID."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from memstream.broker import BrokerError, EmbeddedBroker, free_port, wait_for_kafka
from services.settings import Settings
from streams.topics import TopicNames, ensure_topics

pytestmark = pytest.mark.server


def port_open(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


async def test_broker_serves_a_consumer_group_and_commits_offsets(broker: EmbeddedBroker, settings: Settings) -> None:
    assert broker.bootstrap.startswith("127.0.0.1:")
    await ensure_topics(settings, broker.bootstrap)
    topic = TopicNames.from_settings(settings).chat

    producer = AIOKafkaProducer(bootstrap_servers=broker.bootstrap, acks="all")
    await producer.start()
    try:
        sent = [await producer.send_and_wait(topic, f"v{n}".encode(), key=f"user{n % 3}".encode()) for n in range(12)]
    finally:
        await producer.stop()
    # keyed records: one user's records all land on one partition
    by_key: dict[int, set[int]] = {}
    for n, meta in enumerate(sent):
        by_key.setdefault(n % 3, set()).add(meta.partition)
    assert all(len(parts) == 1 for parts in by_key.values())

    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=broker.bootstrap,
        group_id="test-group",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        session_timeout_ms=6000,
        heartbeat_interval_ms=1000,
    )
    await consumer.start()
    try:
        values: list[bytes] = []
        deadline = time.monotonic() + 20
        while len(values) < 12 and time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=500)).values():
                values.extend(r.value for r in records if r.value is not None)
        assert sorted(values) == sorted(f"v{n}".encode() for n in range(12))
        await consumer.commit()
        committed = {p: await consumer.committed(TopicPartition(topic, p)) for p in range(settings.partitions)}
    finally:
        await consumer.stop()
    expected: dict[int, int] = {}
    for meta in sent:
        expected[meta.partition] = max(expected.get(meta.partition, 0), meta.offset + 1)
    assert {p: c for p, c in committed.items() if c is not None} == expected


async def test_ensure_topics_creates_every_contract_topic_once(broker: EmbeddedBroker, settings: Settings) -> None:
    names = TopicNames.from_settings(settings).all()
    assert len(names) == 9 and all(n.startswith(settings.topic_prefix + ".") for n in names)
    assert sorted(await ensure_topics(settings, broker.bootstrap)) == sorted(names)
    assert await ensure_topics(settings, broker.bootstrap) == []  # idempotent
    admin = AIOKafkaAdminClient(bootstrap_servers=broker.bootstrap)
    await admin.start()
    try:
        described = await admin.describe_topics(names)
    finally:
        await admin.close()
    assert {d["topic"]: len(d["partitions"]) for d in described} == dict.fromkeys(names, settings.partitions)


def test_stop_ends_the_process_and_frees_the_port(tmp_path: Path) -> None:
    broker = EmbeddedBroker(tmp_path / "b")
    asyncio.run(broker.start())
    pid, port = broker.pid, broker.port
    assert pid is not None and port is not None and broker.running()
    assert port_open("127.0.0.1", port)
    broker.stop()
    assert not broker.running()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not port_open("127.0.0.1", port)
    assert "ready" in (tmp_path / "b" / "broker.log").read_text()


def test_a_broker_that_exits_at_once_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CALF_TANSU_BIN", "/bin/false")
    broker = EmbeddedBroker(tmp_path / "b", port=free_port(), ready_timeout_s=5)
    started = time.monotonic()
    with pytest.raises(BrokerError, match="exited with code 1"):
        asyncio.run(broker.start())
    assert time.monotonic() - started < 4  # noticed the exit, did not wait for the deadline
    assert not broker.running()


async def test_wait_for_kafka_gives_up_at_the_deadline() -> None:
    port = free_port()
    started = time.monotonic()
    with pytest.raises(BrokerError, match="no Kafka broker answered"):
        await wait_for_kafka(f"127.0.0.1:{port}", timeout_s=0.5)
    assert time.monotonic() - started < 3


async def test_two_brokers_run_side_by_side(tmp_path: Path) -> None:
    async with EmbeddedBroker(tmp_path / "one") as one, EmbeddedBroker(tmp_path / "two") as two:
        assert one.bootstrap != two.bootstrap
        await asyncio.gather(wait_for_kafka(one.bootstrap, 5), wait_for_kafka(two.bootstrap, 5))
    assert not one.running() and not two.running()


def test_a_port_left_in_time_wait_by_a_stopped_server_is_free_again_and_a_listening_one_is_not() -> None:
    """`memstream up` right after a stop: the old gateway's connections linger in TIME_WAIT for a minute; the
    port check binds as uvicorn does (SO_REUSEADDR), so they do not block the restart. A live listener still does."""
    from memstream.broker import port_free

    host = "127.0.0.1"
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((host, 0))
    port = server.getsockname()[1]
    server.listen()
    client = socket.create_connection((host, port))
    accepted, _ = server.accept()
    assert not port_free(host, port)  # a server listens there
    accepted.close()  # the server closes first: its side of the connection goes to TIME_WAIT
    client.close()
    server.close()
    # what the old check did: a bind without SO_REUSEADDR fails now
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind((host, port))
    assert port_free(host, port)
