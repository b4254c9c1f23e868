"""The 13 stages of the PAI-2 QA pipeline and a recorder that turns each stage run into a ``StageEvent``.

LLM usage is attributed to stages through a context variable: every LLM call made while a stage scope is active
(in this task or in tasks it spawns with ``asyncio.gather``) counts towards that scope and towards the query.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import IntEnum

from schemas.events import Query, StageEvent, StageStatus
from services import ids
from services.logging import get_logger
from services.metrics import QA_STAGE_LATENCY
from services.ports import LLMResponse

log = get_logger(__name__)

Emit = Callable[[StageEvent], Awaitable[None]]


class Stage(IntEnum):
    DECOMPOSE = 1  # denoise, enhance and decompose the question into sub-questions
    PLAN = 2  # initial search plan per sub-question
    NER = 3  # entities of the current step
    MATCH = 4  # entities -> object vertices
    CLUE_QUERIES = 5  # clue-queries from combinations of matched vertices
    TRAVERSAL = 6  # retriever from the matched vertices
    FILTER = 7  # relevance filter of retrieved triplets
    SUMMARISE = 8  # answer per clue-query and per step
    SUFFICIENCY = 9  # enough to answer the sub-question?
    ENHANCE = 10  # rewrite the not-yet-done steps
    NEXT_STEP = 11  # choose the next step
    NO_ANSWER = 12  # step limit reached without an answer
    COMBINE = 13  # sub-answers -> final answer

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass
class Usage:
    llm_calls: int = 0
    tokens_in: int = 0
    tokens_out: int = 0

    def add(self, response: LLMResponse) -> None:
        self.llm_calls += 0 if response.cached else 1
        self.tokens_in += response.tokens_in
        self.tokens_out += response.tokens_out


@dataclass
class StageScope:
    """What a running stage reports; the code inside the stage fills in counts, status and detail."""

    stage: Stage
    sub_question_id: str | None = None
    step_id: str | None = None
    clue_query_id: str | None = None
    usage: Usage = field(default_factory=Usage)
    vertices: int = 0
    triplets: int = 0
    status: StageStatus = StageStatus.OK
    detail: dict[str, object] = field(default_factory=dict)

    def fail(self, reason: str) -> None:
        self.status = StageStatus.ERROR
        self.detail["error"] = reason[:500]


_scope: ContextVar[StageScope | None] = ContextVar("qa_stage_scope", default=None)
_query_usage: ContextVar[Usage | None] = ContextVar("qa_query_usage", default=None)


def record_llm_response(response: LLMResponse) -> None:
    """Count one LLM response towards the active stage and query (no-op outside a query)."""
    scope = _scope.get()
    if scope is not None:
        scope.usage.add(response)
    total = _query_usage.get()
    if total is not None:
        total.add(response)


class StageRecorder:
    """One per query run: emits a ``StageEvent`` per stage and observes the stage latency histogram."""

    def __init__(self, query: Query, trace_id: str, emit: Emit | None) -> None:
        self.query = query
        self.trace_id = trace_id
        self._emit = emit
        self._seq = 0
        self.usage = Usage()
        self.events: list[StageEvent] = []
        self.emit_failures = 0

    @contextmanager
    def active(self) -> Iterator[None]:
        """Attribute LLM calls made inside this block (and tasks it spawns) to this query."""
        token = _query_usage.set(self.usage)
        try:
            yield
        finally:
            _query_usage.reset(token)

    @asynccontextmanager
    async def stage(
        self,
        stage: Stage,
        *,
        sub_question_id: str | None = None,
        step_id: str | None = None,
        clue_query_id: str | None = None,
    ) -> AsyncIterator[StageScope]:
        scope = StageScope(stage, sub_question_id, step_id, clue_query_id)
        token = _scope.set(scope)
        started_at = datetime.now(UTC)
        t0 = time.perf_counter()
        try:
            yield scope
        except BaseException as exc:
            scope.fail(f"{type(exc).__name__}: {exc}")
            raise
        finally:
            _scope.reset(token)
            await self._finish(scope, started_at, time.perf_counter() - t0)

    async def mark(self, stage: Stage, status: StageStatus, **kwargs: str | None) -> None:
        """A stage with nothing to time: skipped, or a bookkeeping decision."""
        async with self.stage(stage, **kwargs) as scope:
            scope.status = status

    async def _finish(self, scope: StageScope, started_at: datetime, seconds: float) -> None:
        QA_STAGE_LATENCY.labels(stage=str(int(scope.stage)), stage_name=scope.stage.label).observe(seconds)
        self._seq += 1
        event = StageEvent(
            event_id="st_" + ids.digest(self.trace_id, str(self._seq)),
            user_id=self.query.user_id,
            event_time=started_at,
            query_id=self.query.query_id,
            trace_id=self.trace_id,
            stage=int(scope.stage),
            stage_name=scope.stage.label,
            sub_question_id=scope.sub_question_id,
            step_id=scope.step_id,
            clue_query_id=scope.clue_query_id,
            started_at=started_at,
            duration_ms=seconds * 1000.0,
            llm_calls=scope.usage.llm_calls,
            tokens_in=scope.usage.tokens_in,
            tokens_out=scope.usage.tokens_out,
            vertices=scope.vertices,
            triplets=scope.triplets,
            status=scope.status,
            detail=scope.detail,
        )
        self.events.append(event)
        if self._emit is None:
            return
        try:
            await self._emit(event)
        except Exception as exc:
            # Tracing must never fail a query: the answer matters more than its trace. Logged once per query, so a
            # down topic does not flood the log with one traceback per stage.
            self.emit_failures += 1
            if self.emit_failures == 1:
                log.warning("stage_event_emit_failed", query_id=self.query.query_id, stage=event.stage, error=repr(exc))
