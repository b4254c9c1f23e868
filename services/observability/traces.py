"""Per-query traces, assembled from what the QA processor publishes: the query, its stage events, its answer.

A trace nests the stage events the way the PAI-2 pipeline runs: sub-questions -> plan steps -> clue-queries, each
node with its time span, LLM calls and tokens. Texts come from the stage details the pipeline fills in (stage 1
lists the sub-questions, 2 and 10 the plan, 11 the step, 5 the clue-queries); a stage event that names no
sub-question (the minimal QA's) stays at the query level. Anything a detail lacks is simply left empty.

``TraceStore`` keeps the most recent traces and lets any number of followers stream one trace's updates as they
arrive (the SSE endpoint); it is fed by ``streams.trace_feed.TraceFeed``.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Literal

from pydantic import BaseModel, Field

from schemas.events import Answer, AnswerStatus, AnswerText, EvidenceTriplet, Query, StageEvent, StageStatus

TraceStatus = Literal["waiting", "running", "answered", "no_answer", "error", "cancelled"]
_STATUS: dict[AnswerStatus, TraceStatus] = {
    AnswerStatus.ANSWERED: "answered",
    AnswerStatus.NO_ANSWER: "no_answer",
    AnswerStatus.ERROR: "error",
    AnswerStatus.CANCELLED: "cancelled",
}


class StageRun(BaseModel):
    """One stage event as the trace shows it; ``seq`` is its arrival order within the trace (from 1)."""

    seq: int
    event_id: str
    trace_id: str
    stage: int
    stage_name: str
    status: StageStatus
    sub_question_id: str | None = None
    step_id: str | None = None
    clue_query_id: str | None = None
    started_at: datetime
    duration_ms: float
    llm_calls: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    vertices: int = 0
    triplets: int = 0
    detail: dict[str, object] = Field(default_factory=dict)

    @classmethod
    def of(cls, event: StageEvent, seq: int) -> StageRun:
        fields = event.model_dump(include=set(cls.model_fields) - {"seq"})
        return cls(seq=seq, **fields)

    @property
    def ended_at(self) -> datetime:
        return self.started_at + timedelta(milliseconds=self.duration_ms)


class LLMUsage(BaseModel):
    calls: int = 0
    tokens_in: int = 0
    tokens_out: int = 0

    def add(self, run: StageRun) -> None:
        self.calls += run.llm_calls
        self.tokens_in += run.tokens_in
        self.tokens_out += run.tokens_out


class Span(BaseModel):
    """What every node of a trace has: its own stage runs, their time span and LLM usage (children included)."""

    started_at: datetime | None = None
    ended_at: datetime | None = None
    duration_ms: float = 0.0
    llm: LLMUsage = Field(default_factory=LLMUsage)
    stages: list[StageRun] = Field(default_factory=list)
    evidence: list[object] = Field(default_factory=list, description="evidence a stage detail reported")

    def cover(self, run: StageRun) -> None:
        """Widen the span to ``run`` and count its LLM usage (``run`` belongs to this node or a child)."""
        self.started_at = run.started_at if self.started_at is None else min(self.started_at, run.started_at)
        self.ended_at = run.ended_at if self.ended_at is None else max(self.ended_at, run.ended_at)
        self.duration_ms = (self.ended_at - self.started_at).total_seconds() * 1000.0
        self.llm.add(run)


class ClueQueryTrace(Span):
    id: str
    text: str | None = None
    retrieved: int | None = Field(default=None, description="triplets the traversal returned")
    kept: int | None = Field(default=None, description="triplets left after the relevance filter")
    answer: str | None = None


class StepTrace(Span):
    id: str
    text: str | None = None
    entities: list[str] = Field(default_factory=list)
    clue_queries: list[ClueQueryTrace] = Field(default_factory=list)
    answer: str | None = None


class PlanRevision(BaseModel):
    """The plan of a sub-question after stage 2 (revision 0) or after a stage 10 that changed it."""

    revision: int
    stage: int
    at: datetime
    done: list[str] = Field(description="steps already searched")
    remaining: list[str]


class SubQuestionTrace(Span):
    id: str
    text: str | None = None
    plans: list[PlanRevision] = Field(default_factory=list)
    steps: list[StepTrace] = Field(default_factory=list)
    sufficient: bool | None = None
    no_answer_reason: str | None = None


class Trace(Span):
    query_id: str
    trace_id: str | None = None
    user_id: str | None = None
    question: str | None = None
    as_of: datetime | None = Field(default=None, description="the question's as_of: memory as it held then")
    status: TraceStatus = "waiting"
    asked_at: datetime | None = None
    answered_at: datetime | None = None
    sub_questions: list[SubQuestionTrace] = Field(default_factory=list)
    timeline: list[StageRun] = Field(default_factory=list, description="every stage run, in arrival order")
    llm_by_stage: dict[str, LLMUsage] = Field(default_factory=dict)
    answer: Answer | None = None
    answer_text: str = Field(default="", description="the answer's text as far as the model has written it")
    final_evidence: list[EvidenceTriplet] = Field(default_factory=list)

    @property
    def complete(self) -> bool:
        return self.answer is not None


# -- assembly -------------------------------------------------------------------------------------------------------


def _texts(value: object) -> list[str]:
    return [str(v) for v in value] if isinstance(value, list) else []


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


class _Builder:
    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.subs: dict[str, SubQuestionTrace] = {}
        self.steps: dict[str, StepTrace] = {}
        self.clues: dict[str, ClueQueryTrace] = {}
        self.done_steps: dict[str, list[str]] = {}

    def sub(self, sub_id: str) -> SubQuestionTrace:
        if sub_id not in self.subs:
            self.subs[sub_id] = SubQuestionTrace(id=sub_id)
            self.trace.sub_questions.append(self.subs[sub_id])
        return self.subs[sub_id]

    def step(self, sub_id: str, step_id: str) -> StepTrace:
        if step_id not in self.steps:
            self.steps[step_id] = StepTrace(id=step_id)
            self.sub(sub_id).steps.append(self.steps[step_id])
        return self.steps[step_id]

    def clue(self, sub_id: str, step_id: str, clue_id: str) -> ClueQueryTrace:
        if clue_id not in self.clues:
            self.clues[clue_id] = ClueQueryTrace(id=clue_id)
            self.step(sub_id, step_id).clue_queries.append(self.clues[clue_id])
        return self.clues[clue_id]

    def add(self, run: StageRun) -> None:
        trace = self.trace
        trace.timeline.append(run)
        trace.llm_by_stage.setdefault(run.stage_name, LLMUsage()).add(run)
        chain: list[Span] = [trace]
        # an id the pipeline leaves out gets a placeholder parent, so a run is never dropped
        sub_id = run.sub_question_id or ("-" if run.step_id or run.clue_query_id else None)
        step_id = run.step_id or ("-" if run.clue_query_id else None)
        if sub_id is not None:
            chain.append(self.sub(sub_id))
        if sub_id is not None and step_id is not None:
            chain.append(self.step(sub_id, step_id))
        if sub_id is not None and step_id is not None and run.clue_query_id is not None:
            chain.append(self.clue(sub_id, step_id, run.clue_query_id))
        for node in chain:
            node.cover(run)
        owner = chain[-1]
        owner.stages.append(run)
        evidence = run.detail.get("evidence")
        if isinstance(evidence, list):
            owner.evidence.extend(evidence)
        self._read_detail(run, owner)

    def _read_detail(self, run: StageRun, owner: Span) -> None:
        """Texts and outcomes the pipeline puts in stage details (ids follow its sq<n>, <step>.c<n> scheme)."""
        detail, stage = run.detail, run.stage
        sub_id = run.sub_question_id
        if stage == 1:
            for n, text in enumerate(_texts(detail.get("sub_questions")), 1):
                self.sub(f"sq{n}").text = text
        elif stage in (2, 10) and sub_id is not None:
            steps = _texts(detail.get("steps"))
            if steps and (stage == 2 or detail.get("changed") is True):
                sub = self.sub(sub_id)
                sub.plans.append(
                    PlanRevision(
                        revision=len(sub.plans),
                        stage=stage,
                        at=run.started_at,
                        done=list(self.done_steps.get(sub_id, [])),
                        remaining=steps,
                    )
                )
        elif stage == 9 and sub_id is not None and isinstance(detail.get("sufficient"), bool):
            self.sub(sub_id).sufficient = bool(detail["sufficient"])
        elif stage == 12 and sub_id is not None:
            self.sub(sub_id).no_answer_reason = _text(detail.get("reason"))
        elif isinstance(owner, StepTrace):
            self._read_step_detail(run, owner)
        elif isinstance(owner, ClueQueryTrace):
            if stage == 6:
                owner.retrieved = run.triplets
            elif stage == 7:
                owner.kept = run.triplets
            elif stage == 8:
                owner.answer = _text(detail.get("answer"))

    def _read_step_detail(self, run: StageRun, step: StepTrace) -> None:
        detail = run.detail
        sub_id = run.sub_question_id or "-"
        if run.stage == 11:
            step.text = _text(detail.get("step")) or step.text
            if step.text:
                self.done_steps.setdefault(sub_id, []).append(step.text)
        elif run.stage == 3:
            step.entities = _texts(detail.get("entities"))
        elif run.stage == 5:
            for n, text in enumerate(_texts(detail.get("clue_queries")), 1):
                self.clue(sub_id, step.id, f"{step.id}.c{n}").text = text
        elif run.stage == 8:
            step.answer = _text(detail.get("answer")) or step.answer


def assemble(
    query_id: str,
    runs: Iterable[StageRun],
    query: Query | None = None,
    answer: Answer | None = None,
    user_id: str | None = None,
    text: str = "",
) -> Trace:
    """The trace of one query from whatever has arrived so far.

    A query that was run twice (a redelivery after a worker crash) has two trace ids; the answer's wins, or else
    the latest run's.
    """
    runs = list(runs)
    trace_id = answer.trace_id if answer is not None else (runs[-1].trace_id if runs else None)
    trace = Trace(query_id=query_id, trace_id=trace_id, user_id=user_id, answer_text=text)
    if query is not None:
        trace.user_id, trace.question, trace.asked_at = query.user_id, query.question, query.ingest_time
        trace.as_of = query.as_of
    builder = _Builder(trace)
    for run in sorted((r for r in runs if r.trace_id == trace_id), key=lambda r: r.seq):
        builder.add(run)
    if answer is not None:
        trace.user_id = trace.user_id or answer.user_id
        trace.question = trace.question or answer.question
        trace.answer = answer
        trace.answer_text = answer.answer
        trace.answered_at = answer.ingest_time
        trace.final_evidence = list(answer.evidence)
        trace.status = _STATUS[answer.status]
    elif trace.timeline:
        trace.status = "running"
    return trace


# -- the store --------------------------------------------------------------------------------------------------------

UpdateKind = Literal["query", "stage", "text", "answer"]
#: ``(query_id, user_id, when, content) -> True`` for a record that must not be kept (the gateway's ``Forgets``)
Refuse = Callable[[str, str | None, datetime, object], bool]


@dataclass(frozen=True)
class TextPiece:
    """What the answer's text gained: ``delta`` appended, or (``reset``, a retried call) the whole text anew."""

    delta: str
    reset: bool = False

    def applied(self, text: str) -> str:
        return self.delta if self.reset else text + self.delta


@dataclass(frozen=True)
class Update:
    """One thing that happened to a trace; ``seq`` orders them (and is the SSE event id)."""

    seq: int
    kind: UpdateKind
    data: Query | StageRun | TextPiece | Answer


@dataclass
class _Entry:
    query_id: str
    user_id: str | None = None
    query: Query | None = None
    answer: Answer | None = None
    runs: list[StageRun] = field(default_factory=list)
    seen: set[str] = field(default_factory=set)
    updates: list[Update] = field(default_factory=list)
    text: str = ""
    text_seq: int = 0

    def push(self, kind: UpdateKind, data: Query | StageRun | TextPiece | Answer) -> Update:
        update = Update(len(self.updates) + 1, kind, data)
        self.updates.append(update)
        return update


class TraceStore:
    """The ``capacity`` most recently updated traces, with change notification for followers."""

    def __init__(self, capacity: int = 2_000) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._tick = asyncio.Event()
        self.refuse: Refuse = lambda _query_id, _user_id, _when, _content: False

    def __len__(self) -> int:
        return len(self._entries)

    def _entry(self, query_id: str) -> _Entry:
        entry = self._entries.get(query_id)
        if entry is None:
            entry = self._entries[query_id] = _Entry(query_id)
        self._entries.move_to_end(query_id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return entry

    def _changed(self) -> None:
        # wake every follower: each re-reads its own trace and goes back to waiting on the new event
        tick, self._tick = self._tick, asyncio.Event()
        tick.set()

    def _refused(self, query_id: str, user_id: str | None, when: datetime, content: object) -> bool:
        if not self.refuse(query_id, user_id, when, content):
            return False
        self.remove([query_id])  # what arrived of it before is no more the user's than this
        return True

    def remove(self, query_ids: Iterable[str]) -> int:
        """Drop these traces (their followers' streams end); returns how many were held."""
        removed = sum(self._entries.pop(q, None) is not None for q in set(query_ids))
        if removed:
            self._changed()
        return removed

    def traces(self) -> list[Trace]:
        """Every trace held, assembled."""
        return [t for t in (self.get(q) for q in list(self._entries)) if t is not None]

    def add_query(self, query: Query) -> None:
        if self._refused(query.query_id, query.user_id, query.ingest_time, None):
            return
        entry = self._entry(query.query_id)
        if entry.query is None:
            entry.query, entry.user_id = query, query.user_id
            entry.push("query", query)
            self._changed()

    def add_stage(self, event: StageEvent) -> StageRun | None:
        """Record a stage event; ``None`` if it was seen before (at-least-once delivery) or is refused."""
        if self._refused(event.query_id, event.user_id, event.started_at, event.detail):
            return None
        entry = self._entry(event.query_id)
        if event.event_id in entry.seen:
            return None
        entry.seen.add(event.event_id)
        entry.user_id = entry.user_id or event.user_id
        run = StageRun.of(event, len(entry.runs) + 1)
        entry.runs.append(run)
        entry.push("stage", run)
        self._changed()
        return run

    def add_text(self, text: AnswerText) -> TextPiece | None:
        """Record the answer's text so far; ``None`` if it adds nothing (older than what is held, a duplicate, or
        after the answer) or is refused. Updates hold what changed, so a long answer costs its length once."""
        if self._refused(text.query_id, text.user_id, text.ingest_time, text.text):
            return None
        entry = self._entry(text.query_id)
        if entry.answer is not None or text.seq <= entry.text_seq:
            return None
        entry.text_seq = text.seq
        entry.user_id = entry.user_id or text.user_id
        grown = text.text.startswith(entry.text)
        piece = TextPiece(text.text[len(entry.text) :] if grown else text.text, reset=not grown)
        entry.text = text.text
        if not piece.delta and not piece.reset:
            return None
        entry.push("text", piece)
        self._changed()
        return piece

    def add_answer(self, answer: Answer) -> None:
        if self._refused(answer.query_id, answer.user_id, answer.ingest_time, answer):
            return
        entry = self._entry(answer.query_id)
        if entry.answer is not None and entry.answer.event_id == answer.event_id:
            return
        entry.answer, entry.user_id = answer, entry.user_id or answer.user_id
        entry.push("answer", answer)
        self._changed()

    def answered(self, query_id: str) -> bool | None:
        """Whether the query's answer arrived; None for a query not held."""
        entry = self._entries.get(query_id)
        return None if entry is None else entry.answer is not None

    def user_of(self, query_id: str) -> str | None:
        entry = self._entries.get(query_id)
        return entry.user_id if entry is not None else None

    def get(self, query_id: str) -> Trace | None:
        entry = self._entries.get(query_id)
        if entry is None:
            return None
        return assemble(query_id, entry.runs, entry.query, entry.answer, entry.user_id, entry.text)

    async def follow(
        self, query_id: str, after: int = 0, heartbeat_s: float = 15.0
    ) -> AsyncGenerator[Update | None, None]:
        """The trace's updates with ``seq > after``, as they arrive, until its answer has been given.

        Yields ``None`` after ``heartbeat_s`` without news (the caller sends a keep-alive or gives up); a query
        nobody knows yet is waited for, since a follower may well subscribe before its first event arrives. A trace
        that is removed while followed (forgotten) ends its followers' iteration.
        """
        known = False
        while True:
            tick = self._tick  # taken before reading: a change from here on sets this very event
            entry = self._entries.get(query_id)
            if entry is None and known:
                return
            if entry is not None:
                known = True
                for update in entry.updates[after:]:
                    after = update.seq
                    yield update
                if entry.answer is not None and after >= len(entry.updates):
                    return
            try:
                await asyncio.wait_for(tick.wait(), heartbeat_s)
            except TimeoutError:
                yield None
