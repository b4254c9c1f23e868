"""``memstream eval DATASET``: memorize a dataset through the real memorize service, then score retrieval (no LLM,
every question) and end-to-end answers (a seeded sample), for memstream and the baselines, in one results folder.

Everything lands under ``--results`` (default ``eval-results/DATASET``): the memory (``memory.sqlite3``, events
already applied are skipped), the raw-text index of the flat-RAG baseline, the LLM cache (a rerun or an ablation
re-extracts nothing), ``rows.jsonl`` (one line per scored question and mode, written as it is scored and skipped on
rerun), ``results.json`` and ``report.md`` with its plots.
"""

from __future__ import annotations

import json
import os
import platform
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tqdm import tqdm

from evaluation import datasets, metrics, report
from evaluation.baselines import NoRetrieval, index_raw
from evaluation.datasets import Dataset, EvalQuestion
from evaluation.judge import AnswerJudgeInput, AnswerJudgeTask, RetentionInput, RetentionTask
from schemas.events import Answer, AnswerStatus, Query, StageEvent
from services.adapters.sqlite import SqliteMemoryStore
from services.container import build_engine
from services.llm.factory import build_embedder, build_llm
from services.llm.layers import MeteredLLM, Usage
from services.llm.scope import llm_scope
from services.llm.task import TaskFailed, run_task
from services.logging import get_logger
from services.memorize.service import MemorizeService
from services.ports import Embedder
from services.qa.matching import EntityMatcher
from services.qa.service import QAEngine, QAService
from services.qa.simple import SimpleQA
from services.qa.tasks.common import is_no_info
from services.retrieval.base import RetrievalRequest, Retriever
from services.retrieval.registry import get_retriever
from services.settings import Settings

log = get_logger(__name__)

MODES = ("memory", "flat_rag", "no_retrieval")
KS = (1, 5, 10, 20)
#: the LLM-free retrieval rows of the flat-RAG baseline's index
RAW = "raw_flat"


@dataclass
class EvalConfig:
    dataset: str
    results: Path
    data_dir: Path = Path("../shared/data")
    data: Path | None = None
    corpus: Path | None = None
    questions: int | None = None  # end-to-end sample; the documents datasets also memorize only theirs
    seed: int = 0
    samples: set[str] | None = None
    adversarial: bool = False
    modes: tuple[str, ...] = MODES
    retrievers: tuple[str, ...] = ("beamsearch", "flat", "mixture")
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
        # the rule-based stand-ins answer memorize's tasks and the simple QA's, not the planning pipeline's
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
    """Model work between two snapshots: calls that reached the model, cache hits, tokens and seconds."""
    return {
        "calls": (after.calls - after.cached) - (before.calls - before.cached),
        "cached": after.cached - before.cached,
        "tokens_in": after.tokens_in - before.tokens_in,
        "tokens_out": after.tokens_out - before.tokens_out,
        "seconds": round(after.seconds - before.seconds, 3),
    }


def _snapshot(llm: MeteredLLM) -> Usage:
    return replace(llm.usage)


class Harness:
    def __init__(
        self,
        config: EvalConfig,
        dataset: Dataset,
        settings: Settings,
        llm: MeteredLLM,
        judge: MeteredLLM,
        embedder: Embedder,
        memory: SqliteMemoryStore,
        raw: SqliteMemoryStore,
    ) -> None:
        self.config = config
        self.dataset = dataset
        self.settings = settings
        self.llm = llm
        self.judge = judge
        self.embedder = embedder
        self.memory = memory
        self.raw = raw
        self.rows = Rows(config.results / "rows.jsonl")
        self.texts = {e.event_id: e.text for e in dataset.events}
        self.matcher = EntityMatcher(memory, memory, embedder)
        self.run_usage: dict[str, dict[str, float]] = {}
        self._gold_ids: dict[str, list[frozenset[str]]] = {}
        self._retrievers: dict[str, Retriever] = {}

    def _bar(self, items: Iterable[Any], what: str, total: int | None = None) -> Iterable[Any]:
        return tqdm(items, desc=what, total=total, disable=not self.config.progress, unit="q")

    async def memorize(self) -> dict[str, Any]:
        """Memorize every event not applied yet, ``batch`` at a time per user; the costs of this run's work."""
        service = MemorizeService(self.memory, self.llm, self.embedder, self.settings)
        before, started = _snapshot(self.llm), time.perf_counter()
        events = self.dataset.events
        bar = tqdm(total=len(events), desc="memorize", unit="event", disable=not self.config.progress)
        memorized = skipped = 0
        dead: list[dict[str, str]] = []
        by_user: dict[str, list[datasets.MemoryEvent]] = {}
        for event in events:
            by_user.setdefault(event.user_id, []).append(event)
        for user_events in by_user.values():
            for start in range(0, len(user_events), self.config.batch):
                chunk = user_events[start : start + self.config.batch]
                outcome = await service.memorize(chunk)
                skipped += len(outcome.skipped)
                memorized += len(chunk) - len(outcome.skipped)
                dead.extend(
                    {"event_id": d.event_id, "reason": d.reason, "error": d.error[:300]} for d in outcome.dead_letters
                )
                bar.update(len(chunk))
        bar.close()
        raw_written = await index_raw(self.raw, self.embedder, events, self.settings.document_chunk_chars)
        usage = _fresh(before, _snapshot(self.llm))
        this_run = {
            "events": len(events),
            "memorized": memorized,
            "skipped": skipped,
            "dead_letters": dead,
            "raw_indexed": raw_written,
            "wall_s": round(time.perf_counter() - started, 2),
            "llm": usage,
        }
        self.run_usage["memorize"] = usage
        return _ingest_log(self.config.results / "ingest.json", this_run)

    async def _gold(self, q: EvalQuestion) -> list[frozenset[str]]:
        """The memory ids of each gold evidence event (asked of the store once per question)."""
        if q.id not in self._gold_ids:
            texts = {e: self.texts.get(e, "") for e in q.evidence}
            found = await metrics.derived_ids(self.memory, q.user_id, texts, self.settings.document_chunk_chars)
            self._gold_ids[q.id] = [found[e] for e in q.evidence]
        return self._gold_ids[q.id]

    async def _context(self, retriever: str, q: EvalQuestion, vector: list[float]) -> list[metrics.ContextItem]:
        if retriever == RAW:
            hits = await self.raw.search(q.user_id, ["episodic"], vector, q.text, k=max(KS))
            found = await self.raw.get_vertices(q.user_id, [h.id for h in hits])
            return [metrics.ContextItem(frozenset({h.id}), found[h.id].text) for h in hits if h.id in found]
        request = RetrievalRequest(
            user_id=q.user_id,
            query=q.text,
            query_vector=vector,
            seeds=await self.matcher.question_seeds(q.user_id, q.text),
            budget=self.config.budget,
        )
        if retriever not in self._retrievers:
            self._retrievers[retriever] = get_retriever(retriever, self.memory, self.memory, self.embedder)
        return metrics.triplet_items(await self._retrievers[retriever].retrieve(request))

    def _recall(self, gold: list[frozenset[str]], q: EvalQuestion, items: list[metrics.ContextItem]) -> dict[str, Any]:
        out: dict[str, Any] = {f"recall@{k}": metrics.recall_at(gold, items, k) for k in KS}
        if q.triples:
            out |= {f"triple_recall@{k}": metrics.triple_recall_at(q.triples, items, k) for k in KS}
        return out

    async def retrieval(self) -> None:
        """LLM-free: every question, every retriever (and the raw index), recall@k of the context."""
        retrievers = [*self.config.retrievers, *([RAW] if "flat_rag" in self.config.modes else [])]
        todo = [(r, q) for q in self.dataset.questions for r in retrievers if f"retrieval:{r}:{q.id}" not in self.rows]
        for retriever, q in self._bar(todo, "retrieval"):
            started = time.perf_counter()
            vector = (await self.embedder.embed([q.text]))[0]
            items = await self._context(retriever, q, vector)
            row = {
                "key": f"retrieval:{retriever}:{q.id}",
                "kind": "retrieval",
                "mode": retriever,
                "id": q.id,
                "category": q.category,
                "items": len(items),
                "ms": round((time.perf_counter() - started) * 1000, 1),
                **self._recall(await self._gold(q), q, items),
            }
            self.rows.add(row)

    def _engines(self) -> dict[str, QAEngine]:
        engines: dict[str, QAEngine] = {"memory": build_engine(self.settings, self.memory, self.embedder, self.llm)}
        engines["flat_rag"] = SimpleQA(self.raw, self.embedder, self.llm, top_k=self.settings.qa_top_k)
        engines["no_retrieval"] = NoRetrieval(self.llm)
        return {m: engines[m] for m in self.config.modes}

    def sample(self) -> list[EvalQuestion]:
        questions = self.dataset.questions
        n = self.config.questions
        if n is None or n >= len(questions):
            return list(questions)
        return [questions[i] for i in sorted(random.Random(self.config.seed).sample(range(len(questions)), n))]

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

    async def answers(self) -> None:
        """End to end on the sample: each mode answers, is scored, and (unless off) judged with its reason."""
        engines = self._engines()
        before = _snapshot(self.llm)
        todo = [(m, q) for q in self.sample() for m in engines if f"answer:{m}:{q.id}" not in self.rows]
        for mode, q in self._bar(todo, "answers"):
            stages: dict[str, float] = {}

            async def emit(event: StageEvent, stages: dict[str, float] = stages) -> None:
                stages[event.stage_name] = round(stages.get(event.stage_name, 0.0) + event.duration_ms, 1)

            query = Query(
                event_id=f"eval:{mode}:{q.id}"[:200], user_id=q.user_id, event_time=datetime.now(UTC), question=q.text
            )
            start_usage, started = _snapshot(self.llm), time.perf_counter()
            answer = await QAService(engines[mode]).answer(query, emit)
            seconds = time.perf_counter() - started
            usage = _fresh(start_usage, _snapshot(self.llm))
            store = self.raw if mode == "flat_rag" else self.memory
            items = await self._evidence_items(q, answer, store)
            no_answer = answer.status is AnswerStatus.NO_ANSWER or is_no_info(answer.answer)
            row = {
                "key": f"answer:{mode}:{q.id}",
                "kind": "answer",
                "mode": mode,
                "id": q.id,
                "category": q.category,
                "question": q.text,
                "gold": q.answers,
                "answer": answer.answer,
                "status": answer.status.value,
                "error": answer.error,
                "no_answer": no_answer,
                "f1": metrics.token_f1(answer.answer, q.answers),
                "em": metrics.exact_match(answer.answer, q.answers),
                "seconds": round(seconds, 3),
                "llm": usage,
                "stages_ms": stages,
                "context": [i.text for i in items][:40],
                **self._recall(await self._gold(q), q, items),
            }
            if self.config.judge:
                row |= await self._judge(q, AnswerJudgeTask(), AnswerJudgeInput(q.text, q.answers, answer.answer))
            self.rows.add(row)
        self.run_usage["answers"] = _fresh(before, _snapshot(self.llm))

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
        retriever = self.config.retrievers[0]
        todo = [q for q in self.sample_retention() if f"retention:{retriever}:{q.id}" not in self.rows]
        for q in self._bar(todo, "retention"):
            vector = (await self.embedder.embed([q.text]))[0]
            items = await self._context(retriever, q, vector)
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
    total = {key: sum(r["llm"][key] for r in runs) for key in this_run["llm"]}
    memorized = sum(r["memorized"] for r in runs)
    summary = {
        "events": this_run["events"],
        "memorized": memorized,
        "wall_s": round(sum(r["wall_s"] for r in runs), 2),
        "dead_letters": sum(len(r["dead_letters"]) for r in runs),
        "llm": total,
        "per_message": {k: round(v / memorized, 3) for k, v in total.items()} if memorized else {},
        "runs": runs,
    }
    path.write_text(json.dumps(summary, indent=1))
    return summary


def _machine() -> str:
    system = f"{platform.system()} {platform.release()}"
    return f"{platform.machine()}, {os.cpu_count()} CPU cores, {system}, Python {platform.python_version()}"


async def evaluate(config: EvalConfig) -> dict[str, Any]:
    """Run (or resume) the evaluation; writes results.json and report.md, returns the results."""
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
    )
    settings = _settings(config)
    embedder = build_embedder(settings)
    memory = await SqliteMemoryStore.open(config.results / "memory.sqlite3", dim=embedder.dim)
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
    harness = Harness(config, dataset, settings, llm, judge, embedder, memory, raw)
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
        (config.results / "results.json").write_text(json.dumps(results, indent=1, ensure_ascii=False))
        report.write(config.results, results)
        return results
    finally:
        await llm.close()
        if judge is not llm:
            await judge.close()
        await memory.close()
        await raw.close()
        await cache.close()
        await embedder.close()
