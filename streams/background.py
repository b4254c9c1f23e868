"""Background consumer loops: read topics with a consumer of no group, hand every fetch to a callback; stop one by
cancelling its task, then closing its consumer. ``TopicFeed`` is that loop as a start/stop service."""

from __future__ import annotations

import asyncio
import contextlib
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import TypeVar

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaError
from pydantic import BaseModel

from services.logging import get_logger
from services.settings import Settings
from streams.codec import InvalidEvent, decode
from streams.kafka_security import kafka_client_options

log = get_logger(__name__)

Fetch = dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]
M = TypeVar("M", bound=BaseModel)


def tail_consumer(bootstrap: str, *topics: str, client_id: str, settings: Settings | None = None) -> AIOKafkaConsumer:
    """A consumer without a group (every reader sees every record, and there is no group join to wait for) that
    reads ``topics`` from their earliest offsets; Kafka security from ``settings`` (unset: the process's)."""
    return AIOKafkaConsumer(
        *topics,
        bootstrap_servers=bootstrap,
        group_id=None,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        client_id=client_id,
        **kafka_client_options(settings),
    )


async def run_consumer_loop(
    consumer: AIOKafkaConsumer, handle: Callable[[Fetch], Awaitable[None]], name: str, max_records: int = 500
) -> None:
    """Fetch and ``handle`` until cancelled; an empty fetch is handed over too (so the callback can tell when it
    has caught up). Broker errors are logged and retried after a pause; ``handle`` must not raise."""
    while True:
        try:
            fetched = await consumer.getmany(timeout_ms=500, max_records=max_records)
        except KafkaError as exc:
            log.warning("consumer_loop_error", loop=name, error=repr(exc))
            await asyncio.sleep(1.0)  # back off before asking the broker again
            continue
        await handle(fetched)


async def stop_consumer_loop(task: asyncio.Task[None] | None, consumer: AIOKafkaConsumer | None) -> None:
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    if consumer is not None:
        await consumer.stop()


def decode_records(records: Iterable[ConsumerRecord[bytes, bytes]], model: type[M], what: str) -> Iterator[M]:
    """The records that decode as ``model``; the others are logged (as ``<what>_invalid``) and skipped, so one bad
    record cannot stop a feed."""
    for record in records:
        try:
            yield decode(record.value, model)
        except InvalidEvent as exc:
            log.warning(f"{what}_invalid", topic=record.topic, offset=record.offset, error=str(exc)[:300])


class TopicFeed(ABC):
    """Reads ``topics`` from their earliest offsets with a ``tail_consumer`` and hands every fetch to ``handle``,
    from ``start()`` until ``stop()``: the shape of every in-memory view the gateway keeps of a topic."""

    def __init__(
        self, bootstrap: str, topics: tuple[str, ...], client_id: str, name: str, settings: Settings | None = None
    ) -> None:
        """``settings``: the Kafka security to connect with (unset: the process's own settings)."""
        self.bootstrap = bootstrap
        self.settings = settings
        self.client_id = client_id
        self.name = name  # the loop's task name and log label
        self._topics = topics
        self._task: asyncio.Task[None] | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self.caught_up = False
        self.loaded = asyncio.Event()  # set once the feed has read what its topics held when it started
        self._ends: dict[TopicPartition, int] = {}

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def start(self) -> None:
        self._consumer = tail_consumer(self.bootstrap, *self._topics, client_id=self.client_id, settings=self.settings)
        await self._consumer.start()
        self.caught_up = False
        await self._consumer.topics()  # partition metadata
        partitions = [
            TopicPartition(topic, p)
            for topic in self._topics
            for p in sorted(self._consumer.partitions_for_topic(topic) or ())
        ]
        self._ends = await self._consumer.end_offsets(partitions) if partitions else {}
        await self.on_started(self._consumer)
        loop = run_consumer_loop(self._consumer, self._fetched, self.name)
        self._task = asyncio.create_task(loop, name=self.name)

    async def wait_loaded(self, timeout_s: float) -> bool:
        """Wait until the feed read its backlog; False (logged) if it took longer than ``timeout_s``."""
        try:
            await asyncio.wait_for(self.loaded.wait(), timeout_s)
        except TimeoutError:
            log.warning("feed_backlog_not_read", feed=self.name, waited_s=timeout_s)
            return False
        return True

    async def _fetched(self, fetched: Fetch) -> None:
        await self.handle(fetched)
        if not self.caught_up and self._consumer is not None:
            self.caught_up = await self._reached_ends(self._consumer)
            if self.caught_up:
                self.loaded.set()
                await self.on_loaded()

    async def _reached_ends(self, consumer: AIOKafkaConsumer) -> bool:
        for tp, end in self._ends.items():
            try:
                if await consumer.position(tp) < end:
                    return False
            except Exception:  # not assigned yet
                return False
        return True

    async def on_loaded(self) -> None:
        """Called once, when the backlog was read."""
        return None

    async def on_started(self, consumer: AIOKafkaConsumer) -> None:
        """Called once the consumer is started, before the first fetch (e.g. to read where the topics end)."""
        return None  # nothing to prepare by default

    async def stop(self) -> None:
        task, consumer, self._task, self._consumer = self._task, self._consumer, None, None
        await stop_consumer_loop(task, consumer)

    @abstractmethod
    async def handle(self, fetched: Fetch) -> None:
        """One fetch (possibly empty); must not raise, or the feed stops."""
