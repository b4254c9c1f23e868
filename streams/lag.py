"""Consumer lag per topic and partition: how far the worker group's committed offsets trail the topics' ends.

Measured from outside the group (the admin API reads its committed offsets without joining, which would make the
workers rebalance), so it also covers partitions no worker holds right now. A partition the group never committed
counts from its first offset, as the workers start there (``auto_offset_reset="earliest"``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from services.logging import get_logger
from services.metrics import CONSUMER_LAG
from services.settings import Settings
from streams.background import stop_consumer_loop
from streams.kafka_security import kafka_client_options

log = get_logger(__name__)


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
        """``settings``: the Kafka security to connect with (unset: the process's own settings)."""
        self.bootstrap = bootstrap
        self.security = kafka_client_options(settings)
        self.group = group
        self.topics = list(topics)
        self.interval_s = interval_s
        self._consumer: AIOKafkaConsumer | None = None
        self._admin: AIOKafkaAdminClient | None = None
        self._task: asyncio.Task[None] | None = None

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

    async def _run(self) -> None:
        while True:
            try:
                await self.sample()
            except (KafkaError, OSError) as exc:
                log.warning("lag_sample_failed", error=repr(exc))
            await asyncio.sleep(self.interval_s)  # the sampling period, not a wait for something to happen

    async def sample(self) -> dict[TopicPartition, int]:
        """Measure once, update the gauge, and return the lag of every partition of ``topics``."""
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
        ends = await consumer.end_offsets(partitions)
        starts = await consumer.beginning_offsets(partitions)
        committed = await admin.list_consumer_group_offsets(self.group, partitions=partitions)
        lag: dict[TopicPartition, int] = {}
        for tp in partitions:
            offset = committed[tp].offset if tp in committed and committed[tp].offset >= 0 else starts[tp]
            lag[tp] = max(0, ends[tp] - offset)
            CONSUMER_LAG.labels(topic=tp.topic, partition=str(tp.partition)).set(lag[tp])
        return lag
