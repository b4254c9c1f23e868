"""Temporal memory on LoCoMo (issue 11 item 6): for the category-2 ("when …?") questions, is the date asked for in
the theses retrieved for them?

  python -m benchmarks.temporal_locomo --samples conv-26 conv-30 --sessions 6 --cache bench/llm-cache.sqlite3
  python -m benchmarks.temporal_locomo ... --validity message    # "before": t_valid is the message's time

The conversations' first ``--sessions`` sessions are memorized, each conversation as its own user, through the
real memorize service and the default local model, ``--batch`` turns at a time. Questions are scored when all of
their evidence turns were memorized. Retrieval is LLM-free: the question's capitalised words are matched to object
vertices by the system's own matcher (exact names, then fused dense + lexical search), never from gold data; each
retriever returns its usual budget of triplets.

Dates are scored by ``evaluation.temporal`` (the harness scores the same on every LoCoMo temporal question:
``memstream eval locomo`` reports ``date_*`` beside recall). Answers that are durations ("4 years", "10 years
ago") name no date and are counted, not scored. Each is scored twice: any retrieved thesis with the
date (loose: for "June 2023" any thesis of a June message counts), and a retrieved thesis derived from one of the
question's evidence turns with the date (strict: the answer's own thesis, with its date).

``--validity message`` builds memory with the rule before issue 11 (t_valid = the message's time); with the LLM
cache it re-extracts nothing, so before and after differ only by that rule. Every run also scores ``said_t_valid``:
the same contexts read as that rule would date them (each thesis dated by the earliest message it came from), which
needs no second build: the checks after extraction see t_valid in their prompts, so a second build under the other
rule makes model calls the cache does not hold (with the default model those checks end nothing). The cache is
keyed by user, so ``--user-prefix eval-locomo-`` with ``--cache`` pointing at a ``memstream eval locomo`` results
folder's cache replays that run's extraction (whole conversations: ``--sessions 99``); the model calls a run still
made are in its summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time
from dataclasses import dataclass
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any

from evaluation.metrics import derived_ids
from evaluation.temporal import Span, gold_span, hits, text_spans, theses_of, valid_spans
from schemas.events import ChatMessage
from services.adapters.sqlite import SqliteMemoryStore
from services.domain import Vertex, VertexKind
from services.ingest.locomo import locomo_messages
from services.llm.factory import build_embedder, build_llm
from services.memorize import builder
from services.memorize.service import MemorizeService
from services.qa.matching import EntityMatcher
from services.retrieval.base import RetrievalRequest
from services.retrieval.registry import get_retriever
from services.settings import Settings

LOCOMO = Path("../shared/data/locomo/locomo_dev7.json")
RETRIEVERS = ("flat", "beamsearch", "mixture")


def _message_validity(when: Any, kind: str, said_at: datetime) -> tuple[datetime, datetime | None]:
    return said_at, None  # the rule before issue 11 item 2


@dataclass
class Question:
    sample: str
    text: str
    answer: str
    evidence: list[str]
    span: Span | None


def load(
    path: Path, samples: list[str], sessions: int, prefix: str = "temporal-"
) -> tuple[dict[str, list[ChatMessage]], list[Question]]:
    data = json.loads(path.read_text())
    chosen = [s for s in data if s["sample_id"] in samples]
    missing = set(samples) - {s["sample_id"] for s in chosen}
    if missing:
        raise SystemExit(f"no such samples in {path}: {sorted(missing)}")
    messages: dict[str, list[ChatMessage]] = {}
    questions: list[Question] = []
    for sample in chosen:
        sid = sample["sample_id"]
        kept = [
            m
            for m in locomo_messages(sample, user_id=f"{prefix}{sid}", now=datetime.now(UTC))
            if int(m.event_id.split(":")[-2].lstrip("D")) <= sessions
        ]
        messages[sid] = kept
        for qa in sample["qa"]:
            if qa.get("category") != 2:
                continue
            evidence = [str(e) for e in qa.get("evidence", [])]
            if all(int(e.split(":")[0].lstrip("D")) <= sessions for e in evidence if e):
                questions.append(Question(sid, qa["question"], str(qa["answer"]), evidence, gold_span(qa["answer"])))
    return messages, questions


async def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.validity == "message":
        builder.validity = _message_validity
    messages, questions = load(Path(args.data), args.samples, args.sessions, args.user_prefix)
    data_dir = Path(args.data_dir)
    settings = Settings(_env_file=None, data_dir=data_dir, batch_max_messages=args.batch)
    embedder = build_embedder(settings)
    memory_path = data_dir / f"temporal-{args.validity}.sqlite3"  # emptied by main()
    store = await SqliteMemoryStore.open(memory_path, dim=embedder.dim)
    cache = await SqliteMemoryStore.open(Path(args.cache), dim=embedder.dim)
    llm = build_llm(settings, cache=cache)
    service = MemorizeService(store.stores(), llm, embedder, settings)
    started = time.perf_counter()
    total = sum(len(m) for m in messages.values())
    done = dead = 0
    for sid, sample_messages in messages.items():
        for start in range(0, len(sample_messages), args.batch):
            chunk = sample_messages[start : start + args.batch]
            outcome = await service.memorize(chunk)
            dead += len(outcome.dead_letters)
            done += len(chunk)
            print(f"{sid} {done}/{total} dead={dead} {time.perf_counter() - started:.0f}s", flush=True)
    ingest_s = time.perf_counter() - started
    # every message's derived ids, read once: the evidence theses and the message rule's dates both come from it
    derived = {
        sid: await derived_ids(
            store, f"{args.user_prefix}{sid}", dict.fromkeys((m.event_id for m in ms), ""), chunk_chars=1
        )
        for sid, ms in messages.items()
    }
    said_on = {sid: _said_on(derived[sid], ms) for sid, ms in messages.items()}
    matcher = EntityMatcher(store, store, embedder)
    retrievers = {name: get_retriever(name, store, store, embedder) for name in RETRIEVERS}
    scored = [q for q in questions if q.span is not None]
    rows: list[dict[str, Any]] = []
    evidence_dated = 0
    for q in scored:
        user = f"{args.user_prefix}{q.sample}"
        span = q.span
        assert span is not None
        # the theses memorize derived from the evidence turns: a date on one of them is the answer's, not a
        # coincidence of another thesis of the same month
        evidence = [f"locomo:{q.sample}:{e}" for e in q.evidence]
        from_turns = await _theses_of_events(store, user, derived[q.sample], evidence)
        evidence_dated += any(hits(text_spans(t) + valid_spans(t), span) for t in from_turns)
        from_evidence = {t.id for t in from_turns}
        said = said_on[q.sample]
        vector = (await embedder.embed([q.text]))[0]
        seeds = await matcher.question_seeds(user, q.text)
        row: dict[str, Any] = {"sample": q.sample, "question": q.text, "answer": q.answer, "evidence": q.evidence}
        row["gold"] = [span.first.isoformat(), span.last.isoformat()]
        for name, retriever in retrievers.items():
            request = RetrievalRequest(user_id=user, query=q.text, query_vector=vector, seeds=seeds)
            theses = theses_of(await retriever.retrieve(request))
            by_valid = [t for t in theses if hits(valid_spans(t), span)]
            by_text = [t for t in theses if hits(text_spans(t), span)]
            by_said = [t for t in theses if t.id in said and hits([Span(said[t.id], said[t.id])], span)]
            row[name] = {
                "t_valid": bool(by_valid),
                "text": bool(by_text),
                "evidence_t_valid": any(t.id in from_evidence for t in by_valid),
                "said_t_valid": bool(by_said),
                "evidence_said_t_valid": any(t.id in from_evidence for t in by_said),
                "evidence_text": any(t.id in from_evidence for t in by_text),
                "evidence_retrieved": any(t.id in from_evidence for t in theses),
                "theses": len(theses),
                "hit": [t.text for t in {t.id: t for t in by_valid + by_text}.values()],
            }
        rows.append(row)
    summary: dict[str, Any] = {
        "validity": args.validity,
        "samples": args.samples,
        "sessions": args.sessions,
        "messages": total,
        "dead_letters": dead,
        "questions_cat2": len(questions),
        "questions_scored": len(scored),
        "durations_not_scored": [q.answer for q in questions if q.span is None],
        "evidence_theses_have_date": evidence_dated,
        "ingest_s_per_message": round(ingest_s / max(total, 1), 2),
        "llm_calls": {task: u.calls - u.cached for task, u in llm.by_task.items()},
        "llm_cached": {task: u.cached for task, u in llm.by_task.items()},
        "model": settings.llm_model,
        "machine": f"{platform.machine()} {os.cpu_count()} cores, Python {platform.python_version()}",
    }
    for name in RETRIEVERS:
        keys = (
            "t_valid",
            "text",
            "evidence_retrieved",
            "evidence_t_valid",
            "evidence_text",
            "said_t_valid",
            "evidence_said_t_valid",
        )
        summary[name] = {key: sum(bool(r[name][key]) for r in rows) for key in keys}
        summary[name]["either"] = sum(bool(r[name]["hit"]) for r in rows)
        summary[name]["evidence_either"] = sum(r[name]["evidence_t_valid"] or r[name]["evidence_text"] for r in rows)
    await llm.close()
    await store.close()
    await cache.close()
    if args.out:
        text = json.dumps({"summary": summary, "questions": rows}, indent=1)
        await asyncio.to_thread(Path(args.out).write_text, text)
    return summary


def _said_on(derived: dict[str, frozenset[str]], messages: list[ChatMessage]) -> dict[str, date]:
    """Each thesis's day under the message rule: the day of the earliest message it was derived from."""
    day: dict[str, date] = {}
    for m in sorted(messages, key=lambda m: m.event_time, reverse=True):
        for vertex_id in derived[m.event_id]:
            day[vertex_id] = m.event_time.date()
    return day


async def _theses_of_events(
    store: SqliteMemoryStore, user: str, derived: dict[str, frozenset[str]], event_ids: list[str]
) -> list[Vertex]:
    """The theses memorize derived from these chat messages, valid or not (the harness's mapping)."""
    found = await store.get_vertices(user, sorted(set().union(*(derived.get(e, frozenset()) for e in event_ids))))
    return [v for v in found.values() if v.kind is VertexKind.THESIS]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(LOCOMO))
    parser.add_argument("--samples", nargs="+", default=["conv-26", "conv-30"])
    parser.add_argument("--sessions", type=int, default=6, help="memorize each conversation's first N sessions")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--validity", choices=["text", "message"], default="text")
    parser.add_argument("--user-prefix", default="temporal-", help="user id = prefix + sample id (the cache's key)")
    parser.add_argument("--data-dir", default="bench-data", help="model files, memory (rebuilt each run)")
    parser.add_argument("--cache", default="bench-data/llm-cache.sqlite3", help="LLM cache (kept across runs)")
    parser.add_argument("--out", help="write every question's result here (JSON)")
    args = parser.parse_args()
    Path(args.data_dir).mkdir(parents=True, exist_ok=True)
    for old in Path(args.data_dir).glob(f"temporal-{args.validity}.sqlite3*"):
        old.unlink()
    summary = asyncio.run(run(args))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
