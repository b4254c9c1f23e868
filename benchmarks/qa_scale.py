"""QA without the model, at scale: the non-LLM time per question of the default engine on a generated memory of
N triplets (10k to 1M), on the embedded store or on Dgraph + Weaviate.

The memory (``benchmarks.scale_memory``) is one user's chat of about N edges, plus ``--others`` users of
``--other-share`` x N each, so every read is scoped among other users' rows. It is written through the store's own
``apply`` in large change sets; what is measured is the production read path: ``build_engine`` (the fast engine,
the flat retriever, the messages in context: the defaults) over the store, with ``build_llm``'s layers (cache
included) around a zero-latency scripted model. So the time is everything but the model: matching, search,
graph reads, filtering, prompts, validation, the cache's reads and writes. The embedder is the synthetic
``HashEmbedder`` (microseconds), so MiniLM's share is not in it either; it is measured apart (``--minilm``).

Questions ask about a random valid thesis of the user, naming its subject and object (half), its subject (a
third), or nothing (the rest, matched by the whole question). ``--plan-share`` of them get a first answer that says
it is insufficient, so they run the planning round too (3 calls; the default allows one round): the slow path.
``found`` counts the questions whose thesis was among the lines shown to the model (a sanity check of the search,
not a quality figure: the texts and vectors are synthetic).

    python -m benchmarks.qa_scale --triplets 100000 --store /tmp/scale-100k.sqlite3 [--questions 200]
    python -m benchmarks.qa_scale --triplets 100000 --backend real   # Dgraph + Weaviate (scripts/stack up)

``--store`` keeps the generated file; a later run with the same path and size reuses it (no generation).
Prints a summary table to stderr and one JSON line to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import json
import os
import re
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client import REGISTRY

from benchmarks.scale_memory import Fact, Generator, HashEmbedder
from schemas.events import Query, QueryOptions, StageEvent
from services.adapters.sqlite import SqliteMemoryStore
from services.adapters.sqlite.follow import MIN_ITEMS
from services.container import build_engine
from services.llm.factory import build_llm
from services.llm.scripted import Responder, ScriptedLLM
from services.logging import configure_logging
from services.ports import LLMRequest, WholeBackend
from services.qa.service import QAService
from services.qa.stages import Stage
from services.settings import Settings

USER = "scale-user"
DIM = 384
_ROW = re.compile(r"^(?:- |\d+\. )(.*)$")


def read_totals() -> dict[str, tuple[float, float]]:
    """Per embedded-store read op: (seconds, calls) so far, from its latency histogram."""
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for metric in REGISTRY.collect():
        if metric.name != "memstream_sqlite_read_seconds":
            continue
        for sample in metric.samples:
            if sample.name.endswith("_sum"):
                out[sample.labels["op"]][0] = sample.value
            elif sample.name.endswith("_count"):
                out[sample.labels["op"]][1] = sample.value
    return {op: (v[0], v[1]) for op, v in out.items()}


def percentile(values: Sequence[float], p: float) -> float:
    return float(np.percentile(np.asarray(values), p * 100)) if values else 0.0


def _field(text: str, label: str) -> str:
    return next((row[len(label) + 2 :] for row in text.splitlines() if row.startswith(f"{label}: ")), "")


def _block(text: str, label: str) -> list[str]:
    rows = text.splitlines()
    if f"{label}:" not in rows:
        return []
    out = []
    for row in rows[rows.index(f"{label}:") + 1 :]:
        m = _ROW.match(row)
        if not m:
            break
        out.append(m.group(1))
    return out


def question_of(fact: Fact, style: int) -> str:
    """0: subject and object named; 1: the subject named; 2: no name (matched by the whole question)."""
    if style == 0 and fact.object:
        return f"Did {fact.subject} {fact.relation} {fact.object}?"
    if style <= 1:
        return f"What did {fact.subject} say about how they {fact.relation}?"
    return f"who was it that {fact.relation} something {fact.thesis.name.split(' ', 2)[-1]}?"


class Reader:
    """The scripted model: answers with the shown line that states the question's thesis (the first line when none
    does) and plans two steps, one per named entity. The first answer of a ``forced`` question is insufficient."""

    def __init__(self, facts: dict[str, Fact], forced: set[str]) -> None:
        self.facts = facts
        self.forced = forced
        self.calls: dict[str, int] = defaultdict(int)
        self.found: dict[str, bool] = {}

    def responders(self) -> dict[str, Responder]:
        return {"answer_check": self.answer_check, "search_plan": self.search_plan}

    def answer_check(self, request: LLMRequest) -> dict[str, Any]:
        text = request.messages[-1].content
        question = _field(text, "Question")
        fact = self.facts[question]
        memory = _block(text, "Memory")
        hit = next((m for m in memory if fact.thesis.name in m), None)
        self.found[question] = self.found.get(question, False) or hit is not None
        self.calls[question] += 1
        sufficient = hit is not None and not (question in self.forced and self.calls[question] == 1)
        answer = re.sub(r"^\[[\d-]+\] ", "", hit or (memory[0] if memory else "No answer"))
        return {"answer": answer, "sufficient": sufficient, "missing": "" if sufficient else "the fact asked"}

    def search_plan(self, request: LLMRequest) -> dict[str, Any]:
        question = _field(request.messages[-1].content, "Question")
        fact = self.facts[question]
        steps = [{"query": f"What did {fact.subject} {fact.relation}?", "names": [fact.subject]}]
        if fact.object:
            steps.append({"query": f"Who {fact.relation} {fact.object}?", "names": [fact.object]})
        return {"sub_questions": [question], "steps": steps}


async def generate(store: WholeBackend, args: argparse.Namespace, embedder: HashEmbedder) -> dict[str, Any]:
    """The bench user's memory and the others'; returns counts, timing and the bench user's facts."""
    started = time.perf_counter()
    users = [(USER, args.triplets)] + [
        (f"scale-other-{i}", int(args.triplets * args.other_share)) for i in range(args.others)
    ]
    out: dict[str, Any] = {}
    for n, (user, triplets) in enumerate(users):
        gen = Generator(user, triplets, embedder, seed=args.seed + n)
        for change, items in gen.change_sets():
            await store.apply(change, items)
        if user == USER:
            out["facts"] = gen.memory.facts
            out["bench"] = {"triplets": gen.memory.triplets, "messages": gen.memory.messages, "items": gen.memory.items}
        sys.stderr.write(f"generated {user}: {gen.memory.triplets} triplets, {time.perf_counter() - started:.0f} s\n")
    out["generation_s"] = round(time.perf_counter() - started, 1)
    return out


def facts_only(args: argparse.Namespace, embedder: HashEmbedder) -> list[Fact]:
    """The bench user's facts again (same seed, same facts) when the store was generated by an earlier run."""
    gen = Generator(USER, args.triplets, embedder, seed=args.seed)
    for _ in gen.change_sets():
        pass
    return gen.memory.facts


def disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.parent.glob(path.name + "*") if p.is_file())


async def open_store(args: argparse.Namespace) -> tuple[WholeBackend, bool]:
    """The store, and whether it already holds the generated memory."""
    if args.backend == "real":
        from services.adapters.remote import RemoteMemoryStore

        # MEMSTREAM_DGRAPH, MEMSTREAM_WEAVIATE_HTTP/_GRPC from `scripts/stack up dgraph weaviate`
        backend = await RemoteMemoryStore.from_settings(Settings(store="remote"), DIM)
        stats = await backend.stats(USER)
        return backend, sum(stats.edges.values()) >= args.triplets
    path = Path(args.store)
    fresh = not await asyncio.to_thread(path.exists)
    store = await SqliteMemoryStore.open(
        path, DIM, sign_min_items=None if args.exact else MIN_ITEMS, term_min_items=None if args.fts else MIN_ITEMS
    )
    return store, not fresh


async def recall(store: WholeBackend, facts: list[Fact], args: argparse.Namespace, embedder: HashEmbedder) -> dict:
    """The sign-bit search's hits against vec0's exact scan, for the searches a question makes (objects by name,
    theses and messages by the question): the share of the exact top n it also returns in its top n, for the
    whole depth the engine asks (k), its head (10) and its first hit. With these synthetic vectors an exact top k
    beyond the first few hits is near-ties of unrelated texts (an object's vector is one random word vector, so
    past its own name every other name is equally far), so the head is the telling figure."""
    exact = await SqliteMemoryStore.open(Path(args.store), DIM, sign_min_items=None)
    out: dict[str, float] = {}
    try:
        for kinds, k, texts in (
            (["object"], 30, [f.subject for f in facts[: args.recall]]),
            (["thesis", "episodic"], 180, [question_of(f, i % 3) for i, f in enumerate(facts[: args.recall])]),
        ):
            shared = {k: 0, 10: 0, 1: 0}
            total = {k: 0, 10: 0, 1: 0}
            for vector in embedder.vectors(texts).tolist():
                want = [h.id for h in await exact.search(USER, kinds, vector, None, k)]
                got = [h.id for h in await store.search(USER, kinds, vector, None, k)]
                for n in (k, 10, 1):
                    shared[n] += len(set(want[:n]) & set(got[:n]))
                    total[n] += len(want[:n])
            for n in (k, 10, 1):
                out[f"{'+'.join(kinds)}@{n}"] = round(shared[n] / max(total[n], 1), 4)
    finally:
        await exact.close()
    return out


async def measure(store: WholeBackend, facts: list[Fact], args: argparse.Namespace, embedder: HashEmbedder) -> dict:
    rng = np.random.default_rng(args.seed + 1000)
    valid = [f for f in facts if f.thesis.t_invalid is None]
    picks = rng.choice(len(valid), size=min(len(valid), args.questions + args.warmup), replace=False)
    by_question: dict[str, Fact] = {}
    for i, pick in enumerate(picks):
        style = 0 if i % 6 < 3 else 1 if i % 6 < 5 else 2
        by_question.setdefault(question_of(valid[int(pick)], style), valid[int(pick)])
    questions = list(by_question)
    forced = {q for i, q in enumerate(questions) if (i * args.plan_share) % 1 + args.plan_share >= 1}
    reader = Reader(by_question, forced)
    settings = Settings()
    llm = build_llm(settings, cache=store, inner=ScriptedLLM(reader.responders()))
    # the service as the QA worker runs it: its LLM scope tags cached calls as the user's, so forgetting them below
    # (what an earlier run on this store cached) makes every call a miss
    engine = QAService(build_engine(settings, store.stores(), embedder, llm))
    await store.forget(USER, None)
    events: list[StageEvent] = []

    async def emit(event: StageEvent) -> None:
        events.append(event)

    for q in questions[: args.warmup]:
        await engine.answer(_query(q))
    rows = []
    reads_before = read_totals()
    cpu_before = time.process_time()  # all threads: the CPU a question costs, whatever else runs on the machine
    profiler = cProfile.Profile() if args.profile else None
    if profiler:
        profiler.enable()
    for q in questions[args.warmup :]:
        events.clear()
        answer = await engine.answer(_query(q), emit)
        stages: dict[str, float] = defaultdict(float)
        for e in events:
            stages[Stage(e.stage).label] += e.duration_ms
        rows.append({"ms": answer.duration_ms, "calls": answer.llm_calls, "stages": stages, "q": q})
    cpu_s = time.process_time() - cpu_before
    if profiler:
        profiler.disable()
        profiler.dump_stats(args.profile)
    reads = {
        op: {"ms_per_question": round((s - reads_before.get(op, (0.0, 0.0))[0]) * 1000 / len(rows), 1),
             "calls_per_question": round((n - reads_before.get(op, (0.0, 0.0))[1]) / len(rows), 2)}
        for op, (s, n) in read_totals().items()
    }  # fmt: skip
    ms = [r["ms"] for r in rows]
    slow = [r["ms"] for r in rows if r["calls"] > 1]
    stage_names = sorted({s for r in rows for s in r["stages"]})
    return {
        "questions": len(rows),
        "p50_ms": round(percentile(ms, 0.5), 1),
        "p95_ms": round(percentile(ms, 0.95), 1),
        "p99_ms": round(percentile(ms, 0.99), 1),
        "mean_ms": round(statistics.fmean(ms), 1),
        "planning_round": {"questions": len(slow), "p50_ms": round(percentile(slow, 0.5), 1)},
        "cpu_ms_per_question": round(cpu_s * 1000 / len(rows), 1),
        "llm_calls_per_question": round(statistics.fmean(r["calls"] for r in rows), 2),
        "found": sum(reader.found.get(r["q"], False) for r in rows),
        "store_reads": reads,
        "stages_p95_ms": {s: round(percentile([r["stages"].get(s, 0.0) for r in rows], 0.95), 1) for s in stage_names},
        "stages_p50_ms": {s: round(percentile([r["stages"].get(s, 0.0) for r in rows], 0.5), 1) for s in stage_names},
    }


async def minilm_per_question() -> float:
    """What MiniLM would add: the embed calls of a first answer (the names, then question) on a real model."""
    from services.adapters.minilm import MiniLMEmbedder

    model = MiniLMEmbedder()
    await model.embed(["warm up"])
    started = time.perf_counter()
    for _ in range(10):
        await model.embed(["kalora", "mirdor"])
        await model.embed(["Did Kalora visit Mirdor?"])
    return (time.perf_counter() - started) * 100.0  # ms per question


async def run(args: argparse.Namespace) -> dict[str, Any]:
    embedder = HashEmbedder(DIM)
    store, ready = await open_store(args)
    out: dict[str, Any] = {"benchmark": "qa_scale", "backend": args.backend, "triplets": args.triplets}
    if args.backend == "sqlite":
        out["search"] = {"dense": "vec0" if args.exact else "sign bits", "lexical": "fts5" if args.fts else "terms"}
    try:
        if ready:
            facts = facts_only(args, embedder)
            out["generation_s"] = None
        else:
            made = await generate(store, args, embedder)
            facts = made.pop("facts")
            out |= made
        out["facts"] = len(facts)
        # the harness's own million generated facts, out of the collector's sight: a QA worker holds none of them,
        # and a full collection over them (0.8 s here) landed in one measured question of every run
        gc.collect()
        gc.freeze()
        out |= await measure(store, facts, args, embedder)
        if args.backend == "sqlite" and not args.exact and args.recall:
            out["recall_vs_exact"] = await recall(store, facts, args, embedder)
    finally:
        await store.close()
    if args.backend == "sqlite":
        out["disk_mb"] = round(disk_bytes(Path(args.store)) / 2**20, 1)
    if args.minilm:
        out["minilm_ms_per_question"] = round(await minilm_per_question(), 1)
    out["machine"] = f"{os.uname().machine}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}"
    return out


def _query(question: str) -> Query:
    qid = f"q{abs(hash(question))}"
    return Query(event_id=qid, user_id=USER, event_time=datetime.now(UTC), question=question, options=QueryOptions())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--triplets", type=int, default=10_000)
    parser.add_argument("--backend", choices=["sqlite", "real"], default="sqlite")
    parser.add_argument("--store", default="/tmp/memstream-scale.sqlite3", help="embedded store file (kept)")
    parser.add_argument("--others", type=int, default=3, help="other users")
    parser.add_argument("--other-share", type=float, default=0.05, help="their size, as a share of --triplets")
    parser.add_argument("--questions", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--plan-share", type=float, default=0.5, help="questions forced through a planning round")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--minilm", action="store_true", help="also time MiniLM's embed calls of a question")
    parser.add_argument("--exact", action="store_true", help="embedded: vec0's exact scan only (no sign bits)")
    parser.add_argument(
        "--fts", action="store_true", help="embedded: FTS5 for every lexical search (no in-memory index)"
    )
    parser.add_argument("--recall", type=int, default=50, help="searches compared with the exact scan (0: none)")
    parser.add_argument("--profile", help="write a cProfile of the measured questions to this file")
    args = parser.parse_args()
    configure_logging("WARNING")  # production logs at INFO: a few lines a question, left out of the timing
    summary = asyncio.run(run(args))
    for key in ("p50_ms", "p95_ms", "p99_ms", "found", "generation_s", "disk_mb"):
        sys.stderr.write(f"{key:<14} {summary.get(key)}\n")
    for stage, p95 in summary["stages_p95_ms"].items():
        sys.stderr.write(f"  {stage:<14} p50 {summary['stages_p50_ms'][stage]:>8.1f} ms  p95 {p95:>8.1f} ms\n")
    sys.stdout.write(json.dumps(summary) + "\n")


if __name__ == "__main__":
    main()
