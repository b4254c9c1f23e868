"""The PAI-2 planning QA pipeline: decompose, plan, and search the memory graph step by step (13 stages).

Sub-questions run concurrently, and so do the clue-queries of a step; the LLM stack it is given (``build_llm``) holds
the process's one bound on calls in flight, so concurrent queries and memorize together stay within the model's
capacity, and a cache hit waits for no slot. A failed LLM task never fails the query: its stage reports an error
and the pipeline degrades (see each stage).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from schemas.events import (
    Answer,
    AnswerStatus,
    EvidenceTriplet,
    PlanStep,
    Query,
    QueryOptions,
    StageEvent,
    StageStatus,
    SubAnswer,
)
from services import ids
from services.domain import EdgeKind, Triplet, VertexKind
from services.llm.layers import LLMLayer
from services.llm.task import LLMTask, TaskFailed, run_task
from services.logging import get_logger
from services.ports import LLM, Embedder, GraphStore, LLMRequest, LLMResponse, VectorStore
from services.qa.matching import EntityMatcher, Match, combinations
from services.qa.stages import Stage, StageRecorder, StageScope, record_llm_response
from services.qa.tasks import (
    ClueAnswerInput,
    ClueAnswerTask,
    ClueQueryInput,
    ClueQueryTask,
    CombineInput,
    CombineTask,
    DecomposeInput,
    DecomposeTask,
    EnhanceInput,
    EnhanceTask,
    Finding,
    NerInput,
    NerTask,
    PlanInput,
    PlanTask,
    StepAnswerInput,
    StepAnswerTask,
    Substitution,
    SufficiencyInput,
    SufficiencyTask,
    mention,
    substitute,
)
from services.retrieval.base import RetrievalRequest, Retriever
from services.settings import Settings
from services.similarity import cosine

log = get_logger(__name__)

T = TypeVar("T")
Emit = Callable[[StageEvent], Awaitable[None]]
RetrieverSource = Mapping[str, Retriever] | Callable[[str], Retriever]

NO_ANSWER = "No Answer"


class QAConfig(BaseModel):
    """Defaults of the planning QA; ``QueryOptions`` of a query override the ones it names."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_steps: int = Field(default=5, ge=1, le=12, description="search steps per sub-question")
    max_clue_queries: int = Field(default=4, ge=1, le=8, description="clue-queries per step")
    matches_per_entity: int = Field(default=3, ge=1, le=10)
    # one default for both: the settings' (from_settings is the production path; tests build QAConfig directly)
    retriever: str = Settings.model_fields["qa_retriever"].default
    retriever_params: dict[str, Any] = Field(default_factory=dict)
    plan_enhancement: bool = True
    decomposition: bool = True
    episodic_context: bool = Field(
        default=Settings.model_fields["qa_episodic_context"].default, description="show the messages to the LLM"
    )
    budget: int = Field(default=20, ge=1, description="triplets per traversal")
    task_attempts: int = Field(default=3, ge=1, description="tries per LLM task on invalid output")
    max_sub_questions: int = Field(default=4, ge=1, le=8)
    max_entities: int = Field(default=5, ge=1, le=10)
    filter_top_k: int = Field(default=12, ge=1, description="triplets shown per clue-query")
    filter_threshold: float = Field(default=0.15, description="min cosine of a triplet to the step or clue")
    clue_query_mode: Literal["llm", "substitute"] = "llm"

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
            "episodic_context": settings.qa_episodic_context,
        }
        return cls(**(base | overrides))

    def for_query(self, options: QueryOptions) -> QAConfig:
        overrides = {k: v for k, v in options.model_dump().items() if v is not None}
        return self.model_copy(update=overrides) if overrides else self


class _StageMeteredLLM(LLMLayer):
    """Attributes each response to the running stage and query (see ``stages.record_llm_response``)."""

    async def complete(self, request: LLMRequest) -> LLMResponse:
        response = await self.inner.complete(request)
        record_llm_response(response)
        return response


class _QueryError(RuntimeError):
    """The query cannot run at all (e.g. an unknown retriever): answered with status error."""


@dataclass
class _Step:
    id: str
    text: str
    revision: int = 0
    answer: str | None = None
    vector: list[float] | None = None

    def to_plan_step(self, sub_question_id: str) -> PlanStep:
        return PlanStep(
            id=self.id, sub_question_id=sub_question_id, text=self.text, answer=self.answer, revision=self.revision
        )


@dataclass
class _SubQuestion:
    id: str
    text: str
    done: list[_Step] = field(default_factory=list)
    pending: list[_Step] = field(default_factory=list)
    revision: int = 0
    created: int = 0
    answer: str | None = None
    failures: list[str] = field(default_factory=list)
    evidence: dict[str, EvidenceTriplet] = field(default_factory=dict)

    def new_step(self, text: str) -> _Step:
        self.created += 1
        return _Step(id=f"{self.id}.s{self.created}", text=text, revision=self.revision)

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
class _Clue:
    id: str
    text: str
    seeds: list[str]
    vector: list[float] | None = None
    answer: str | None = None
    triplets: list[Triplet] = field(default_factory=list)


class PlanningQA:
    """PAI-2 question answering over one user's memory graph.

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
        self.llm: LLM = _StageMeteredLLM(llm)
        self.matcher = EntityMatcher(graph, vectors, embedder)
        self._retrievers = retrievers
        self._retriever_cache: dict[str, Retriever] = {}

    def retriever(self, name: str) -> Retriever:
        if name in self._retriever_cache:
            return self._retriever_cache[name]
        try:
            found = self._retrievers[name] if isinstance(self._retrievers, Mapping) else self._retrievers(name)
        except (KeyError, ValueError) as exc:
            raise _QueryError(f"unknown retriever {name!r}") from exc
        self._retriever_cache[name] = found
        return found

    async def answer(self, query: Query, emit: Emit | None = None) -> Answer:
        t0 = time.perf_counter()
        recorder = StageRecorder(query, uuid.uuid4().hex, emit)
        config = self.config.for_query(query.options)
        run = _Run(self, query, config, recorder)
        with recorder.active():
            try:
                answer = await run.execute()
            except _QueryError as exc:
                answer = run.error_answer(str(exc))
            except Exception as exc:
                # A store or retriever failure: report it on the answer instead of losing the query.
                log.exception("qa_failed", query_id=query.query_id, user_id=query.user_id)
                root = _first(exc)
                answer = run.error_answer(f"{type(root).__name__}: {root}")
        seconds = time.perf_counter() - t0
        answer = answer.model_copy(update={"duration_ms": seconds * 1000.0, "llm_calls": recorder.usage.llm_calls})
        # QA_LATENCY / QA_ANSWERS and the "answered" log line belong to the QAService that calls this engine.
        log.debug(
            "planning_qa_done",
            query_id=query.query_id,
            trace_id=recorder.trace_id,
            status=answer.status.value,
            llm_calls=answer.llm_calls,
            stage_events=len(recorder.events),
        )
        return answer


class _Run:
    """The state of one query through the pipeline."""

    def __init__(self, qa: PlanningQA, query: Query, config: QAConfig, recorder: StageRecorder) -> None:
        self.qa = qa
        self.query = query
        self.config = config
        self.recorder = recorder
        self.user_id = query.user_id
        self.sub_questions: list[_SubQuestion] = []
        self.plan_history: list[list[PlanStep]] = []
        self.errors: list[str] = []

    # -- top level --------------------------------------------------------------------------------------------

    async def execute(self) -> Answer:
        retriever = self.qa.retriever(self.config.retriever)  # fail fast, before any LLM call
        texts = await self._decompose()
        self.sub_questions = [_SubQuestion(id=f"sq{i}", text=t) for i, t in enumerate(texts, 1)]
        await _all(self._solve(sq, retriever) for sq in self.sub_questions)
        return await self._combine()

    def error_answer(self, message: str) -> Answer:
        return self._answer(NO_ANSWER, AnswerStatus.ERROR, error=message)

    def _answer(self, text: str, status: AnswerStatus, error: str | None = None) -> Answer:
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

    async def _task(self, scope: StageScope, task: LLMTask[Any, T], inputs: Any) -> T:
        """Run one LLM task; on failure mark the stage and re-raise ``TaskFailed`` for the caller to degrade."""
        try:
            result = await run_task(self.qa.llm, task, inputs, attempts=self.config.task_attempts)
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

    # -- stage 1 and 13 ---------------------------------------------------------------------------------------

    async def _decompose(self) -> list[str]:
        question = self.query.question
        if not self.config.decomposition:
            await self.recorder.mark(Stage.DECOMPOSE, StageStatus.SKIPPED)
            return [question]
        async with self.recorder.stage(Stage.DECOMPOSE) as scope:
            try:
                inputs = DecomposeInput(question=question, max_sub_questions=self.config.max_sub_questions)
                texts = await self._task(scope, DecomposeTask(), inputs)
            except TaskFailed as exc:
                self.errors.append(str(exc))
                texts = [question]  # degrade: the question itself is the only sub-question
            scope.detail["sub_questions"] = texts
            return texts

    async def _combine(self) -> Answer:
        async with self.recorder.stage(Stage.COMBINE) as scope:
            answered = [sq for sq in self.sub_questions if sq.answer is not None]
            if not answered:
                failed = [f for sq in self.sub_questions for f in sq.failures]
                scope.status = StageStatus.EMPTY
                if failed:
                    return self._answer(NO_ANSWER, AnswerStatus.ERROR, error="; ".join([*self.errors, *failed]))
                return self._answer(NO_ANSWER, AnswerStatus.NO_ANSWER)
            if len(self.sub_questions) == 1:
                scope.detail["combined"] = False  # one sub-question: its answer is the answer
                return self._answer(answered[0].answer or NO_ANSWER, AnswerStatus.ANSWERED)
            findings = [Finding(query=sq.text, answer=sq.answer) for sq in self.sub_questions]
            try:
                text = await self._task(
                    scope, CombineTask(), CombineInput(question=self.query.question, sub_answers=findings)
                )
            except TaskFailed as exc:
                joined = " ".join(sq.answer for sq in answered if sq.answer)
                return self._answer(joined, AnswerStatus.ANSWERED, error=f"combine failed, sub-answers joined: {exc}")
            if text is None:
                scope.status = StageStatus.EMPTY
                return self._answer(NO_ANSWER, AnswerStatus.NO_ANSWER)
            return self._answer(text, AnswerStatus.ANSWERED)

    # -- one sub-question: stages 2, 9-12 ---------------------------------------------------------------------

    async def _solve(self, sq: _SubQuestion, retriever: Retriever) -> None:
        ctx = {"sub_question_id": sq.id}
        async with self.recorder.stage(Stage.PLAN, **ctx) as scope:
            try:
                texts = await self._task(
                    scope, PlanTask(), PlanInput(question=sq.text, max_steps=self.config.max_steps)
                )
            except TaskFailed as exc:
                sq.failures.append(str(exc))
                texts = [sq.text]  # degrade: one step, the sub-question itself
            sq.pending = [sq.new_step(t) for t in texts]
            scope.detail["steps"] = texts
        self.plan_history.append(sq.plan)

        while sq.pending and len(sq.done) < self.config.max_steps:
            step = sq.pending.pop(0)
            async with self.recorder.stage(Stage.NEXT_STEP, step_id=step.id, **ctx) as scope:
                scope.detail["step"] = step.text
            step.answer = await self._search_step(sq, step, retriever)
            sq.done.append(step)
            if await self._sufficient(sq, step):
                return
            if len(sq.done) >= self.config.max_steps:
                break
            await self._enhance(sq, step)

        async with self.recorder.stage(Stage.NO_ANSWER, **ctx) as scope:
            scope.detail["steps_done"] = len(sq.done)
            scope.detail["reason"] = "step limit" if len(sq.done) >= self.config.max_steps else "plan exhausted"

    async def _sufficient(self, sq: _SubQuestion, step: _Step) -> bool:
        async with self.recorder.stage(Stage.SUFFICIENCY, sub_question_id=sq.id, step_id=step.id) as scope:
            if step.answer is None:
                # Nothing new was learnt, so the last verdict (not enough) stands: save the call.
                scope.status = StageStatus.SKIPPED
                return False
            own = ids.normalize_text(sq.text)
            if any(ids.normalize_text(s.text) == own for s in sq.pending):
                # The plan still holds the question itself: its search comes before any verdict. Asked "Where does
                # Tom work now?" after "Who is Tom?" had found "a chemistry teacher" (said in April), the default
                # model judged that sufficient and never reached the step that would have found September's job.
                scope.status = StageStatus.SKIPPED
                scope.detail["reason"] = "the question's own step is still to come"
                return False
            try:
                steps_left = min(len(sq.pending), self.config.max_steps - len(sq.done))
                inputs = SufficiencyInput(question=sq.text, findings=sq.findings, steps_left=steps_left)
                answer = await self._task(scope, SufficiencyTask(), inputs)
            except TaskFailed as exc:
                sq.failures.append(str(exc))
                return False  # degrade: keep searching
            asked = [s for s in sq.done if s.answer and ids.normalize_text(s.text) == own]
            if answer is not None and asked and asked[-1].answer != answer:
                # A step that asked the question itself found its answer: that is the answer. Given "Who is Maya?"
                # and "Where does Maya work now?" found, the default model answered the second with the first.
                scope.detail["answer_of_step"] = asked[-1].id
                answer = asked[-1].answer
            scope.detail["sufficient"] = answer is not None
            sq.answer = answer
            return answer is not None

    async def _enhance(self, sq: _SubQuestion, step: _Step) -> None:
        ctx = {"sub_question_id": sq.id, "step_id": step.id}
        if not self.config.plan_enhancement:
            await self.recorder.mark(Stage.ENHANCE, StageStatus.SKIPPED, **ctx)
            return
        async with self.recorder.stage(Stage.ENHANCE, **ctx) as scope:
            inputs = EnhanceInput(
                question=sq.text,
                done=sq.findings,
                remaining=[s.text for s in sq.pending],
                max_steps=self.config.max_steps - len(sq.done),
            )
            try:
                texts = await self._task(scope, EnhanceTask(), inputs)
            except TaskFailed as exc:
                sq.failures.append(str(exc))
                return  # degrade: keep the plan as it is
            if not texts or texts == inputs.remaining:
                scope.detail["changed"] = False
                return
            sq.revision += 1
            old = {ids.normalize_text(s.text): s for s in sq.pending}
            sq.pending = [old.get(ids.normalize_text(t)) or sq.new_step(t) for t in texts]
            scope.detail["changed"] = True
            scope.detail["steps"] = texts
        self.plan_history.append(sq.plan)

    # -- one step: stages 3-8 ---------------------------------------------------------------------------------

    async def _search_step(self, sq: _SubQuestion, step: _Step, retriever: Retriever) -> str | None:
        ctx = {"sub_question_id": sq.id, "step_id": step.id}
        async with self.recorder.stage(Stage.NER, **ctx) as scope:
            try:
                inputs = NerInput(step=step.text, max_entities=self.config.max_entities)
                entities = await self._task(scope, NerTask(), inputs)
            except TaskFailed as exc:
                sq.failures.append(str(exc))
                entities = []
            scope.detail["entities"] = entities
            by_step = not entities
            if by_step:
                scope.status = StageStatus.EMPTY if scope.status is StageStatus.OK else scope.status
                entities = [step.text]  # degrade: match the step text itself against object vertices

        async with self.recorder.stage(Stage.MATCH, **ctx) as scope:
            matches = await self.qa.matcher.match(self.user_id, entities, self.config.matches_per_entity)
            vertices = {m.vertex.id: m.vertex.name for ms in matches.values() for m in ms}
            scope.vertices = len(vertices)
            scope.detail["matches"] = {e: [m.vertex.name for m in ms] for e, ms in matches.items()}
            if not vertices:
                scope.status = StageStatus.EMPTY

        clues = await self._clue_queries(sq, step, matches, by_step)
        await _all(self._traverse(sq, step, clue, retriever) for clue in clues)
        # Several matched vertices often lead to the very same triplets: the same memory is read once, by the
        # best-ranked clue-query that got it, and the others share its answer.
        readers: dict[frozenset[str], list[_Clue]] = {}
        for clue in clues:
            readers.setdefault(frozenset(t.id for t in clue.triplets), []).append(clue)
        await _all(self._read(sq, step, group) for group in readers.values())

        async with self.recorder.stage(Stage.SUMMARISE, **ctx) as scope:
            findings = [Finding(query=c.text, answer=c.answer) for c in clues]
            found = [f for f in findings if f.answer]
            scope.detail["clues_answered"] = len(found)
            for clue in clues:
                if clue.answer:
                    sq.evidence |= {t.id: _evidence(t) for t in clue.triplets}
            if not found:
                scope.status = StageStatus.EMPTY
                return None
            if len({ids.normalize_text(f.answer or "") for f in found}) == 1:
                return found[0].answer  # one finding (or the same one several times) needs no summary
            try:
                answer = await self._task(scope, StepAnswerTask(), StepAnswerInput(step=step.text, findings=findings))
            except TaskFailed as exc:
                sq.failures.append(str(exc))
                answer = " ".join(f.answer for f in found if f.answer)  # degrade: the findings side by side
            scope.detail["answer"] = (answer or "")[:300]
            return answer

    async def _clue_queries(
        self, sq: _SubQuestion, step: _Step, matches: dict[str, list[Match]], by_step: bool
    ) -> list[_Clue]:
        """``by_step``: the step itself was matched (no entities), so there is no entity to substitute."""
        ctx = {"sub_question_id": sq.id, "step_id": step.id}
        async with self.recorder.stage(Stage.CLUE_QUERIES, **ctx) as scope:
            combos = combinations(matches, self.config.max_clue_queries)
            texts: list[str | None] = [
                mention(step.text, [m.vertex.name for m in combo])
                if by_step
                else step.text
                if all(m.exact for m in combo)
                else None
                for combo in combos
            ]
            asks = [combo for combo, text in zip(combos, texts, strict=True) if text is None]
            subs = [[Substitution(entity=m.entity, vertex=m.vertex.name) for m in combo] for combo in asks]
            rewritten = [substitute(step.text, s) for s in subs]
            if subs and self.config.clue_query_mode == "llm":
                try:
                    inputs = ClueQueryInput(step=step.text, combinations=subs)
                    rewritten = await self._task(scope, ClueQueryTask(), inputs)
                except TaskFailed as exc:
                    sq.failures.append(str(exc))  # degrade: the deterministic substitution
            filled = iter(rewritten)
            clues: list[_Clue] = []
            seen: set[tuple[str, frozenset[str]]] = set()
            for combo, text in zip(combos, texts, strict=True):
                text = text if text is not None else next(filled)
                seeds = [m.vertex.id for m in combo]
                key = (ids.normalize_text(text), frozenset(seeds))
                if key not in seen:
                    seen.add(key)
                    clues.append(_Clue(id=f"{step.id}.c{len(clues) + 1}", text=text, seeds=seeds))
            if not clues:
                # No vertex matched: one seedless clue, for retrievers that can start from the query alone.
                clues.append(_Clue(id=f"{step.id}.c1", text=step.text, seeds=[]))
                scope.status = StageStatus.EMPTY
            # One embedding call per step: the step (for the filter) and its distinct clue texts (for traversal).
            texts_to_embed = list(dict.fromkeys([step.text, *(c.text for c in clues)]))
            embedded = dict(zip(texts_to_embed, await self.qa.embedder.embed(texts_to_embed), strict=True))
            step.vector = embedded[step.text]
            for clue in clues:
                clue.vector = embedded[clue.text]
            scope.detail["clue_queries"] = [c.text for c in clues]
            return clues

    async def _traverse(self, sq: _SubQuestion, step: _Step, clue: _Clue, retriever: Retriever) -> None:
        """Stages 6 and 7 for one clue-query."""
        ctx = {"sub_question_id": sq.id, "step_id": step.id, "clue_query_id": clue.id}
        async with self.recorder.stage(Stage.TRAVERSAL, **ctx) as scope:
            kinds = {VertexKind.OBJECT, VertexKind.THESIS}
            if self.config.episodic_context:
                kinds.add(VertexKind.EPISODIC)
            request = RetrievalRequest(
                user_id=self.user_id,
                query=clue.text,
                query_vector=clue.vector,
                seeds=clue.seeds,
                as_of=self.query.as_of,
                budget=self.config.budget,
                context_kinds=frozenset(kinds),
                params=dict(self.config.retriever_params),
            )
            try:
                retrieved = await retriever.retrieve(request)
            except Exception as exc:
                log.warning("qa_retriever_failed", retriever=self.config.retriever, exc_info=True)
                scope.fail(f"{type(exc).__name__}: {exc}")
                sq.failures.append(f"retriever {self.config.retriever}: {exc}")
                retrieved = []
            scope.triplets = len(retrieved)
            scope.vertices = len(clue.seeds)
            if not retrieved and scope.status is StageStatus.OK:
                scope.status = StageStatus.EMPTY

        async with self.recorder.stage(Stage.FILTER, **ctx) as scope:
            clue.triplets = await self._filter(retrieved, step.vector, clue.vector)
            scope.triplets = len(clue.triplets)
            scope.detail["retrieved"] = len(retrieved)
            if not clue.triplets:
                scope.status = StageStatus.EMPTY

    async def _read(self, sq: _SubQuestion, step: _Step, clues: list[_Clue]) -> None:
        """Stage 8 for clue-queries that got the same memory: the first reads it, the others share the answer."""
        clue, *others = clues
        ctx = {"sub_question_id": sq.id, "step_id": step.id}
        async with self.recorder.stage(Stage.SUMMARISE, clue_query_id=clue.id, **ctx) as scope:
            if clue.triplets:
                inputs = ClueAnswerInput(
                    query=clue.text, memory=[t.context for t in clue.triplets], as_of=self.query.as_of
                )
                try:
                    clue.answer = await self._task(scope, ClueAnswerTask(), inputs)
                except TaskFailed as exc:
                    sq.failures.append(str(exc))
                scope.detail["answer"] = (clue.answer or "")[:300]
            if clue.answer is None and scope.status is StageStatus.OK:
                scope.status = StageStatus.EMPTY  # nothing to read (no call), or nothing found in it
        for other in others:
            other.answer = clue.answer
            async with self.recorder.stage(Stage.SUMMARISE, clue_query_id=other.id, **ctx) as scope:
                scope.status = StageStatus.SKIPPED if other.triplets else StageStatus.EMPTY
                scope.detail["read_by"] = clue.id

    # -- stage 7 ----------------------------------------------------------------------------------------------

    async def _filter(
        self, triplets: Sequence[Triplet], step_vector: list[float] | None, clue_vector: list[float] | None
    ) -> list[Triplet]:
        """Keep the triplets of this user that held at ``as_of``, without episodic text unless asked, unique by
        id and by text, ranked by cosine to the step (or the clue-query), above the threshold, top-k."""
        as_of = self.query.as_of
        kept: dict[str, Triplet] = {}
        texts: set[str] = set()
        for t in triplets:
            ends = (t.start, t.end)
            if t.id in kept or any(v.user_id != self.user_id for v in ends) or t.edge.user_id != self.user_id:
                continue
            if not (t.edge.valid_at(as_of) and all(v.valid_at(as_of) for v in ends)):
                continue  # a retriever that ignores as_of must not leak an invalidated (or future) thesis or edge
            if not self.config.episodic_context and (
                t.edge.kind is EdgeKind.EPISODIC or any(v.kind is VertexKind.EPISODIC for v in ends)
            ):
                continue
            key = ids.normalize_text(t.text)
            if key in texts:
                continue
            texts.add(key)
            kept[t.id] = t
        if not kept:
            return []
        vectors = await self._triplet_vectors(list(kept.values()))
        targets = [v for v in (step_vector, clue_vector) if v is not None]
        scored = []
        for t in kept.values():
            score = max((cosine(target, vectors[t.id]) for target in targets), default=1.0)
            if score >= self.config.filter_threshold:
                scored.append((score, t))
        scored.sort(key=lambda pair: pair[0], reverse=True)
        return [t for _, t in scored[: self.config.filter_top_k]]

    async def _triplet_vectors(self, triplets: list[Triplet]) -> dict[str, list[float]]:
        """Stored vectors where the index has them (relation triplets by edge id, others by their end vertex),
        embedding only the rest."""
        index_id = {t.id: (t.id if t.edge.kind is EdgeKind.RELATION else t.end.id) for t in triplets}
        stored = await self.qa.vectors.get_vectors(self.user_id, sorted(set(index_id.values())))
        out = {tid: stored[iid] for tid, iid in index_id.items() if iid in stored}
        missing = [t for t in triplets if t.id not in out]
        if missing:
            for t, vector in zip(missing, await self.qa.embedder.embed([t.text for t in missing]), strict=True):
                out[t.id] = vector
        return out


async def _all(coroutines: Iterable[Coroutine[Any, Any, None]]) -> None:
    """Run concurrently; on the first failure cancel the rest (no orphan keeps calling the LLM after the answer
    went out) and raise that failure itself, not a group, so the answer's error message stays readable."""
    try:
        async with asyncio.TaskGroup() as group:
            for coroutine in coroutines:
                group.create_task(coroutine)
    except ExceptionGroup as failed:
        raise _first(failed) from failed


def _first(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


def _evidence(t: Triplet) -> EvidenceTriplet:
    return EvidenceTriplet(id=t.id, text=t.text, kind=t.edge.kind.value)
