"""The gateway's view of the answers topic: a consumer without a group (every gateway sees every answer, and
there is no group join to wait for) reading from the earliest offset into a bounded, most-recent-first dict."""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterable

from schemas.events import Answer
from services.settings import Settings
from streams.background import Fetch, TopicFeed, decode_records


class AnswerBook:
    """query_id -> Answer, keeping the ``capacity`` most recently received."""

    def __init__(self, capacity: int = 10_000) -> None:
        self.capacity = capacity
        self._answers: OrderedDict[str, Answer] = OrderedDict()
        self._changed = asyncio.Condition()
        #: ``True`` for an answer that must not be kept (built from forgotten memory); see ``forget.Forgets``
        self.refuse: Callable[[Answer], bool] = lambda _answer: False

    def __len__(self) -> int:
        return len(self._answers)

    def get(self, query_id: str) -> Answer | None:
        return self._answers.get(query_id)

    def answers(self) -> list[Answer]:
        return list(self._answers.values())

    def remove(self, query_ids: Iterable[str]) -> int:
        """Drop these queries' answers; returns how many were held."""
        return sum(self._answers.pop(q, None) is not None for q in set(query_ids))

    async def put(self, answer: Answer) -> None:
        if self.refuse(answer):
            return
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


class AnswerFeed(TopicFeed):
    """Consumes the answers topic into an ``AnswerBook`` until stopped."""

    def __init__(self, bootstrap: str, topic: str, book: AnswerBook, settings: Settings | None = None) -> None:
        super().__init__(
            bootstrap, (topic,), client_id="memstream-gateway-answers", name="answer-feed", settings=settings
        )
        self.topic = topic
        self.book = book

    async def handle(self, fetched: Fetch) -> None:
        for records in fetched.values():
            for answer in decode_records(records, Answer, "answer"):
                await self.book.put(answer)
