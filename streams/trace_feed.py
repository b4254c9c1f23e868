"""The trace assembler's input: a consumer without a group (every gateway sees every trace, and there is no group
join to wait for) reading the queries, stages, answer-text and answers topics from the earliest offset into a
``TraceStore``.

Within one fetch, queries go first, then stages, then the answer's text, then answers: the QA agent publishes a
query's stages and text before its answer, so a follower sees them before the answer that ends its stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

from aiokafka import ConsumerRecord

from schemas.events import Answer, AnswerText, Query, StageEvent
from services.observability import metrics
from services.observability.traces import TraceStore
from services.settings import Settings
from streams.background import Fetch, TopicFeed, decode_records
from streams.topics import TopicNames

#: stage events emitted this long before the feed started still count as live (clock skew between hosts)
_LIVE_MARGIN = timedelta(seconds=5)


class TraceFeed(TopicFeed):
    """Consumes queries, stage events and answers into ``store`` until stopped."""

    def __init__(self, bootstrap: str, topics: TopicNames, store: TraceStore, settings: Settings | None = None) -> None:
        names = tuple(n for n in (topics.queries, topics.stages, topics.answer_text, topics.answers) if n)
        super().__init__(bootstrap, names, client_id="memstream-gateway-traces", name="trace-feed", settings=settings)
        self.topics = topics
        self.store = store
        self.started_at = datetime.now(UTC)

    async def start(self) -> None:
        self.started_at = datetime.now(UTC)  # what came before is history, not live (see ``add_stage``)
        await super().start()

    async def handle(self, fetched: Fetch) -> None:
        by_topic: dict[str, list[ConsumerRecord[bytes, bytes]]] = {}
        for tp, records in fetched.items():
            by_topic.setdefault(tp.topic, []).extend(records)
        self.consume(
            by_topic.get(self.topics.queries, []),
            by_topic.get(self.topics.stages, []),
            by_topic.get(self.topics.answers, []),
            by_topic.get(self.topics.answer_text, []),
        )

    def consume(
        self,
        queries: Sequence[ConsumerRecord[bytes, bytes]],
        stages: Sequence[ConsumerRecord[bytes, bytes]],
        answers: Sequence[ConsumerRecord[bytes, bytes]],
        texts: Sequence[ConsumerRecord[bytes, bytes]] = (),
    ) -> None:
        for query in decode_records(queries, Query, "trace_feed"):
            self.store.add_query(query)
        for stage in decode_records(stages, StageEvent, "trace_feed"):
            self.add_stage(stage)
        for text in decode_records(texts, AnswerText, "trace_feed"):
            self.store.add_text(text)
        for answer in decode_records(answers, Answer, "trace_feed"):
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
