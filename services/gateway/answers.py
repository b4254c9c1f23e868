"""The gateway's view of the answers topic: a consumer without a group (every gateway sees every answer, and
there is no group join to wait for) reading from the earliest offset into a bounded, most-recent-first dict."""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict

from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaError

from schemas.events import Answer
from services.logging import get_logger
from streams.background import stop_consumer_loop
from streams.codec import InvalidEvent, decode

log = get_logger(__name__)


class AnswerBook:
    """query_id -> Answer, keeping the ``capacity`` most recently received."""

    def __init__(self, capacity: int = 10_000) -> None:
        self.capacity = capacity
        self._answers: OrderedDict[str, Answer] = OrderedDict()
        self._changed = asyncio.Condition()

    def __len__(self) -> int:
        return len(self._answers)

    def get(self, query_id: str) -> Answer | None:
        return self._answers.get(query_id)

    async def put(self, answer: Answer) -> None:
        self._answers[answer.query_id] = answer
        self._answers.move_to_end(answer.query_id)
        while len(self._answers) > self.capacity:
            self._answers.popitem(last=False)
        async with self._changed:
            self._changed.notify_all()

    async def wait_for(self, query_id: str, timeout_s: float) -> Answer | None:
        """The answer, waiting up to ``timeout_s`` for it to arrive."""
        async with self._changed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait_for(lambda: query_id in self._answers), timeout_s)
        return self._answers.get(query_id)


class AnswerFeed:
    """Consumes the answers topic into an ``AnswerBook`` until stopped."""

    def __init__(self, bootstrap: str, topic: str, book: AnswerBook) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.book = book
        self._task: asyncio.Task[None] | None = None
        self._consumer: AIOKafkaConsumer | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def start(self) -> None:
        self._consumer = AIOKafkaConsumer(
            self.topic,
            bootstrap_servers=self.bootstrap,
            group_id=None,
            auto_offset_reset="earliest",
            enable_auto_commit=False,
            client_id="memstream-gateway-answers",
        )
        await self._consumer.start()
        self._task = asyncio.create_task(self._run(self._consumer), name="answer-feed")

    async def _run(self, consumer: AIOKafkaConsumer) -> None:
        while True:
            try:
                batches = await consumer.getmany(timeout_ms=500, max_records=500)
            except KafkaError as exc:
                log.warning("answer_feed_error", error=repr(exc))
                await asyncio.sleep(1.0)
                continue
            for records in batches.values():
                for record in records:
                    try:
                        answer = decode(record.value, Answer)
                    except InvalidEvent as exc:
                        log.warning("answer_invalid", offset=record.offset, error=str(exc)[:300])
                        continue
                    await self.book.put(answer)

    async def stop(self) -> None:
        task, consumer, self._task, self._consumer = self._task, self._consumer, None, None
        await stop_consumer_loop(task, consumer)
