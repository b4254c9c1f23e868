"""The catch-up estimate a user reads to know when memory is current: a backlog shows, then drains to zero."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from prometheus_client import REGISTRY, generate_latest

from memstream.broker import EmbeddedBroker
from services.settings import Settings
from streams.lag import CatchUpEstimator, LagSensor, catch_up_from_metrics, catch_up_line, members_of
from streams.topics import ensure_topics


async def publish(bootstrap: str, topic: str, partitions: list[int]) -> None:
    """One record into each partition listed, each sent on its own (a batch of one)."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    try:
        for partition in partitions:
            await producer.send_and_wait(topic, b"x", partition=partition)
    finally:
        await producer.stop()


@asynccontextmanager
async def running_sensor(
    broker: EmbeddedBroker, settings: Settings, group: str, topic: str
) -> AsyncIterator[LagSensor]:
    """A started sensor of ``group`` on ``topic`` whose sampling period (an hour) never ends within a test."""
    sensor = LagSensor(broker.bootstrap, group, [topic], interval_s=3600, settings=settings)
    await sensor.start()
    try:
        yield sensor
    finally:
        await sensor.stop()


async def until(check: Callable[[], bool], what: str, deadline: float) -> None:
    """Poll ``check`` until it holds; fail saying ``what`` once ``deadline`` (monotonic) has passed."""
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)  # polling the condition, with the deadline above


def test_a_backlog_is_visible_then_drains() -> None:
    estimator = CatchUpEstimator()
    first = estimator.update("chat", committed=0, backlog=100, now=0.0)
    assert first.backlog == 100 and first.seconds is None  # no rate yet: not "0 s", unknown
    draining = estimator.update("chat", committed=40, backlog=60, now=10.0)  # 4 records/s
    assert draining.rate_per_s == 4.0 and draining.seconds == 15.0
    stalled = estimator.update("chat", committed=40, backlog=70, now=20.0)  # nothing committed: no estimate
    assert stalled.seconds is None
    caught_up = estimator.update("chat", committed=110, backlog=0, now=25.0)
    assert caught_up.backlog == 0 and caught_up.seconds == 0.0 and caught_up.rate_per_s == 14.0


def test_topics_are_estimated_apart() -> None:
    estimator = CatchUpEstimator()
    estimator.update("chat", committed=0, backlog=10, now=0.0)
    estimator.update("docs", committed=0, backlog=10, now=0.0)
    assert estimator.update("chat", committed=10, backlog=0, now=1.0).rate_per_s == 10.0
    assert estimator.update("docs", committed=1, backlog=9, now=1.0).seconds == 9.0


def test_the_published_estimate_reads_back_from_the_metrics_page() -> None:
    page = "\n".join(
        [
            'memstream_memorize_backlog_messages{topic="chat"} 12.0',
            'memstream_memorize_backlog_messages{topic="docs"} 3.0',
            'memstream_memorize_catchup_seconds{topic="chat"} 6.0',
            'memstream_memorize_catchup_seconds{topic="docs"} 1.5',
            'memstream_memorize_worker_backlog_messages{worker="w-1"} 15.0',
            'memstream_memorize_worker_catchup_seconds{worker="w-1"} -1.0',
            "memstream_memorize_lag_sampled_timestamp_seconds 1764900000.5",
            "",
        ]
    )
    read = catch_up_from_metrics(page)
    workers = {"w-1": {"backlog": 15, "catchup_s": None}}
    assert read == {"backlog": 15, "catchup_s": 6.0, "sampled_at": 1764900000.5, "workers": workers}
    assert catch_up_from_metrics("") == {}


def test_members_and_the_partitions_they_hold() -> None:
    # a member row as Apache Kafka answers it: partitions 0-3 of one topic
    partitions = b"".join(n.to_bytes(4) for n in range(4))
    kafka = b"\x00\x00\x00\x00\x00\x01\x00\x04chat\x00\x00\x00\x04" + partitions + b"\x00\x00\x00\x00"
    wanted = [TopicPartition("chat", n) for n in (0, 1, 2)]
    assert members_of([("w-1", "c", "h", b"", kafka)], wanted) == {"w-1": wanted}
    # the embedded broker leaves the assignment out: a lone member holds everything, several tell nothing
    assert members_of([("w-1", "", "", b"", b"")], wanted) == {"w-1": wanted}
    assert members_of([("w-1", "", "", b"", b""), ("w-2", "", "", b"", b"")], wanted) == {}


@pytest.mark.server
async def test_each_worker_sees_the_backlog_of_the_partitions_it_holds(
    broker: EmbeddedBroker, settings: Settings
) -> None:
    await ensure_topics(settings, broker.bootstrap)
    topic = settings.topic("chat")
    await publish(broker.bootstrap, topic, [n % 2 for n in range(6)])
    group = "catch-up-test-group"
    worker = AIOKafkaConsumer(topic, bootstrap_servers=broker.bootstrap, group_id=group, enable_auto_commit=False)
    await worker.start()
    sensor = LagSensor(broker.bootstrap, group, [topic], interval_s=3600)
    await sensor.start()
    try:
        deadline = time.monotonic() + 30
        while not worker.assignment():  # joined the group once it holds its partitions
            assert time.monotonic() < deadline, "the worker never joined"
            await worker.getmany(timeout_ms=200, max_records=1)
        while topic not in sensor.catch_up:  # the sampling loop's first sample is done: it samples no more
            assert time.monotonic() < deadline, "never sampled"
            await asyncio.sleep(0.05)  # polling the condition, with the deadline above
        await sensor.sample()
        (member,) = sensor.workers
        assert sensor.workers[member].backlog == 6
        await worker.commit({tp: 3 for tp in worker.assignment()})  # 3 records in each of the 2 partitions
        await sensor.sample()
        now = sensor.workers[member]
        assert now.backlog == 0 and now.seconds == 0.0 and now.rate_per_s > 0
        read = catch_up_from_metrics(generate_latest(REGISTRY).decode())
        assert read["workers"][member] == {"backlog": 0, "catchup_s": 0.0}
    finally:
        await sensor.stop()
        await worker.stop()


@pytest.mark.server
async def test_every_record_of_a_batch_counts_as_waiting(broker: EmbeddedBroker, settings: Settings) -> None:
    # the gateway publishes a request's messages as one record batch; Tansu reports the end of a partition as the
    # batch's first offset + 1, so without the probe 4 messages waiting read as 1
    await ensure_topics(settings, broker.bootstrap)
    topic = settings.topic("chat")
    producer = AIOKafkaProducer(bootstrap_servers=broker.bootstrap, linger_ms=100)
    await producer.start()
    try:
        sent = [await producer.send(topic, b"x", partition=0) for _ in range(4)]
        await producer.flush()
        assert [(await f).offset for f in sent] == [0, 1, 2, 3]
    finally:
        await producer.stop()
    async with running_sensor(broker, settings, "batch-test-group", topic) as sensor:
        asked = time.time()
        lag = await sensor.sample()
        assert lag[TopicPartition(topic, 0)] == 4 and lag[TopicPartition(topic, 1)] == 0
        assert sensor.catch_up[topic].backlog == 4
        # the page says when the offsets were read: after the records were sent, so it counts them
        assert catch_up_from_metrics(generate_latest(REGISTRY).decode())["sampled_at"] >= asked


@pytest.mark.server
async def test_samples_at_once_do_not_wait_on_each_other(broker: EmbeddedBroker, settings: Settings) -> None:
    # the sampling loop and a caller (a test, a nudge) can sample together; the end probe assigns and releases the
    # sensor's consumer, and a fetch on a consumer released by the other sample waited for an assignment forever
    await ensure_topics(settings, broker.bootstrap)
    topic = settings.topic("chat")
    await publish(broker.bootstrap, topic, [n % 2 for n in range(4)])
    async with running_sensor(broker, settings, "together-test-group", topic) as sensor:
        lags = await asyncio.wait_for(asyncio.gather(*(sensor.sample() for _ in range(4))), 30)
        assert all(sum(lag.values()) == 4 for lag in lags)


@pytest.mark.server
async def test_a_nudge_samples_at_once(broker: EmbeddedBroker, settings: Settings) -> None:
    # the gateway nudges the sensor after it publishes: the backlog shows now, not at the end of a long period
    await ensure_topics(settings, broker.bootstrap)
    topic = settings.topic("chat")
    async with running_sensor(broker, settings, "nudge-test-group", topic) as sensor:
        deadline = time.monotonic() + 30
        await until(lambda: topic in sensor.catch_up, "never sampled", deadline)  # the first sample, at start
        assert sensor.catch_up[topic].backlog == 0
        await publish(broker.bootstrap, topic, [0])
        sensor.nudge()
        await until(lambda: sensor.catch_up[topic].backlog == 1, "the nudge did not bring a sample", deadline)


@pytest.mark.server
async def test_a_drain_after_a_nudge_shows_without_another(broker: EmbeddedBroker, settings: Settings) -> None:
    # memory is written (the nudge) about a second before the worker commits its offsets: the sensor keeps
    # sampling for a while after a nudge, so the drain shows then, not at the end of a long period
    await ensure_topics(settings, broker.bootstrap)
    topic = settings.topic("chat")
    await publish(broker.bootstrap, topic, [0])
    group = "drain-test-group"
    worker = AIOKafkaConsumer(topic, bootstrap_servers=broker.bootstrap, group_id=group, enable_auto_commit=False)
    await worker.start()
    try:
        async with running_sensor(broker, settings, group, topic) as sensor:
            deadline = time.monotonic() + 30
            await until(
                lambda: topic in sensor.catch_up and sensor.catch_up[topic].backlog == 1,
                "the backlog never showed",
                deadline,
            )
            while not worker.assignment():
                await worker.getmany(timeout_ms=200)
                assert time.monotonic() < deadline, "the worker got no partition"
            before = sensor.catch_up[topic]
            sensor.nudge()  # the memory update
            # the nudge's own sample, which still reads 1 waiting
            await until(lambda: sensor.catch_up[topic] is not before, "the nudge did not bring a sample", deadline)
            await worker.commit({TopicPartition(topic, 0): 1})  # the offsets, committed after it
            await until(
                lambda: sensor.catch_up[topic].backlog == 0, "the drain did not show before the period's end", deadline
            )
    finally:
        await worker.stop()


def test_the_line_a_user_reads() -> None:
    assert catch_up_line({}) == "memorize backlog: not measured yet"
    assert catch_up_line({"error": "/metrics answered 403"}) == "memorize backlog: unknown (/metrics answered 403)"
    line = catch_up_line(
        {"backlog": 12, "catchup_s": 6.2, "workers": {"w-1": {"backlog": 12, "catchup_s": None}, "w-2": {"backlog": 0}}}
    )
    assert line == "memorize backlog: 12 waiting, ~6s to catch up (w-1: 12, not draining yet; w-2: 0, caught up)"
    assert catch_up_from_metrics("not a metrics page {")["error"].startswith("unreadable metrics page")
    # a reader that sent messages at t=100 is not told "caught up" by a measure from before them
    measured = {"backlog": 0, "catchup_s": 0.0, "sampled_at": 99.5}
    assert catch_up_line(measured, since=100.0).startswith("memorize backlog: measuring")
    assert catch_up_line(measured | {"sampled_at": 100.5}, since=100.0) == "memorize backlog: 0 waiting, caught up"
    assert catch_up_line(measured) == "memorize backlog: 0 waiting, caught up"
