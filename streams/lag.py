"""Consumer lag per topic and partition: how far the worker group's committed offsets trail the topics' ends.

Measured from outside the group (the admin API reads its committed offsets without joining, which would make the
workers rebalance), so it also covers partitions no worker holds right now. A partition the group never committed
counts from its first offset, as the workers start there (``auto_offset_reset="earliest"``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.coordinator.protocol import ConsumerProtocolMemberAssignment
from aiokafka.errors import KafkaError
from prometheus_client.parser import text_string_to_metric_families

from services.logging import get_logger
from services.metrics import (
    CONSUMER_LAG,
    MEMORIZE_BACKLOG,
    MEMORIZE_CATCHUP,
    MEMORIZE_LAG_SAMPLED,
    MEMORIZE_WORKER_BACKLOG,
    MEMORIZE_WORKER_CATCHUP,
)
from services.settings import Settings, get_settings
from streams.background import stop_consumer_loop
from streams.kafka_security import kafka_client_options

log = get_logger(__name__)

PROBE_TIMEOUT_S = 2.0  # how long one sample waits for the last records of the partitions it probes
NUDGE_GAP_S = 0.5  # after a nudge, the least time between two samples: a stream of writes samples twice a second
# after a nudge the sensor keeps sampling every NUDGE_GAP_S for this long: a worker commits its offsets about a
# second after it writes memory (``broker_commit_interval``), so a sample taken at the memory update itself still
# reads the messages as waiting, and the drain would show only at the end of the period
FOLLOW_S = 3.0


@dataclass(frozen=True)
class CatchUp:
    """A topic's backlog and, from how fast the group committed since the last sample, when it will be drained."""

    backlog: int
    rate_per_s: float  # records committed per second over the last sampling period
    seconds: float | None  # None: records wait and nothing was committed (stalled, or no worker yet)


class CatchUpEstimator:
    """Drain rate and catch-up time per topic from successive samples of committed and end offsets."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[float, int]] = {}  # topic -> (when, records committed in all)

    def update(self, topic: str, committed: int, backlog: int, now: float) -> CatchUp:
        last = self._last.get(topic)
        self._last[topic] = (now, committed)
        rate = 0.0
        if last is not None and now > last[0]:
            rate = max(0, committed - last[1]) / (now - last[0])
        if backlog == 0:
            return CatchUp(0, rate, 0.0)
        return CatchUp(backlog, rate, backlog / rate if rate > 0 else None)


class LagSensor:
    """Samples the lag of ``group`` on ``topics`` every ``interval_s`` into ``memstream_consumer_lag``."""

    def __init__(
        self,
        bootstrap: str,
        group: str,
        topics: Sequence[str],
        interval_s: float = 5.0,
        settings: Settings | None = None,
    ) -> None:
        """``settings``: the Kafka security to connect with, and whether to probe the ends (unset: the process's
        own settings)."""
        self.bootstrap = bootstrap
        settings = settings if settings is not None else get_settings()
        self.security = kafka_client_options(settings)
        self.probe_ends = settings.lag_probe_ends
        self.group = group
        self.topics = list(topics)
        self.interval_s = interval_s
        self._consumer: AIOKafkaConsumer | None = None
        self._admin: AIOKafkaAdminClient | None = None
        self._task: asyncio.Task[None] | None = None
        self._nudged = asyncio.Event()
        self._sampling = asyncio.Lock()
        self.estimator = CatchUpEstimator()
        self.catch_up: dict[str, CatchUp] = {}  # per topic, as of the last sample
        self.workers: dict[str, CatchUp] = {}  # per worker (group member), as of the last sample

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def start(self) -> None:
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap, group_id=None, client_id="memstream-lag-sensor", **self.security
        )
        self._admin = AIOKafkaAdminClient(
            bootstrap_servers=self.bootstrap, client_id="memstream-lag-sensor", **self.security
        )
        await self._consumer.start()
        await self._admin.start()
        self._task = asyncio.create_task(self._run(), name="lag-sensor")

    async def stop(self) -> None:
        task, consumer, self._task, self._consumer = self._task, self._consumer, None, None
        await stop_consumer_loop(task, consumer)
        if self._admin is not None:
            await self._admin.close()
            self._admin = None

    def nudge(self) -> None:
        """Records were just published, or memory was just written: sample now and for ``FOLLOW_S`` after, rather
        than at the end of the period, so that a backlog shows, and its drain, as soon as they happen (and a
        "caught up" from before the records, or a backlog from before the drain, does not stand)."""
        self._nudged.set()

    async def _run(self) -> None:
        follow_until = 0.0  # till then, sample every NUDGE_GAP_S: the last nudge's effects are still landing
        while True:
            self._nudged.clear()  # a nudge from here on, during the sample too, asks for the next one
            sampled = time.monotonic()
            try:
                await self.sample()
            except (KafkaError, OSError) as exc:
                log.warning("lag_sample_failed", error=repr(exc))
            following = time.monotonic() < follow_until
            try:
                await asyncio.wait_for(self._nudged.wait(), NUDGE_GAP_S if following else self.interval_s)
            except TimeoutError:
                continue  # the sampling period (or the follow-up gap) ended
            follow_until = time.monotonic() + FOLLOW_S
            # at most one sample every NUDGE_GAP_S (a nudge after a quiet spell samples at once); not a wait for
            # something to happen
            await asyncio.sleep(max(0.0, sampled + NUDGE_GAP_S - time.monotonic()))

    async def sample(self) -> dict[TopicPartition, int]:
        """Measure once, update the gauge, and return the lag of every partition of ``topics``. One sample at a
        time: the end probe assigns the consumer and lets it go, and a fetch of one sample on a consumer the other
        had let go waited for an assignment forever."""
        async with self._sampling:
            return await self._sample()

    async def _sample(self) -> dict[TopicPartition, int]:
        consumer, admin = self._consumer, self._admin
        if consumer is None or admin is None:
            raise RuntimeError("LagSensor.sample() before start()")
        await consumer.topics()  # refreshes the partition metadata
        partitions = [
            TopicPartition(topic, p)
            for topic in self.topics
            for p in sorted(consumer.partitions_for_topic(topic) or ())
        ]
        if not partitions:
            return {}
        read_at = time.time()  # the offsets below are at least this recent
        ends = await consumer.end_offsets(partitions)
        if self.probe_ends:
            ends = await self._last_records(consumer, ends)
        starts = await consumer.beginning_offsets(partitions)
        committed = await admin.list_consumer_group_offsets(self.group, partitions=partitions)
        lag: dict[TopicPartition, int] = {}
        done: dict[str, int] = {}
        positions: dict[TopicPartition, int] = {}  # where the group resumes in each partition
        for tp in partitions:
            known = tp in committed and committed[tp].offset >= 0
            offset = positions[tp] = committed[tp].offset if known else starts[tp]
            lag[tp] = max(0, ends[tp] - offset)
            done[tp.topic] = done.get(tp.topic, 0) + offset
            CONSUMER_LAG.labels(topic=tp.topic, partition=str(tp.partition)).set(lag[tp])
        now = time.monotonic()
        for topic, committed_in_all in done.items():
            backlog = sum(n for tp, n in lag.items() if tp.topic == topic)
            estimate = self.estimator.update(topic, committed_in_all, backlog, now)
            self.catch_up[topic] = estimate
            MEMORIZE_BACKLOG.labels(topic=topic).set(backlog)
            MEMORIZE_CATCHUP.labels(topic=topic).set(-1 if estimate.seconds is None else estimate.seconds)
        self._per_worker(await self._members(admin, partitions), lag, positions, now)
        MEMORIZE_LAG_SAMPLED.set(read_at)
        return lag

    async def _last_records(
        self, consumer: AIOKafkaConsumer, ends: dict[TopicPartition, int]
    ) -> dict[TopicPartition, int]:
        """The ends as the records say: one past the last record read from the last offset the broker reported
        (Tansu reports the first offset of the last record batch + 1, and the batch goes on past it)."""
        found = dict(ends)
        pending = {tp for tp, end in ends.items() if end > 0}
        if not pending:
            return found
        consumer.assign(sorted(pending))
        for tp in pending:
            consumer.seek(tp, ends[tp] - 1)
        deadline = time.monotonic() + PROBE_TIMEOUT_S
        while pending and (left := deadline - time.monotonic()) > 0:
            try:  # getmany's own timeout does not bound its wait for an assignment: this does
                fetched = await asyncio.wait_for(consumer.getmany(*pending, timeout_ms=200), left)
            except TimeoutError:
                break
            for tp, records in fetched.items():
                if records:
                    found[tp] = max(found[tp], max(r.offset for r in records) + 1)
                    pending.discard(tp)
        consumer.unsubscribe()  # no fetching in the background between samples
        if pending:  # deleted by retention since, or slow: the reported end stands, the lag may read low
            log.warning("lag_end_probe_incomplete", partitions=len(pending))
        return found

    def _per_worker(
        self,
        members: dict[str, list[TopicPartition]],
        lag: dict[TopicPartition, int],
        positions: dict[TopicPartition, int],
        now: float,
    ) -> None:
        """Each worker's backlog is what waits in the partitions it holds now; its rate, what it committed there."""
        MEMORIZE_WORKER_BACKLOG.clear()
        MEMORIZE_WORKER_CATCHUP.clear()
        self.workers = {}
        for worker, held in members.items():
            mine = [tp for tp in held if tp in lag]
            done = sum(positions[tp] for tp in mine)
            estimate = self.estimator.update(f"worker:{worker}", done, sum(lag[tp] for tp in mine), now)
            self.workers[worker] = estimate
            MEMORIZE_WORKER_BACKLOG.labels(worker=worker).set(estimate.backlog)
            MEMORIZE_WORKER_CATCHUP.labels(worker=worker).set(-1 if estimate.seconds is None else estimate.seconds)

    async def _members(
        self, admin: AIOKafkaAdminClient, partitions: list[TopicPartition]
    ) -> dict[str, list[TopicPartition]]:
        try:
            described = await admin.describe_consumer_groups([self.group])
        except (KafkaError, OSError) as exc:
            log.warning("lag_members_unknown", error=repr(exc))
            return {}
        groups = [group for response in described for group in response.groups]
        return members_of([member for group in groups for member in group[5]], partitions)


def members_of(
    members: Sequence[Sequence[Any]], partitions: Sequence[TopicPartition]
) -> dict[str, list[TopicPartition]]:
    """Each group member's id and the ``partitions`` it holds, from DescribeGroups' member rows (member id, client
    id, host, metadata, assignment). A broker that leaves the assignment out (the embedded one does) still names a
    lone member, which holds them all; of several such members nothing can be told apart, so none is reported."""
    wanted = set(partitions)
    held: dict[str, list[TopicPartition]] = {}
    for member in members:
        member_id, assignment = str(member[0]), bytes(member[4] or b"")
        if assignment:
            decoded = ConsumerProtocolMemberAssignment.decode(assignment)
            assigned = [TopicPartition(t, p) for t, ps in decoded.assignment for p in ps]
            held[member_id] = [tp for tp in assigned if tp in wanted]
    unassigned = [str(m[0]) for m in members if not m[4]]
    if not held and len(unassigned) == 1:
        held[unassigned[0]] = list(partitions)
    return held


def catch_up_from_metrics(text: str) -> dict[str, Any]:
    """What the lag sensor last published, read off a /metrics page: records waiting and the estimated seconds to
    catch up (None: unknown or stalled), in all and per worker. Empty when no sensor has sampled."""
    out: dict[str, Any] = {}
    workers: dict[str, dict[str, Any]] = {}
    try:
        samples = [sample for family in text_string_to_metric_families(text) for sample in family.samples]
    except ValueError as exc:
        return {"error": f"unreadable metrics page: {exc}"}
    for sample in samples:
        value = sample.value
        if sample.name == "memstream_memorize_backlog_messages":
            out["backlog"] = out.get("backlog", 0) + int(value)
        elif sample.name == "memstream_memorize_catchup_seconds":
            known = out.get("catchup_s", 0.0)
            out["catchup_s"] = None if value < 0 or known is None else max(known, value)
        elif sample.name == "memstream_memorize_worker_backlog_messages":
            workers.setdefault(sample.labels["worker"], {})["backlog"] = int(value)
        elif sample.name == "memstream_memorize_worker_catchup_seconds":
            workers.setdefault(sample.labels["worker"], {})["catchup_s"] = None if value < 0 else value
        elif sample.name == "memstream_memorize_lag_sampled_timestamp_seconds":
            out["sampled_at"] = value
    if workers:
        out["workers"] = workers
    return out


def measured_since(catch_up: dict[str, Any], since: float | None) -> bool:
    """Whether the offsets behind ``catch_up`` were read at or after ``since`` (unix time; None: any measure)."""
    return since is None or catch_up.get("sampled_at", 0.0) >= since


def catch_up_line(catch_up: dict[str, Any], since: float | None = None) -> str:
    """One line a user reads to know when memory is current: records waiting, time to catch up, per worker.
    ``since`` (unix time, e.g. when the reader sent messages): a measure from before it does not count them."""
    if "error" in catch_up:
        return f"memorize backlog: unknown ({catch_up['error']})"
    if "backlog" not in catch_up:
        return "memorize backlog: not measured yet"
    if not measured_since(catch_up, since):
        return "memorize backlog: measuring (the last measure is older than what was sent)"

    def eta(backlog: int, seconds: float | None) -> str:
        if backlog == 0:
            return "caught up"
        return "not draining yet" if seconds is None else f"~{seconds:.0f}s to catch up"

    text = f"memorize backlog: {catch_up['backlog']} waiting, {eta(catch_up['backlog'], catch_up.get('catchup_s'))}"
    workers = catch_up.get("workers", {})
    if workers:
        parts = [
            f"{w}: {v.get('backlog', 0)}, {eta(v.get('backlog', 0), v.get('catchup_s'))}" for w, v in workers.items()
        ]
        text += " (" + "; ".join(parts) + ")"
    return text
