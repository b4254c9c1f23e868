"""What both PAI-2 engines share: their configuration, the state of one question's run, and the engine frame
(stage recorder, error handling, timing) around it.

A failed LLM task never fails the query: its stage reports an error and the run degrades. The LLM stack an engine
is given (``build_llm``) holds the process's one bound on calls in flight, so concurrent searches and memorize
together stay within the model's capacity, and a cache hit waits for no slot.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from schemas.events import Answer, AnswerStatus, EvidenceTriplet, PlanStep, Query, QueryOptions, StageEvent, SubAnswer
from services import ids
from services.domain import Triplet
from services.llm.layers import LLMLayer
from services.llm.task import LLMTask, TaskFailed, run_task
from services.logging import get_logger
from services.ports import LLM, Embedder, GraphStore, LLMRequest, LLMResponse, VectorStore
from services.qa.matching import EntityMatcher, Match
from services.qa.stages import StageRecorder, StageScope, record_llm_response
from services.qa.tasks import Finding
from services.retrieval.base import Retriever
from services.settings import Settings

log = get_logger(__name__)

T = TypeVar("T")
Emit = Callable[[StageEvent], Awaitable[None]]
#: streaming listener: the answer text so far, whole, at every new piece (``LLMRequest.on_text``)
OnText = Callable[[str], None]
RetrieverSource = Mapping[str, Retriever] | Callable[[str], Retriever]

NO_ANSWER = "No Answer"


class QAConfig(BaseModel):
    """Defaults of the PAI-2 engines; ``QueryOptions`` of a query override the ones it names."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_steps: int = Field(default=5, ge=1, le=12, description="search steps per sub-question (fast: per plan)")
    max_clue_queries: int = Field(default=4, ge=1, le=8, description="clue-queries per step")
    matches_per_entity: int = Field(default=3, ge=1, le=10)
    # one default for both: the settings' (from_settings is the production path; tests build QAConfig directly)
    retriever: str = Settings.model_fields["qa_retriever"].default
    retriever_params: dict[str, Any] = Field(default_factory=dict)
    plan_enhancement: bool = True
    decomposition: bool = True
    infer_answers: bool = Field(
        default=Settings.model_fields["qa_infer_answers"].default,
        description='fast engine: "would X ...?" answered by inference from the lines, no round',
    )
    episodic_context: bool = Field(
        default=Settings.model_fields["qa_episodic_context"].default, description="show the messages to the LLM"
    )
    near_match_clues: bool = Field(
        default=Settings.model_fields["qa_near_match_clues"].default,
        description="fast engine's rounds: substitute an exactly matched name's near matches too (a search each)",
    )
    chain_context: bool = Field(
        default=Settings.model_fields["qa_chain_context"].default,
        description="fast engine: the first answer's lines laid out along the question's chain (``qa.chain``)",
    )
    first_link: bool = Field(
        default=Settings.model_fields["qa_first_link"].default,
        description="fast engine with the chain: the question's first link asked on its own (``qa.hops``)",
    )
    budget: int = Field(default=20, ge=1, description="triplets per traversal")
    task_attempts: int = Field(default=3, ge=1, description="tries per LLM task on invalid output")
    max_sub_questions: int = Field(default=4, ge=1, le=8)
    max_entities: int = Field(default=5, ge=1, le=10)
    filter_top_k: int = Field(default=12, ge=1, description="triplets shown per clue-query")
    filter_threshold: float = Field(default=0.15, description="min cosine of a triplet to the step or clue")
    clue_query_mode: Literal["llm", "substitute"] = "llm"
    max_rounds: int = Field(
        default=Settings.model_fields["qa_max_rounds"].default,
        ge=0,
        le=4,
        description="fast engine: plan-search-answer rounds after a first answer that is not sufficient",
    )

    @classmethod
    def from_settings(cls, settings: Settings, **overrides: Any) -> QAConfig:
        base: dict[str, Any] = {
            "task_attempts": settings.llm_retries + 1,
            "filter_top_k": settings.qa_top_k,
            "retriever": settings.qa_retriever,
            "max_steps": settings.qa_max_steps,
            "max_clue_queries": settings.qa_max_clue_queries,
            "plan_enhancement": settings.qa_plan_enhancement,
            "decomposition": settings.qa_decomposition,
            "infer_answers": settings.qa_infer_answers,
            "episodic_context": settings.qa_episodic_context,
            "near_match_clues": settings.qa_near_match_clues,
            "max_rounds": settings.qa_max_rounds,
            "chain_context": settings.qa_chain_context,
            "first_link": settings.qa_first_link,
        }
        return cls(**(base | overrides))

    def for_query(self, options: QueryOptions) -> QAConfig:
        overrides = {k: v for k, v in options.model_dump().items() if v is not None}
        return self.model_copy(update=overrides) if overrides else self


class StageMeteredLLM(LLMLayer):
    """Attributes each response to the running stage and query (see ``stages.record_llm_response``)."""

    async def complete(self, request: LLMRequest) -> LLMResponse:
        response = await self.inner.complete(request)
        record_llm_response(response)
        return response


class QueryError(RuntimeError):
    """The query cannot run at all (e.g. an unknown retriever): answered with status error."""


@dataclass
class Step:
    id: str
    text: str
    revision: int = 0
    answer: str | None = None
    vector: list[float] | None = None
    entities: list[str] | None = None  # named without a NER call (fast engine): by ``named_by``
    named_by: str = ""

    def to_plan_step(self, sub_question_id: str) -> PlanStep:
        return PlanStep(
            id=self.id, sub_question_id=sub_question_id, text=self.text, answer=self.answer, revision=self.revision
        )


@dataclass
class SubQuestion:
    id: str
    text: str
    done: list[Step] = field(default_factory=list)
    pending: list[Step] = field(default_factory=list)
    revision: int = 0
    created: int = 0
    answer: str | None = None
    failures: list[str] = field(default_factory=list)
    evidence: dict[str, EvidenceTriplet] = field(default_factory=dict)

    def new_step(self, text: str) -> Step:
        self.created += 1
        return Step(id=f"{self.id}.s{self.created}", text=text, revision=self.revision)

    @property
    def plan(self) -> list[PlanStep]:
        return [s.to_plan_step(self.id) for s in (*self.done, *self.pending)]

    @property
    def findings(self) -> list[Finding]:
        return [Finding(query=s.text, answer=s.answer) for s in self.done]

    @property
    def status(self) -> AnswerStatus:
        if self.answer is not None:
            return AnswerStatus.ANSWERED
        return AnswerStatus.ERROR if self.failures else AnswerStatus.NO_ANSWER


@dataclass
class Clue:
    id: str
    text: str
    seeds: list[str]
    vector: list[float] | None = None
    answer: str | None = None
    triplets: list[Triplet] = field(default_factory=list)


class RunBase:
    """The state of one query through an engine; the rooms (search, plan, answer) are mixins over it."""

    def __init__(self, qa: Engine, query: Query, config: QAConfig, recorder: StageRecorder) -> None:
        self.qa = qa
        self.query = query
        self.config = config
        self.recorder = recorder
        self.user_id = query.user_id
        self.sub_questions: list[SubQuestion] = []
        self.plan_history: list[list[PlanStep]] = []
        self.errors: list[str] = []
        # stage 4's matches by entity, this query's (``SearchRoom._matches``): each a search, done or in flight
        self.matched: dict[str, asyncio.Future[dict[str, list[Match]]]] = {}

    async def execute(self, on_text: OnText | None) -> Answer:
        raise NotImplementedError

    def error_answer(self, message: str) -> Answer:
        return self.answer_of(NO_ANSWER, AnswerStatus.ERROR, error=message)

    def answer_of(self, text: str, status: AnswerStatus, error: str | None = None) -> Answer:
        evidence: dict[str, EvidenceTriplet] = {}
        for sq in self.sub_questions:
            evidence |= sq.evidence
        return Answer(
            event_id="ans_" + ids.digest(self.query.query_id),
            user_id=self.user_id,
            event_time=datetime.now(UTC),
            query_id=self.query.query_id,
            trace_id=self.recorder.trace_id,
            question=self.query.question,
            answer=text,
            status=status,
            sub_answers=[
                SubAnswer(id=sq.id, question=sq.text, answer=sq.answer or NO_ANSWER, status=sq.status)
                for sq in self.sub_questions
            ],
            evidence=list(evidence.values()),
            plan=[step for sq in self.sub_questions for step in sq.plan],
            plan_history=self.plan_history,
            error=error,
        )

    async def task(self, scope: StageScope, task: LLMTask[Any, T], inputs: Any, on_text: OnText | None = None) -> T:
        """Run one LLM task; on failure mark the stage and re-raise ``TaskFailed`` for the caller to degrade."""
        try:
            result = await run_task(self.qa.llm, task, inputs, attempts=self.config.task_attempts, on_text=on_text)
        except TaskFailed as exc:
            scope.fail(str(exc))
            raise
        except Exception as exc:
            # The model backend itself failed (timeout, connection): the same degradation as bad output.
            log.warning("qa_llm_error", task=task.name, query_id=self.query.query_id, error=repr(exc))
            scope.fail(f"{type(exc).__name__}: {exc}")
            raise TaskFailed(task.name, f"{type(exc).__name__}: {exc}", 1) from exc
        # The raw reply goes on the trace: why a stage decided what it did is otherwise invisible.
        scope.detail["output"] = result.raw[-1][:300] if result.raw else ""
        return result.value


class Engine(ABC):
    """A PAI-2 engine over one user's memory graph.

    ``retrievers`` maps a retriever name to a ``Retriever``, or is a factory called with the name (e.g.
    ``lambda name: get_retriever(name, graph, vectors, embedder)``); factory results are reused.
    """

    def __init__(
        self,
        graph: GraphStore,
        vectors: VectorStore,
        embedder: Embedder,
        llm: LLM,
        retrievers: RetrieverSource,
        config: QAConfig | None = None,
    ) -> None:
        self.graph = graph
        self.vectors = vectors
        self.embedder = embedder
        self.config = config or QAConfig()
        self.llm: LLM = StageMeteredLLM(llm)
        self.matcher = EntityMatcher(graph, vectors, embedder)
        self._retrievers = retrievers
        self._retriever_cache: dict[str, Retriever] = {}

    @abstractmethod
    def new_run(self, query: Query, config: QAConfig, recorder: StageRecorder) -> RunBase: ...

    def retriever(self, name: str) -> Retriever:
        if name in self._retriever_cache:
            return self._retriever_cache[name]
        try:
            found = self._retrievers[name] if isinstance(self._retrievers, Mapping) else self._retrievers(name)
        except (KeyError, ValueError) as exc:
            raise QueryError(f"unknown retriever {name!r}") from exc
        self._retriever_cache[name] = found
        return found

    async def answer(self, query: Query, emit: Emit | None = None, on_text: OnText | None = None) -> Answer:
        t0 = time.perf_counter()
        recorder = StageRecorder(query, uuid.uuid4().hex, emit)
        config = self.config.for_query(query.options)
        run = self.new_run(query, config, recorder)
        shown = Shown(on_text)
        with recorder.active():
            try:
                answer = await run.execute(shown.listener)
            except QueryError as exc:
                answer = run.error_answer(str(exc))
            except Exception as exc:
                # A store or retriever failure: report it on the answer instead of losing the query.
                log.exception("qa_failed", query_id=query.query_id, user_id=query.user_id)
                root = first_error(exc)
                answer = run.error_answer(f"{type(root).__name__}: {root}")
        shown.last(answer.answer)  # whatever streamed before, a listener ends with the answer's own text
        seconds = time.perf_counter() - t0
        answer = answer.model_copy(update={"duration_ms": seconds * 1000.0, "llm_calls": recorder.usage.llm_calls})
        # QA_LATENCY / QA_ANSWERS and the "answered" log line belong to the QAService that calls this engine.
        log.debug(
            "qa_done",
            engine=type(self).__name__,
            query_id=query.query_id,
            trace_id=recorder.trace_id,
            status=answer.status.value,
            llm_calls=answer.llm_calls,
            stage_events=len(recorder.events),
        )
        return answer


class Shown:
    """The streaming listener of one query, remembering the text it was last shown."""

    def __init__(self, on_text: OnText | None) -> None:
        self.on_text = on_text
        self.text: str | None = None
        self.listener: OnText | None = None if on_text is None else self._show

    def _show(self, text: str) -> None:
        self.text = text
        if self.on_text is not None:
            self.on_text(text)

    def last(self, text: str) -> None:
        if self.on_text is not None and text != self.text:
            self._show(text)


async def run_all(coroutines: Iterable[Coroutine[Any, Any, None]]) -> None:
    """Run concurrently; on the first failure cancel the rest (no orphan keeps calling the LLM after the answer
    went out) and raise that failure itself, not a group, so the answer's error message stays readable."""
    try:
        async with asyncio.TaskGroup() as group:
            for coroutine in coroutines:
                group.create_task(coroutine)
    except ExceptionGroup as failed:
        raise first_error(failed) from failed


def first_error(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


def evidence_of(t: Triplet) -> EvidenceTriplet:
    return EvidenceTriplet(id=t.id, text=t.text, kind=t.edge.kind.value)
