"""The answer's text while the model writes it, from the QA agent onto the answer-text topic.

``TextRelay`` is the ``on_text`` listener a query's answer call streams into. The listener runs on the event loop
for every piece the model decodes; publishing waits for the broker's ack. So the relay keeps only the newest text
and one publisher task sends it: a slow broker coalesces pieces instead of slowing the model or reordering text.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

from schemas.events import AnswerText, Query
from services import metrics
from services.logging import get_logger

log = get_logger(__name__)

PublishText = Callable[[AnswerText], Awaitable[None]]


class TextRelay:
    """Publishes ``query``'s answer text as it grows: the newest text at each send, in order, each change once."""

    def __init__(self, query: Query, publish: PublishText) -> None:
        self.query = query
        self.publish = publish
        self.started = time.monotonic()
        self.first_text_s: float | None = None
        self._latest = ""
        self._sent = ""
        self._seq = 0
        self._closing = False
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def __call__(self, text: str) -> None:
        """The ``on_text`` listener: the whole answer text so far (a retried call starts again from "")."""
        if self._closing or text == self._latest:
            return
        self._latest = text
        if text and self.first_text_s is None:
            self.first_text_s = time.monotonic() - self.started
            metrics.QA_FIRST_TEXT.observe(self.first_text_s)
        self._wake.set()
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"answer-text-{self.query.query_id}")

    async def _run(self) -> None:
        while True:
            if self._latest == self._sent:
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            text, self._seq = self._latest, self._seq + 1
            event = AnswerText(
                event_id=f"txt_{self.query.query_id}_{self._seq}",
                user_id=self.query.user_id,
                event_time=self.query.event_time,
                query_id=self.query.query_id,
                seq=self._seq,
                text=text,
            )
            try:
                await self.publish(event)
            except Exception as exc:  # a preview lost is no answer lost: the answer event still follows
                log.warning("answer_text_publish_failed", query_id=self.query.query_id, error=repr(exc))
            self._sent = text

    async def close(self) -> None:
        """Send what is left, then stop (before the answer event is published)."""
        self._closing = True
        self._wake.set()
        if self._task is not None:
            await self._task

    async def abort(self) -> None:
        """Stop without sending more (the query was cancelled)."""
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
