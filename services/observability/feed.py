"""The trace assembler's input: a consumer without a group (every gateway sees every trace, and there is no group
join to wait for) reading the queries, stages and answers topics from the earliest offset into a ``TraceStore``.

Within one fetch, queries go first, then stages, then answers: the QA agent publishes a query's stages before its
answer, so a follower sees the stages before the answer that ends its stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import TypeVar

from aiokafka import AIOKafkaConsumer, ConsumerRecord
from aiokafka.errors import KafkaError

from schemas.events import Answer, Query, StageEvent
from services.logging import get_logger
from services.observability import metrics
from services.observability.traces import TraceStore
from streams.background import stop_consumer_loop
from streams.codec import InvalidEvent, decode
from streams.topics import TopicNames

log = get_logger(__name__)

M = TypeVar("M", Query, StageEvent, Answer)

#: stage events emitted this long before the feed started still count as live (clock skew between hosts)
_LIVE_MARGIN = timedelta(seconds=5)


class TraceFeed:
    """Consumes queries, stage events and answers into ``store`` until stopped."""

    def __init__(self, bootstrap: str, topics: TopicNames, store: TraceStore) -> None:
        self.bootstrap = bootstrap
        self.topics = topics
        self.store = store
        self.started_at = datetime.now(UTC)
        self._task: asyncio.Task[None] | None = None
        self._consumer: AIOKafkaConsumer | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def start(self) -> None:
        self.started_at = datetime.now(UTC)
        self._consumer = AIOKafkaConsumer(
            self.topics.queries,
            self.topics.stages,
            self.topics.answers,
            bootstrap_servers=self.bootstrap,
            group_id=None,
            auto_offset_reset="earliest",
            enable_auto_commit=False,
            client_id="memstream-gateway-traces",
        )
        await self._consumer.start()
        self._task = asyncio.create_task(self._run(self._consumer), name="trace-feed")

    async def stop(self) -> None:
        task, consumer, self._task, self._consumer = self._task, self._consumer, None, None
        await stop_consumer_loop(task, consumer)

    async def _run(self, consumer: AIOKafkaConsumer) -> None:
        while True:
            try:
                batches = await consumer.getmany(timeout_ms=500)
            except KafkaError as exc:
                log.warning("trace_feed_error", error=repr(exc))
                await asyncio.sleep(1.0)  # back off before asking the broker again
                continue
            by_topic: dict[str, list[ConsumerRecord[bytes, bytes]]] = {}
            for tp, records in batches.items():
                by_topic.setdefault(tp.topic, []).extend(records)
            self.consume(
                by_topic.get(self.topics.queries, []),
                by_topic.get(self.topics.stages, []),
                by_topic.get(self.topics.answers, []),
            )

    def consume(
        self,
        queries: Sequence[ConsumerRecord[bytes, bytes]],
        stages: Sequence[ConsumerRecord[bytes, bytes]],
        answers: Sequence[ConsumerRecord[bytes, bytes]],
    ) -> None:
        for record in queries:
            if (query := self._decode(record, Query)) is not None:
                self.store.add_query(query)
        for record in stages:
            if (stage := self._decode(record, StageEvent)) is not None:
                self.add_stage(stage)
        for record in answers:
            if (answer := self._decode(record, Answer)) is not None:
                self.store.add_answer(answer)

    def add_stage(self, event: StageEvent) -> None:
        run = self.store.add_stage(event)
        if run is None or event.ingest_time < self.started_at - _LIVE_MARGIN:
            return  # a duplicate, or history replayed at startup: counted when it happened
        metrics.TRACE_STAGE_EVENTS.labels(event.stage_name, event.status.value).inc()
        what = metrics.RETRIEVAL_STAGES.get(event.stage_name)
        if what is not None:
            metrics.TRACE_RETRIEVED.labels(event.stage_name, what).observe(getattr(event, what))
        if event.tokens_in or event.tokens_out:
            metrics.TRACE_STAGE_TOKENS.labels(event.stage_name, "in").inc(event.tokens_in)
            metrics.TRACE_STAGE_TOKENS.labels(event.stage_name, "out").inc(event.tokens_out)
        metrics.TRACE_DELAY.observe(max(0.0, (datetime.now(UTC) - event.ingest_time).total_seconds()))

    @staticmethod
    def _decode(record: ConsumerRecord[bytes, bytes], model: type[M]) -> M | None:
        try:
            return decode(record.value, model)
        except InvalidEvent as exc:
            log.warning("trace_feed_invalid", topic=record.topic, offset=record.offset, error=str(exc)[:300])
            return None
