"""QA latency per stage of the PAI-2 pipeline, with a zero-latency scripted LLM: what the pipeline itself costs
(store, embedder, matching, traversal, filtering, bookkeeping) on top of the model.

The memory graph holds the gold evidence triples of the first ``--limit`` 2WikiMultihopQA questions, all under one
user, so each question's facts sit among the others' as distractors. The scripted model plans one step per gold
triple and reads answers by word overlap: it does not measure answer quality, only where the time goes.

    python -m benchmarks.qa_latency --limit 50 [--retriever beamsearch] [--questions PATH]

Prints a table to stderr and a JSON summary as the last line of stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from schemas.events import AnswerStatus, Query, QueryOptions, StageEvent
from services import ids
from services.adapters.minilm import MiniLMEmbedder
from services.adapters.sqlite import SqliteMemoryStore
from services.domain import ChangeSet, Edge, EdgeKind, Vertex, VertexKind
from services.llm.scripted import Responder, ScriptedLLM
from services.ports import Embedder, LLMRequest, VectorItem
from services.qa.base import QAConfig
from services.qa.planning import PlanningQA
from services.qa.stages import Stage
from services.retrieval.base import Retriever
from services.retrieval.registry import get_retriever

USER = "bench"
DEFAULT_QUESTIONS = (
    Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "2wikimultihopqa" / "questions_dev600.json"
)
_WORD = re.compile(r"\w+")
_STOP = frozenset(
    {"a", "an", "and", "the", "of", "in", "on", "is", "was", "were", "who", "what", "when", "where", "which"}
    | {"did", "do", "does", "from", "to", "by", "for"}
)


def words(text: str) -> set[str]:
    return {w for w in _WORD.findall(text.casefold()) if w not in _STOP}


def step_for(triple: list[str]) -> str:
    subject, relation, _ = triple
    return f"What is the {relation} of {subject}?"


async def build_graph(store: SqliteMemoryStore, embedder: Embedder, questions: list[dict[str, Any]]) -> int:
    vertices: dict[str, Vertex] = {}
    edges: dict[str, Edge] = {}
    texts: dict[str, tuple[str, str]] = {}
    for q in questions:
        for s, r, o in q["evidence"]:
            a = Vertex(id=ids.object_id(USER, s), user_id=USER, kind=VertexKind.OBJECT, name=s)
            b = Vertex(id=ids.object_id(USER, o), user_id=USER, kind=VertexKind.OBJECT, name=o)
            vertices.setdefault(a.id, a)
            vertices.setdefault(b.id, b)
            edge_id = ids.edge_id(USER, "relation", a.id, r, b.id)
            edges[edge_id] = Edge(
                id=edge_id, user_id=USER, kind=EdgeKind.RELATION, source=a.id, target=b.id, relation=r
            )
            texts[edge_id] = ("triplet", f"{vertices[a.id].name} {r} {vertices[b.id].name}")
    texts |= {v.id: ("object", v.name) for v in vertices.values()}
    order = list(texts)
    vectors = await embedder.embed([texts[i][1] for i in order])
    items = [
        VectorItem(id=i, kind=texts[i][0], text=texts[i][1], vector=v) for i, v in zip(order, vectors, strict=True)
    ]
    change = ChangeSet(
        id=ids.change_set_id(USER, ["2wiki"]),
        user_id=USER,
        event_ids=["2wiki"],
        vertices=list(vertices.values()),
        edges=list(edges.values()),
    )
    await store.apply(change, items)
    return len(vertices)


class Reader:
    """A zero-latency stand-in for the model; it sees only the prompts, plus each question's gold plan."""

    def __init__(self, questions: list[dict[str, Any]], names: list[str]) -> None:
        self.plans = {q["question"]: [step_for(t) for t in q["evidence"]] for q in questions}
        self.names = sorted(names, key=len, reverse=True)

    def responders(self) -> dict[str, Responder]:
        return {
            "decompose": lambda r: {"sub_questions": [self._field(r, "Question")]},
            "plan": lambda r: {"steps": self.plans.get(self._field(r, "Question"), [self._field(r, "Question")])},
            "ner": lambda r: {
                "entities": [n for n in self.names if n.casefold() in self._field(r, "Step").casefold()][:3]
            },
            "clue_query": self._clue_query,
            "clue_answer": self._clue_answer,
            "step_answer": lambda r: {"found": True, "answer": self._found(r)[0]},
            "sufficiency": self._sufficiency,
            "enhance": lambda r: {"steps": self._block(r, "Remaining")},
            "combine": lambda r: {"found": True, "answer": " ".join(self._found(r))},
        }

    @staticmethod
    def _text(request: LLMRequest) -> str:
        return request.messages[-1].content

    def _field(self, request: LLMRequest, label: str) -> str:
        for line in self._text(request).splitlines():
            if line.startswith(f"{label}: "):
                return line[len(label) + 2 :]
        return ""

    def _block(self, request: LLMRequest, label: str) -> list[str]:
        lines = self._text(request).splitlines()
        if f"{label}:" not in lines:
            return []
        out = []
        for line in lines[lines.index(f"{label}:") + 1 :]:
            m = re.match(r"^(?:- |\d+\. )(.*)$", line)
            if not m:
                break
            out.append(m.group(1))
        return out

    def _found(self, request: LLMRequest) -> list[str]:
        rows = self._block(request, "Findings") or self._block(request, "Answers")
        return [r.split(" -> ", 1)[1] for r in rows if " -> " in r and not r.endswith("-> not found")] or [""]

    def _clue_query(self, request: LLMRequest) -> dict[str, Any]:
        step = self._field(request, "Step")
        queries = []
        for row in self._block(request, "Matches"):
            q = step
            for pair in row.split("; "):
                entity, _, vertex = pair.partition(" -> ")
                q = q.replace(entity, vertex)
            queries.append(q)
        return {"queries": queries}

    def _clue_answer(self, request: LLMRequest) -> dict[str, Any]:
        question = words(self._field(request, "Question"))
        best = max(self._block(request, "Memory"), key=lambda m: len(words(m) & question), default="")
        return (
            {"evidence": best, "answer": best} if len(words(best) & question) >= 2 else {"evidence": "", "answer": ""}
        )

    def _sufficiency(self, request: LLMRequest) -> dict[str, Any]:
        plan = self.plans.get(self._field(request, "Question"), [])
        found = [f for f in self._found(request) if f]
        return {"sufficient": len(found) >= len(plan), "answer": found[-1] if found else ""}


def percentile(values: list[float], p: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p * (len(ordered) - 1)))]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    questions = json.loads(await asyncio.to_thread(Path(args.questions).read_text))[: args.limit]
    embedder = MiniLMEmbedder()
    with tempfile.TemporaryDirectory() as tmp:
        async with SqliteMemoryStore(Path(tmp) / "memory.sqlite3", embedder.dim) as store:
            started = time.perf_counter()
            n_vertices = await build_graph(store, embedder, questions)
            build_s = time.perf_counter() - started
            names = [v for q in questions for t in q["evidence"] for v in (t[0], t[2])]
            llm = ScriptedLLM(Reader(questions, names).responders())
            cache: dict[str, Retriever] = {}

            def retrievers(name: str) -> Retriever:
                return cache.setdefault(name, get_retriever(name, store, store, embedder))

            config = QAConfig(retriever=args.retriever, max_clue_queries=args.max_clue_queries)
            qa = PlanningQA(store, store, embedder, llm, retrievers, config)
            events: list[StageEvent] = []

            async def emit(event: StageEvent) -> None:
                events.append(event)

            await qa.answer(_query(questions[0]["question"], "warmup"))  # loads the model, warms the caches
            events.clear()
            latencies: list[float] = []
            statuses: dict[str, int] = defaultdict(int)
            hits = 0
            llm_calls: list[int] = []
            gate = asyncio.Semaphore(args.concurrency)

            async def one(i: int, q: dict[str, Any]) -> None:
                nonlocal hits
                async with gate:
                    answer = await qa.answer(_query(q["question"], f"q{i}"), emit)
                latencies.append(answer.duration_ms)
                statuses[answer.status.value] += 1
                llm_calls.append(answer.llm_calls)
                hits += answer.status is AnswerStatus.ANSWERED and q["answer"].casefold() in answer.answer.casefold()

            wall = time.perf_counter()
            await asyncio.gather(*(one(i, q) for i, q in enumerate(questions)))
            wall_s = time.perf_counter() - wall

    per_stage: dict[int, list[float]] = defaultdict(list)
    for e in events:
        per_stage[e.stage].append(e.duration_ms)
    stages = {
        f"{stage:02d}_{Stage(stage).label}": {
            "count": len(ms),
            "p50_ms": round(percentile(ms, 0.5), 3),
            "p95_ms": round(percentile(ms, 0.95), 3),
            "total_ms": round(sum(ms), 1),
        }
        for stage, ms in sorted(per_stage.items())
    }
    return {
        "benchmark": "qa_latency",
        "questions": len(questions),
        "retriever": args.retriever,
        "max_clue_queries": args.max_clue_queries,
        "concurrency": args.concurrency,
        "graph_vertices": n_vertices,
        "graph_build_s": round(build_s, 2),
        "qa_p50_ms": round(percentile(latencies, 0.5), 2),
        "qa_p95_ms": round(percentile(latencies, 0.95), 2),
        "qa_mean_ms": round(statistics.fmean(latencies), 2) if latencies else 0.0,
        "throughput_qps": round(len(questions) / wall_s, 2) if wall_s else 0.0,
        "llm_calls_per_query": round(statistics.fmean(llm_calls), 2) if llm_calls else 0.0,
        "statuses": dict(statuses),
        "gold_in_answer": hits,
        "stages": stages,
    }


def _query(question: str, qid: str) -> Query:
    return Query(event_id=qid, user_id=USER, event_time=datetime.now(UTC), question=question, options=QueryOptions())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS)
    parser.add_argument("--limit", type=int, default=50)
    parser.add_argument("--retriever", default="beamsearch")
    parser.add_argument("--max-clue-queries", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=1, help="queries in flight")
    args = parser.parse_args()
    summary = asyncio.run(run(args))
    for name, s in summary["stages"].items():
        sys.stderr.write(f"{name:<18} n={s['count']:<5} p50={s['p50_ms']:>8.2f} ms  p95={s['p95_ms']:>8.2f} ms\n")
    sys.stdout.write(json.dumps(summary) + "\n")


if __name__ == "__main__":
    main()
