"""The QA service the query agent calls: one answer per query, every stage reported through ``emit``."""

from __future__ import annotations

import time
from typing import Protocol

from schemas.events import Answer, AnswerStatus, Query
from services import metrics
from services.llm.scope import llm_scope
from services.logging import get_logger
from services.qa.base import Emit, OnText

log = get_logger(__name__)


class QAEngine(Protocol):
    async def answer(self, query: Query, emit: Emit | None = None, on_text: OnText | None = None) -> Answer:
        """``on_text``: called with the answer's text so far, whole, as the call that writes it decodes (a later
        call that replaces it starts again); it ends with the answer's own text."""
        ...


class QAService:
    def __init__(self, engine: QAEngine) -> None:
        self.engine = engine

    async def answer(self, query: Query, emit: Emit | None = None, on_text: OnText | None = None) -> Answer:
        started = time.perf_counter()
        with llm_scope(query.user_id):  # cached calls are the user's own, and go when the user forgets
            answer = await self.engine.answer(query, emit, on_text)
        metrics.QA_LATENCY.observe(time.perf_counter() - started)
        metrics.QA_ANSWERS.labels(status=answer.status.value).inc()
        log.info(
            "answered",
            query_id=query.query_id,
            user_id=query.user_id,
            status=answer.status.value,
            llm_calls=answer.llm_calls,
            ms=round(answer.duration_ms, 1),
        )
        if answer.status is AnswerStatus.ERROR:
            log.warning("answer_error", query_id=query.query_id, error=answer.error)
        return answer
