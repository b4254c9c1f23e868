"""Retrieval benchmark on 2WikiMultihopQA gold evidence (no LLM): does the retrieved context hold the whole chain?

One memory graph (one user) is built from the gold evidence triples of *all* questions, so each question's chain
sits among the others' as distractors: an object vertex per subject/object, a relation edge per triple, and a thesis
per triple ("subject relation object") linked to both objects. All texts are embedded with the real MiniLM model
and stored in the real SQLite store.

Seeds come from the question text only (never from the gold evidence): object names found in the question as whole
words (normalised, longest match first, possessives allowed); when that finds nothing, the best fused dense + BM25
object hits. A gold triple counts as retrieved when its relation edge or its thesis is in the context; a question
counts when all its triples are.

    python -m benchmarks.retrieval_2wiki --budget 20 [--limit 100] [--retrievers beamsearch,flat]

Prints a table to stderr and a JSON summary as the last line of stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.adapters.minilm import MiniLMEmbedder
from services.adapters.sqlite import SqliteMemoryStore
from services.domain import ChangeSet, Edge, EdgeKind, Vertex, VertexKind
from services.ids import edge_id, normalize_name, normalize_text, object_id, thesis_id
from services.logging import configure_logging
from services.ports import VectorItem
from services.retrieval.base import RetrievalRequest
from services.retrieval.common import STOPWORDS
from services.retrieval.registry import get_retriever

USER = "bench-2wiki"
DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
DEFAULT_RETRIEVERS = "beamsearch,watercircles,astar,flat,tog2,mixture"
MAX_NAME_TOKENS = 24


@dataclass
class Question:
    id: str
    type: str
    text: str
    chain: list[tuple[str, str]]  # per gold triple: (relation edge id, thesis id)
    seeds: list[str] = field(default_factory=list)


def load_questions(path: Path, limit: int | None) -> list[dict[str, Any]]:
    data: list[dict[str, Any]] = json.loads(path.read_text(encoding="utf-8"))
    return data[:limit] if limit else data


def build_graph(records: list[dict[str, Any]]) -> tuple[ChangeSet, list[tuple[str, str, str]], list[Question]]:
    """Graph change set, the texts to embed as (id, kind, text), and the questions with their gold keys."""
    vertices: dict[str, Vertex] = {}
    edges: dict[str, Edge] = {}
    texts: dict[str, tuple[str, str]] = {}  # id -> (kind, text)
    questions: list[Question] = []
    for rec in records:
        chain: list[tuple[str, str]] = []
        for subject, relation, obj in rec["evidence"]:
            s, o = object_id(USER, subject), object_id(USER, obj)
            for vid, name in ((s, subject), (o, obj)):
                if vid not in vertices:
                    vertices[vid] = Vertex(id=vid, user_id=USER, kind=VertexKind.OBJECT, name=name)
                    texts[vid] = ("object", name)
            statement = f"{subject} {relation} {obj}"
            rid = edge_id(USER, EdgeKind.RELATION.value, s, relation, o)
            if rid not in edges:
                edges[rid] = Edge(id=rid, user_id=USER, kind=EdgeKind.RELATION, source=s, target=o, relation=relation)
                texts[rid] = ("triplet", statement)
            tid = thesis_id(USER, statement)
            if tid not in vertices:
                vertices[tid] = Vertex(id=tid, user_id=USER, kind=VertexKind.THESIS, name=statement)
                texts[tid] = ("thesis", statement)
                for end in dict.fromkeys((s, o)):
                    eid = edge_id(USER, EdgeKind.THESIS.value, end, "thesis", tid)
                    edges[eid] = Edge(
                        id=eid, user_id=USER, kind=EdgeKind.THESIS, source=end, target=tid, relation="thesis"
                    )
            chain.append((rid, tid))
        questions.append(Question(rec["id"], rec["question_type"], rec["question"], list(dict.fromkeys(chain))))
    change = ChangeSet(
        id="c_2wiki",
        user_id=USER,
        event_ids=["2wiki-build"],
        vertices=list(vertices.values()),
        edges=list(edges.values()),
    )
    return change, [(i, kind, text) for i, (kind, text) in texts.items()], questions


def question_spans(text: str) -> list[tuple[int, int, str]]:
    """Every run of up to MAX_NAME_TOKENS words, as (first word, end word, normalised name); a possessive "'s"
    at the end of a run is also tried without it."""
    words = normalize_text(text).split()
    spans = []
    for i in range(len(words)):
        for j in range(i + 1, min(len(words), i + MAX_NAME_TOKENS) + 1):
            name = normalize_name(" ".join(words[i:j]))
            spans.append((i, j, name))
            for suffix in ("'s", "’s"):
                if name.endswith(suffix):
                    spans.append((i, j, name[: -len(suffix)]))
    return spans


def exact_seeds(text: str, names: dict[str, str]) -> list[str]:
    """Object ids whose names occur in the text as whole words: longest first, no overlaps, no lone stop words."""
    found = [
        (i, j, names[name])
        for i, j, name in question_spans(text)
        if name in names and name not in STOPWORDS and len(name) > 1
    ]
    found.sort(key=lambda x: (-(x[1] - x[0]), x[0]))
    taken: set[int] = set()
    seeds: list[str] = []
    for i, j, vid in found:
        if taken.isdisjoint(range(i, j)):
            taken.update(range(i, j))
            seeds.append(vid)
    return list(dict.fromkeys(seeds))


async def run(args: argparse.Namespace) -> dict[str, Any]:
    records = load_questions(args.questions or args.data_dir / "2wikimultihopqa" / "questions_dev600.json", args.limit)
    change, items, questions = build_graph(records)
    embedder = MiniLMEmbedder()
    started = time.perf_counter()
    item_vecs = await embedder.embed([text for _, _, text in items])
    question_vecs = await embedder.embed([q.text for q in questions])
    embed_s = time.perf_counter() - started
    vectors = [
        VectorItem(id=i, kind=kind, text=text, vector=v) for (i, kind, text), v in zip(items, item_vecs, strict=True)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        store = await SqliteMemoryStore.open(Path(args.store or tmp) / "bench.sqlite3", dim=embedder.dim)
        try:
            await store.apply(change, vectors)
            names = {normalize_name(v.name): v.id for v in change.vertices if v.kind is VertexKind.OBJECT}
            seed_stats = await choose_seeds(store, questions, question_vecs, names, args.fallback_seeds)
            results = {}
            for name in args.retrievers.split(","):
                retriever = get_retriever(name, store, store, embedder)
                results[name] = await evaluate(retriever, questions, question_vecs, args.budget)
                report(name, results[name])
        finally:
            await store.close()
    return {
        "benchmark": "retrieval_2wiki",
        "questions": len(questions),
        "budget": args.budget,
        "graph": {
            "objects": sum(v.kind is VertexKind.OBJECT for v in change.vertices),
            "theses": sum(v.kind is VertexKind.THESIS for v in change.vertices),
            "edges": len(change.edges),
        },
        "embed_seconds": round(embed_s, 1),
        "seeds": seed_stats,
        "retrievers": results,
    }


async def choose_seeds(
    store: SqliteMemoryStore,
    questions: list[Question],
    vecs: list[list[float]],
    names: dict[str, str],
    fallback: int,
) -> dict[str, float]:
    by_exact = 0
    for q, vec in zip(questions, vecs, strict=True):
        q.seeds = exact_seeds(q.text, names)
        if q.seeds:
            by_exact += 1
            continue
        hits = await store.search(USER, ["object"], vec, q.text, k=fallback)
        q.seeds = [h.id for h in hits]
    counts = [len(q.seeds) for q in questions]
    return {
        "exact_share": round(by_exact / len(questions), 3),
        "mean_seeds": round(statistics.mean(counts), 2),
    }


async def evaluate(retriever: Any, questions: list[Question], vecs: list[list[float]], budget: int) -> dict[str, Any]:
    whole: dict[str, list[bool]] = defaultdict(list)
    triples_hit = triples_all = 0
    sizes: list[int] = []
    started = time.perf_counter()
    for q, vec in zip(questions, vecs, strict=True):
        request = RetrievalRequest(user_id=USER, query=q.text, query_vector=vec, seeds=q.seeds, budget=budget)
        context = await retriever.retrieve(request)
        shown = {t.edge.id for t in context} | {t.end.id for t in context if t.edge.kind is EdgeKind.THESIS}
        hit = [rid in shown or tid in shown for rid, tid in q.chain]
        triples_hit += sum(hit)
        triples_all += len(hit)
        whole[q.type].append(all(hit))
        whole["all"].append(all(hit))
        sizes.append(len(context))
    elapsed = time.perf_counter() - started
    return {
        "whole_chain_recall": round(statistics.mean(whole["all"]), 4),
        "triple_recall": round(triples_hit / triples_all, 4),
        "mean_context": round(statistics.mean(sizes), 2),
        "ms_per_question": round(1000 * elapsed / len(questions), 2),
        "by_type": {k: round(statistics.mean(v), 4) for k, v in sorted(whole.items()) if k != "all"},
    }


def report(name: str, r: dict[str, Any]) -> None:
    types = " ".join(f"{k}={v:.3f}" for k, v in r["by_type"].items())
    print(
        f"{name:<14} chain={r['whole_chain_recall']:.3f} triples={r['triple_recall']:.3f} "
        f"ctx={r['mean_context']:.1f} {r['ms_per_question']:.1f} ms/q  {types}",
        file=sys.stderr,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--questions", type=Path, default=None, help="default: DATA_DIR/2wikimultihopqa/...dev600")
    parser.add_argument("--budget", type=int, default=20)
    parser.add_argument("--limit", type=int, default=None, help="first N questions only")
    parser.add_argument("--retrievers", default=DEFAULT_RETRIEVERS)
    parser.add_argument("--fallback-seeds", type=int, default=2, help="object hits used when no name matches")
    parser.add_argument("--store", type=Path, default=None, help="store directory (default: a temporary one)")
    args = parser.parse_args()
    configure_logging("WARNING", json=False)
    summary = asyncio.run(run(args))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
