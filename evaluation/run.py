"""``memstream eval DATASET``: memorize a dataset through the real memorize service, then score retrieval (no LLM,
every question) and end-to-end answers (a seeded sample), for memstream and the baselines, in one results folder.

Everything lands under ``--results`` (default ``eval-results/DATASET``): the memory (``memory.sqlite3``, events
already applied are skipped), the raw-text index of the flat-RAG baseline, the LLM cache (a rerun or an ablation
re-extracts nothing), ``rows.jsonl`` (one line per scored question and mode, written as it is scored and skipped on
rerun), ``results.json`` and ``report.md`` with its plots. An ablation that memorizes otherwise (``no_batching``)
has its own memory beside it (``memory-batch1.sqlite3``, with ``ingest-batch1.json``).
"""

from __future__ import annotations

import json
import os
import platform
import random
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tqdm import tqdm

from evaluation import datasets, metrics, report, temporal
from evaluation.ablations import Ablation, parse_all
from evaluation.baselines import FullContext, NoRetrieval, index_raw
from evaluation.datasets import Dataset, EvalQuestion
from evaluation.judge import AnswerJudgeInput, AnswerJudgeTask, RetentionInput, RetentionTask
from schemas.events import Answer, AnswerStatus, Query, QueryOptions, StageEvent
from services.adapters.sqlite import SqliteMemoryStore
from services.container import build_engine
from services.domain import VertexKind
from services.llm.factory import build_embedder, build_llm
from services.llm.layers import MeteredLLM, Usage
from services.llm.scope import llm_scope
from services.llm.task import TaskFailed, run_task
from services.logging import get_logger
from services.memorize.service import MemorizeOutcome, MemorizeService
from services.ports import Embedder
from services.qa.matching import EntityMatcher
from services.qa.service import QAEngine, QAService
from services.qa.simple import SimpleQA
from services.qa.tasks.common import is_no_info
from services.retrieval.base import RetrievalRequest, Retriever
from services.retrieval.registry import get_retriever
from services.settings import Settings

log = get_logger(__name__)

MODES = ("memory", "flat_rag", "full_context", "no_retrieval")
#: modes that retrieve nothing: their answers' context is not scored for recall
NO_CONTEXT = ("full_context", "no_retrieval")
KS = (1, 5, 10, 20)
#: what a query id may not hold (an ablation's mode has brackets and commas): replaced by "_"
_ID_UNSAFE = re.compile(r"[^A-Za-z0-9_.:@/+=-]")
#: the LLM-free retrieval rows of the flat-RAG baseline's index
RAW = "raw_flat"
#: a retriever's suffix that adds the episodes (the messages themselves) to its context: ``flat+episodic``,
#: ``beamsearch+flat+episodic`` (a mixture's members are joined by "+" too)
EPISODIC = "+episodic"


#: the LLM-free evaluation's retrievers: the default QA context (flat, with the messages), flat and the walk
#: without them, and the walks with them; bfs: the unscored yardstick of the walks
RETRIEVERS = ("flat+episodic", "flat", "beamsearch+episodic", "beamsearch", "mixture+episodic", "bfs+episodic")


@dataclass
class EvalConfig:
    dataset: str
    results: Path
    data_dir: Path = Path("../shared/data")
    data: Path | None = None
    corpus: Path | None = None
    questions: int | None = None  # end-to-end sample; the documents datasets also memorize only theirs
    per_category: bool = False  # the sample is ``questions`` of each category (type) instead of in all
    seed: int = 0
    samples: set[str] | None = None
    sessions: int | None = None  # LoCoMo: the first N sessions of each conversation
    adversarial: bool = False
    modes: tuple[str, ...] = MODES
    ablations: tuple[str, ...] = ()  # variants of the memory mode (evaluation.ablations), answered beside it
    retrievers: tuple[str, ...] = RETRIEVERS
    budget: int = 20
    llm: str | None = None  # None: the settings' (MEMSTREAM_LLM)
    model: str | None = None
    judge_model: str | None = None
    engine: str | None = None  # None: the settings' qa_engine
    batch: int = 8
    answers: bool = True  # False: the LLM-free retrieval evaluation only
    judge: bool = True
    cache: Path | None = None
    progress: bool = True
    settings_overrides: dict[str, Any] = field(default_factory=dict)


def _settings(config: EvalConfig) -> Settings:
    overrides: dict[str, Any] = {"batch_max_messages": config.batch, **config.settings_overrides}
    if config.llm:
        overrides["llm"] = config.llm
    if config.model:
        overrides["llm_model"] = config.model
    if config.engine:
        overrides["qa_engine"] = config.engine
    settings = Settings(**overrides)
    if settings.llm == "scripted" and not settings.scripted_llm and not config.engine:
        # a scripted run answers with the simple QA unless an engine is named (the rule-based stand-ins also answer
        # the fast engine's tasks, never the planning pipeline's)
        settings = settings.model_copy(update={"qa_engine": "simple"})
    return settings


class Rows:
    """``rows.jsonl``: one scored question per line, appended (and flushed) as each is scored."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: dict[str, dict[str, Any]] = {}
        if not path.exists():
            return
        lines = path.read_text(encoding="utf-8").splitlines()
        for line in lines:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a crash: scored again
            self.rows[row["key"]] = row
        if len(self.rows) != len(lines):  # rewritten without it, so that the next row does not join it
            path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in self.rows.values()), "utf-8")

    def __contains__(self, key: str) -> bool:
        return key in self.rows

    def add(self, row: dict[str, Any]) -> None:
        self.rows[row["key"]] = row
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")


def _fresh(before: Usage, after: Usage) -> dict[str, float]:
    """Model work between two snapshots: calls that reached the model, cache hits, tokens and seconds; and the
    tokens the cache hits had cost."""
    return {
        "calls": (after.calls - after.cached) - (before.calls - before.cached),
        "cached": after.cached - before.cached,
        "tokens_in": after.tokens_in - before.tokens_in,
        "tokens_out": after.tokens_out - before.tokens_out,
        "tokens_cached": after.tokens_cached - before.tokens_cached,
        "seconds": round(after.seconds - before.seconds, 3),
    }


def _snapshot(llm: MeteredLLM) -> Usage:
    return replace(llm.usage)


@dataclass
class Memory:
    """A memory built by memorize (the run's, or an ablation's own at another batch size) with what the harness
    reads of it: its matcher, retrievers and each question's gold ids (thesis ids differ between memories)."""

    store: SqliteMemoryStore
    batch: int
    settings: Settings
    label: str = ""  # "" for the run's memory, "batch=N" for another; tags its retrieval modes
    retrievers: dict[str, Retriever] = field(default_factory=dict)
    gold: dict[str, list[frozenset[str]]] = field(default_factory=dict)

    @staticmethod
    def files(results: Path, batch: int | None) -> tuple[Path, Path]:
        """Its store and its ingest cost record: the run's (``batch`` None), or ``memory-batchN.sqlite3``."""
        suffix = "" if batch is None else f"-batch{batch}"
        return results / f"memory{suffix}.sqlite3", results / f"ingest{suffix}.json"

    def mode(self, base: str) -> str:
        return f"{base}[{self.label}]" if self.label else base


@dataclass
class Arm:
    """How one answer mode answers: its engine, the store its evidence is read from, and its per-query options."""

    engine: QAEngine
    store: SqliteMemoryStore
    memory: Memory
    options: QueryOptions = field(default_factory=QueryOptions)
    #: why it is not run on this engine (a query option the simple QA has no use for); None: it runs
    skip: str | None = None


def sample_questions(
    questions: Sequence[EvalQuestion], n: int | None, seed: int, per_category: bool = False
) -> list[EvalQuestion]:
    """``n`` questions drawn with ``seed``, in dataset order: in all, or of each category (a category with fewer
    gives all of its own); ``None``: every question."""
    if n is None:
        return list(questions)
    if not per_category:
        if n >= len(questions):
            return list(questions)
        return [questions[i] for i in sorted(random.Random(seed).sample(range(len(questions)), n))]
    rng = random.Random(seed)
    by_category: dict[str, list[int]] = {}
    for i, q in enumerate(questions):
        by_category.setdefault(q.category, []).append(i)
    chosen: list[int] = []
    for category in sorted(by_category):
        members = by_category[category]
        chosen += members if n >= len(members) else rng.sample(members, n)
    return [questions[i] for i in sorted(chosen)]


class Harness:
    def __init__(
        self,
        config: EvalConfig,
        dataset: Dataset,
        settings: Settings,
        llm: MeteredLLM,
        judge: MeteredLLM,
        embedder: Embedder,
        memories: list[Memory],
        raw: SqliteMemoryStore,
    ) -> None:
        self.config = config
        self.dataset = dataset
        self.settings = settings
        self.llm = llm
        self.judge = judge
        self.embedder = embedder
        self.memories = memories
        self.memory = memories[0]
        self.raw = raw
        self.ablations: list[Ablation] = parse_all(config.ablations)
        self.rows = Rows(config.results / "rows.jsonl")
        self.texts = {e.event_id: e.text for e in dataset.events}
        self.matchers = {m.label: EntityMatcher(m.store, m.store, embedder) for m in memories}
        self.run_usage: dict[str, dict[str, float]] = {}

    def _bar(self, items: Iterable[Any], what: str, total: int | None = None) -> Iterable[Any]:
        return tqdm(items, desc=what, total=total, disable=not self.config.progress, unit="q")

    async def memorize(self) -> dict[str, Any]:
        """Memorize every event not applied yet into each memory, and index the raw texts; the run's memory's
        build cost over all runs (the others' are in ``self.ingests``)."""
        # the raw index calls no model: indexed first, it adds nothing to the memories' costs
        raw = await index_raw(self.raw, self.embedder, self.dataset.events, self.settings.document_chunk_chars)
        self.ingests: dict[str, dict[str, Any]] = {}
        for memory in self.memories:
            self.ingests[memory.label] = await self._memorize(memory, {} if memory.label else {"raw_indexed": raw})
        return self.ingests[""]

    async def _memorize(self, memory: Memory, extra: dict[str, Any]) -> dict[str, Any]:
        """Each user's events in ``memory.batch`` groups, into ``memory``; its build cost over all runs."""
        service = MemorizeService(memory.store.stores(), self.llm, self.embedder, memory.settings)
        before, started = _snapshot(self.llm), time.perf_counter()
        tasks_before = {task: replace(u) for task, u in self.llm.by_task.items()}
        events = self.dataset.events
        what = memory.mode("memorize")
        bar = tqdm(total=len(events), desc=what, unit="event", disable=not self.config.progress)
        memorized = skipped = 0
        dead: list[dict[str, str]] = []

        def on_step(chunk: list[datasets.MemoryEvent], outcome: MemorizeOutcome) -> None:
            nonlocal memorized, skipped
            skipped += len(outcome.skipped)
            memorized += len(chunk) - len(outcome.skipped)
            dead.extend(
                {"event_id": d.event_id, "reason": d.reason, "error": d.error[:300]} for d in outcome.dead_letters
            )
            bar.update(len(chunk))

        # users are independent (as partitions are in the worker): their batches share the model's decoding slots
        await service.memorize_backlog(events, on_step)
        bar.close()
        usage = _fresh(before, _snapshot(self.llm))
        # extraction apart from the checks after it (resolve, its check, entity confirmation): what a message costs
        by_task = {task: _fresh(tasks_before.get(task, Usage()), u) for task, u in self.llm.by_task.items()}
        this_run = {
            "events": len(events),
            "batch": memory.batch,
            "memorized": memorized,
            "skipped": skipped,
            "dead_letters": dead,
            "wall_s": round(time.perf_counter() - started, 2),
            "llm": usage,
            "llm_by_task": {task: u for task, u in sorted(by_task.items()) if u["calls"] or u["cached"]},
            **extra,
        }
        self.run_usage[what] = usage
        _, ingest = Memory.files(self.config.results, memory.batch if memory.label else None)
        return _ingest_log(ingest, this_run)

    async def _gold(self, q: EvalQuestion, memory: Memory) -> list[frozenset[str]]:
        """The memory ids of each gold evidence event (asked of the store once per question)."""
        if q.id not in memory.gold:
            texts = {e: self.texts.get(e, "") for e in q.evidence}
            found = await metrics.derived_ids(memory.store, q.user_id, texts, self.settings.document_chunk_chars)
            memory.gold[q.id] = [found[e] for e in q.evidence]
        return memory.gold[q.id]

    async def _context(
        self, retriever: str, q: EvalQuestion, vector: list[float], memory: Memory
    ) -> list[metrics.ContextItem]:
        if retriever == RAW:
            hits = await self.raw.search(q.user_id, ["episodic"], vector, q.text, k=max(KS))
            found = await self.raw.get_vertices(q.user_id, [h.id for h in hits])
            return [metrics.ContextItem(frozenset({h.id}), found[h.id].text) for h in hits if h.id in found]
        name = retriever.removesuffix(EPISODIC)
        kinds = {VertexKind.OBJECT, VertexKind.THESIS} | ({VertexKind.EPISODIC} if name != retriever else set())
        request = RetrievalRequest(
            user_id=q.user_id,
            query=q.text,
            query_vector=vector,
            seeds=await self.matchers[memory.label].question_seeds(q.user_id, q.text),
            budget=self.config.budget,
            context_kinds=frozenset(kinds),
        )
        if name not in memory.retrievers:
            memory.retrievers[name] = get_retriever(name, memory.store, memory.store, self.embedder)
        return metrics.triplet_items(await memory.retrievers[name].retrieve(request))

    def _recall(self, gold: list[frozenset[str]], q: EvalQuestion, items: list[metrics.ContextItem]) -> dict[str, Any]:
        out: dict[str, Any] = {f"recall@{k}": metrics.recall_at(gold, items, k) for k in KS}
        if q.triples:
            out |= {f"triple_recall@{k}": metrics.triple_recall_at(q.triples, items, k) for k in KS}
        return out

    async def retrieval(self) -> None:
        """LLM-free: every question, every retriever over every memory (and the raw index), recall@k."""
        runs = [(r, m) for m in self.memories for r in self.config.retrievers]
        if "flat_rag" in self.config.modes:
            runs.append((RAW, self.memory))
        todo = [
            (r, m, q) for q in self.dataset.questions for r, m in runs if self._retrieval_key(r, m, q) not in self.rows
        ]
        for retriever, memory, q in self._bar(todo, "retrieval"):
            started = time.perf_counter()
            vector = (await self.embedder.embed([q.text]))[0]
            items = await self._context(retriever, q, vector, memory)
            row = {
                "key": self._retrieval_key(retriever, memory, q),
                "kind": "retrieval",
                "mode": memory.mode(retriever),
                "id": q.id,
                "category": q.category,
                "items": len(items),
                "ms": round((time.perf_counter() - started) * 1000, 1),
                **self._recall(await self._gold(q, memory), q, items),
                **await self._dates(q, items, self.raw if retriever == RAW else memory.store, memory),
            }
            self.rows.add(row)

    async def _dates(
        self, q: EvalQuestion, items: list[metrics.ContextItem], store: SqliteMemoryStore, memory: Memory
    ) -> dict[str, bool]:
        """A temporal question whose answer names a date: does the context carry it (``evaluation.temporal``)? Its
        theses and episodes are read from the store it came from; a duration answer ("4 years") is not scored."""
        gold = temporal.gold_span(q.answers[0]) if q.category == "temporal" and q.answers else None
        if gold is None:
            return {}
        found = await store.get_vertices(q.user_id, sorted({i for item in items for i in item.ids}))
        shown = [v for v in found.values() if v.kind in (VertexKind.THESIS, VertexKind.EPISODIC)]
        evidence: set[str] = set().union(*await self._gold(q, memory))
        return temporal.dated(shown, gold, evidence)

    @staticmethod
    def _retrieval_key(retriever: str, memory: Memory, q: EvalQuestion) -> str:
        return f"retrieval:{memory.mode(retriever)}:{q.id}"

    def _arms(self) -> dict[str, Arm]:
        """Each answer mode of the run: the baselines, ``memory`` and its ablations. One engine per memory, built
        by the system's one builder; an ablation's switches travel as the query's options, as ``memstream ask``
        sends them."""
        engines: dict[tuple[str, str], QAEngine] = {}

        def engine(memory: Memory, name: str | None = None) -> QAEngine:
            """One engine per memory and engine name, built by the system's one builder."""
            settings = memory.settings.model_copy(update={"qa_engine": name}) if name else memory.settings
            key = (memory.label, settings.qa_engine)
            if key not in engines:
                engines[key] = build_engine(settings, memory.store.stores(), self.embedder, self.llm)
            return engines[key]

        arms: dict[str, Arm] = {}
        if "memory" in self.config.modes:
            arms["memory"] = Arm(engine(self.memory), self.memory.store, self.memory)
        if "flat_rag" in self.config.modes:
            flat_rag = SimpleQA(self.raw, self.raw, self.embedder, self.llm, top_k=self.settings.qa_top_k)
            arms["flat_rag"] = Arm(flat_rag, self.raw, self.memory)
        if "full_context" in self.config.modes:
            full = FullContext(self.llm, self.dataset.events, self.settings.llm_context)
            arms["full_context"] = Arm(full, self.memory.store, self.memory)
        if "no_retrieval" in self.config.modes:
            arms["no_retrieval"] = Arm(NoRetrieval(self.llm), self.memory.store, self.memory)
        by_batch = {m.batch: m for m in self.memories}
        for ablation in self.ablations:
            memory = by_batch[ablation.batch or self.config.batch]
            skip = None
            if ablation.options != QueryOptions() and (ablation.engine or self.settings.qa_engine) == "simple":
                # the simple QA has no plan, clue-queries, traversal or episodic switch: its rows would be the
                # memory mode's again, reported as an ablation that changed nothing
                skip = "simple_engine_ignores_options"
            arms[ablation.mode] = Arm(engine(memory, ablation.engine), memory.store, memory, ablation.options, skip)
        return arms

    def sample(self) -> list[EvalQuestion]:
        return sample_questions(
            self.dataset.questions, self.config.questions, self.config.seed, self.config.per_category
        )

    async def _evidence_items(
        self, q: EvalQuestion, answer: Answer, store: SqliteMemoryStore
    ) -> list[metrics.ContextItem]:
        """The answer's evidence with the vertices of those that are triplets (the planning QA cites edges)."""
        triplets = await store.get_triplets(q.user_id, [e.id for e in answer.evidence])
        return [
            metrics.ContextItem(
                frozenset({e.id} | ({triplets[e.id].start.id, triplets[e.id].end.id} if e.id in triplets else set())),
                e.text,
            )
            for e in answer.evidence
        ]

    @staticmethod
    def _skipped(arm: Arm, query: Query) -> dict[str, Any] | None:
        """Why this mode does not answer this question (recorded in its row, never scored), or None."""
        if arm.skip:
            return {"skipped": arm.skip}
        if isinstance(arm.engine, FullContext) and not arm.engine.fits(query):
            tokens = arm.engine.prompt_tokens(query)
            return {"skipped": "does_not_fit", "prompt_tokens": tokens, "available_tokens": arm.engine.available}
        return None

    async def answers(self) -> None:
        """End to end on the sample: each mode answers, is scored, and (unless off) judged with its reason."""
        arms = self._arms()
        before = _snapshot(self.llm)
        todo = [(m, q) for q in self.sample() for m in arms if f"answer:{m}:{q.id}" not in self.rows]
        for mode, q in self._bar(todo, "answers"):
            arm = arms[mode]
            stages: dict[str, float] = {}

            async def emit(event: StageEvent, stages: dict[str, float] = stages) -> None:
                stages[event.stage_name] = round(stages.get(event.stage_name, 0.0) + event.duration_ms, 1)

            query = Query(
                event_id=_ID_UNSAFE.sub("_", f"eval:{mode}:{q.id}")[:200],
                user_id=q.user_id,
                event_time=datetime.now(UTC),
                question=q.text,
                options=arm.options,
            )
            head = {
                "key": f"answer:{mode}:{q.id}",
                "kind": "answer",
                "mode": mode,
                "id": q.id,
                "category": q.category,
                "question": q.text,
                "gold": q.answers,
            }
            skipped = self._skipped(arm, query)
            if skipped:
                self.rows.add(head | skipped)
                continue
            start_usage, started = _snapshot(self.llm), time.perf_counter()
            answer = await QAService(arm.engine).answer(query, emit)
            seconds = time.perf_counter() - started
            usage = _fresh(start_usage, _snapshot(self.llm))
            no_answer = answer.status is AnswerStatus.NO_ANSWER or is_no_info(answer.answer)
            row = head | {
                "answer": answer.answer,
                "status": answer.status.value,
                "error": answer.error,
                "no_answer": no_answer,
                "f1": metrics.token_f1(answer.answer, q.answers),
                "em": metrics.exact_match(answer.answer, q.answers),
                "seconds": round(seconds, 3),
                "llm": usage,
                "stages_ms": stages,
            }
            if isinstance(arm.engine, FullContext):
                row["prompt_tokens"] = arm.engine.prompt_tokens(query)
            if mode not in NO_CONTEXT:
                items = await self._evidence_items(q, answer, arm.store)
                row["context"] = [i.text for i in items][:40]
                row |= self._recall(await self._gold(q, arm.memory), q, items)
            if q.unanswerable:
                # the judge's rubric marks "there is no answer" wrong, and a small judge is no fair grader of
                # abstaining: here the one right answer is none, and the harness knows whether it was given
                row |= {"judge": no_answer, "judge_reason": "unanswerable: right only if no answer is given"}
            elif self.config.judge:
                row |= await self._judge(q, AnswerJudgeTask(), AnswerJudgeInput(q.text, q.answers, answer.answer))
            self.rows.add(row)
        await self._judge_unjudged(arms)
        self.run_usage["answers"] = _fresh(before, _snapshot(self.llm))

    async def _judge_unjudged(self, arms: dict[str, Arm]) -> None:
        """Answers kept from a run without the judge are judged when a run with it resumes: the answers stand as
        they were, only the verdicts are added (a verdict that failed stays counted as failed)."""
        if not self.config.judge:
            return
        todo = [
            (q, row)
            for q in self.sample()
            if not q.unanswerable
            for m in arms
            if (row := self.rows.rows.get(f"answer:{m}:{q.id}")) is not None and "answer" in row and "judge" not in row
        ]
        for q, row in self._bar(todo, "judge"):
            verdict = await self._judge(q, AnswerJudgeTask(), AnswerJudgeInput(q.text, q.answers, row["answer"]))
            self.rows.add(row | verdict)

    async def _judge(self, q: EvalQuestion, task: Any, inputs: Any) -> dict[str, Any]:
        before = _snapshot(self.judge)
        with llm_scope(q.user_id):
            try:
                verdict = (await run_task(self.judge, task, inputs)).value
            except TaskFailed as exc:  # counted and kept, never scored as wrong
                return {"judge": None, "judge_reason": f"judge failed: {exc}", "judge_llm": self._since(before)}
        return {"judge": verdict.correct, "judge_reason": verdict.reason, "judge_llm": self._since(before)}

    def _since(self, before: Usage) -> dict[str, float]:
        return _fresh(before, _snapshot(self.judge))

    async def retention(self) -> None:
        """MINE: for each gold fact, what memory returns for it (LLM-free retrieval), judged by the LLM."""
        # what memorize kept, without the messages: an essay's own paragraphs would "retain" every fact of it
        retriever = self.config.retrievers[0].removesuffix(EPISODIC)
        todo = [q for q in self.sample_retention() if f"retention:{retriever}:{q.id}" not in self.rows]
        for q in self._bar(todo, "retention"):
            vector = (await self.embedder.embed([q.text]))[0]
            items = await self._context(retriever, q, vector, self.memory)
            row = {
                "key": f"retention:{retriever}:{q.id}",
                "kind": "retention",
                "mode": retriever,
                "id": q.id,
                "category": q.category,
                "fact": q.text,
                "context": [i.text for i in items],
            }
            if self.config.judge:
                row |= await self._judge(q, RetentionTask(), RetentionInput(q.text, [i.text for i in items]))
            self.rows.add(row)

    def sample_retention(self) -> list[EvalQuestion]:
        return list(self.dataset.questions)  # the essays were sampled when loading


def _ingest_log(path: Path, this_run: dict[str, Any]) -> dict[str, Any]:
    """The memory's build cost over all runs (a rerun memorizes nothing and must not erase what the build cost)."""
    runs = json.loads(path.read_text())["runs"] if path.exists() else []
    runs.append(this_run)
    # .get: runs recorded before a key was added count it as 0
    total = {key: sum(r["llm"].get(key, 0) for r in runs) for key in this_run["llm"]}
    memorized = sum(r["memorized"] for r in runs)
    summary = {
        "events": this_run["events"],
        "batch": this_run["batch"],
        "memorized": memorized,
        "wall_s": round(sum(r["wall_s"] for r in runs), 2),
        "dead_letters": sum(len(r["dead_letters"]) for r in runs),
        "llm": total,
        "per_message": {k: round(v / memorized, 3) for k, v in total.items()} if memorized else {},
        "calls_per_message_by_task": _calls_by_task(runs, memorized),
        "runs": runs,
    }
    path.write_text(json.dumps(summary, indent=1))
    return summary


def _calls_by_task(runs: list[dict[str, Any]], memorized: int) -> dict[str, float]:
    """Model calls (that reached the model) per memorized message, per task, over all runs."""
    calls: dict[str, float] = {}
    for run in runs:
        for task, usage in run.get("llm_by_task", {}).items():
            calls[task] = calls.get(task, 0) + usage["calls"]
    return {task: round(n / memorized, 3) for task, n in sorted(calls.items())} if memorized else {}


def _machine() -> str:
    system = f"{platform.system()} {platform.release()}"
    return f"{platform.machine()}, {os.cpu_count()} CPU cores, {system}, Python {platform.python_version()}"


async def evaluate(config: EvalConfig) -> dict[str, Any]:
    """Run (or resume) the evaluation; writes results.json and report.md, returns the results."""
    variants = parse_all(config.ablations)  # a misspelt ablation fails before anything is memorized
    config.results.mkdir(parents=True, exist_ok=True)
    dataset = datasets.load(
        config.dataset,
        config.data_dir,
        config.data,
        config.corpus,
        config.questions,
        config.seed,
        config.samples,
        config.adversarial,
        config.sessions,
    )
    settings = _settings(config)
    embedder = build_embedder(settings)
    memories = [
        Memory(
            await SqliteMemoryStore.open(config.results / "memory.sqlite3", dim=embedder.dim), config.batch, settings
        )
    ]
    # MINE scores retention of the run's memory only: no ablation's memory is built for it
    for batch in sorted({a.batch for a in variants if a.batch and a.batch != config.batch and not dataset.retention}):
        store = await SqliteMemoryStore.open(Memory.files(config.results, batch)[0], dim=embedder.dim)
        memory_settings = settings.model_copy(update={"batch_max_messages": batch})
        memories.append(Memory(store, batch, memory_settings, label=f"batch={batch}"))
    raw = await SqliteMemoryStore.open(config.results / "raw.sqlite3", dim=embedder.dim)
    cache = await SqliteMemoryStore.open(config.cache or config.results / "llm-cache.sqlite3", dim=embedder.dim)
    inner = None
    if settings.llm == "scripted" and not settings.scripted_llm:
        from evaluation.scripted import eval_llm

        inner = eval_llm()
    llm = build_llm(settings, cache=cache, inner=inner)
    judge = llm
    if config.judge_model and config.judge_model != llm.model:
        judge = build_llm(settings.model_copy(update={"llm_model": config.judge_model}), cache=cache)
    harness = Harness(config, dataset, settings, llm, judge, embedder, memories, raw)
    try:
        ingest = await harness.memorize()
        if dataset.retention:
            await harness.retention()
        else:
            await harness.retrieval()
            if config.answers:
                await harness.answers()
        results = report.summarize(harness.rows.rows.values())
        results["run"] = {
            "dataset": dataset.name,
            "data": str(config.data or config.data_dir),
            "events": len(dataset.events),
            "questions": len(dataset.questions),
            "answered_sample": len(harness.sample()) if config.answers and not dataset.retention else 0,
            "seed": config.seed,
            "modes": list(config.modes),
            "ablations": {
                a.mode: a.options.model_dump(exclude_none=True)
                | ({"batch": a.batch} if a.batch else {})
                | ({"engine": a.engine} if a.engine else {})
                for a in variants
            },
            "retrievers": list(config.retrievers),
            "budget": config.budget,
            "llm": settings.llm,
            "model": llm.model,
            "judge_model": judge.model if config.judge else None,
            "qa_engine": settings.qa_engine,
            "embedder": settings.embedder,
            "machine": _machine(),
            "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "this_run_llm": harness.run_usage | {"total": _fresh(Usage(), llm.usage)},
            "this_run_judge": _fresh(Usage(), judge.usage) if judge is not llm else None,
        }
        results["ingest"] = {k: v for k, v in ingest.items() if k != "runs"}
        results["ingest_ablations"] = {
            label: {k: v for k, v in summary.items() if k != "runs"}
            for label, summary in harness.ingests.items()
            if label
        }
        (config.results / "results.json").write_text(json.dumps(results, indent=1, ensure_ascii=False))
        report.write(config.results, results)
        return results
    finally:
        await llm.close()
        if judge is not llm:
            await judge.close()
        for memory in memories:
            await memory.store.close()
        await raw.close()
        await cache.close()
        await embedder.close()
