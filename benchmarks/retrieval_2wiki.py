"""Retrieval benchmark on 2WikiMultihopQA (no LLM): does the retrieved context hold a question's whole gold chain?

Two graphs, both one user's, both built from ``questions_dev600.json`` (and ``corpus.json`` beside it):

* **gold graph (diagnostic)**: only the gold evidence triples of all the questions: an object vertex per subject and
  object, a relation edge per triple, a thesis per triple ("subject relation object") linked to both objects. The
  median seed has one or two triplets, so a seed's neighbourhood is little more than its chain: this graph measures
  how the graph was built more than how a retriever ranks. Kept as a diagnostic, never as memory quality.
* **realistic graph**: the gold graph plus every paragraph of the corpus (the 2Wiki passages of all 600 questions,
  answers' and distractors' alike) as an episodic vertex, linked to an object vertex for its title and to every
  object vertex whose name occurs in its text as whole words, as memorize links an episode to the objects it
  mentions. These distractors give the gold objects a realistic degree (hubs such as nationalities and countries
  included). They are NOT what memstream's model would extract from the corpus: the triples are still the gold ones
  (no LLM runs here), the links are name occurrences, and the paragraphs are read whole. Episodes are walked and
  shown (``context_kinds`` includes episodic; flat searches them too), so they compete for the budget.

Seeds are the system's own LLM-free matching, the evaluation harness's: ``EntityMatcher.question_seeds`` (the
question's capitalised names through exact-name and fused dense + BM25 object search, else the whole question);
nothing of the gold data. A gold triple counts as retrieved when its relation edge or its thesis is in the context
("chain"), or, on the realistic graph, also when a paragraph titled by its subject that names its object is
("chain+para"); a question counts when all its triples do. Every table has the breadth-first baseline (``bfs``: no
scoring, depth 2, same budget) beside the walks; alias bridging is measured off (the default) and on
(``--aliases 2``), and ``--old-stopwords NAMES`` adds back the ordinal words once in the production stop list.

    python -m benchmarks.retrieval_2wiki --budget 20 [--limit 100] [--retrievers beamsearch,flat] \
        [--graphs gold,realistic] [--aliases 0,2] [--old-stopwords watercircles] [--vectors /tmp/2wiki-vectors.npz]

Prints tables to stderr and a JSON summary as the last line of stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from services.adapters.minilm import MiniLMEmbedder
from services.adapters.sqlite import SqliteMemoryStore
from services.domain import ChangeSet, Edge, EdgeKind, Vertex, VertexKind
from services.ids import edge_id, normalize_text, object_id, thesis_id
from services.logging import configure_logging
from services.ports import VectorItem
from services.qa.matching import EntityMatcher
from services.retrieval import common
from services.retrieval.base import RetrievalRequest
from services.retrieval.registry import RETRIEVERS, get_retriever

USER = "bench-2wiki"
DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
DEFAULT_RETRIEVERS = "bfs,beamsearch,watercircles,astar,tog2,flat,mixture"
# The ordinal words the stop list held while it was tuned on 2Wiki ("who was born first"); measured, not used.
OLD_2WIKI_STOPWORDS = frozenset({"first", "older", "younger", "later", "earlier"})
MAX_NAME_WORDS = 12
_WORD = re.compile(r"\w+")


@dataclass
class Question:
    id: str
    type: str
    text: str
    chain: list[tuple[str, str]]  # per gold triple: (relation edge id, thesis id)
    ends: list[tuple[str, str]]  # per gold triple: (subject, object) names
    paragraphs: list[set[str]] = field(default_factory=list)  # per gold triple: episodes stating it
    seeds: list[str] = field(default_factory=list)


@dataclass
class Graph:
    label: str
    vertices: dict[str, Vertex] = field(default_factory=dict)
    edges: dict[str, Edge] = field(default_factory=dict)
    texts: dict[str, tuple[str, str]] = field(default_factory=dict)  # id -> (index kind, text)
    kinds: frozenset[VertexKind] = frozenset({VertexKind.OBJECT, VertexKind.THESIS})

    def obj(self, name: str) -> str:
        vid = object_id(USER, name)
        if vid not in self.vertices:
            self.vertices[vid] = Vertex(id=vid, user_id=USER, kind=VertexKind.OBJECT, name=name)
            self.texts[vid] = ("object", name)
        return vid

    def link(self, kind: EdgeKind, source: str, relation: str, target: str) -> str:
        eid = edge_id(USER, kind.value, source, relation, target)
        if eid not in self.edges:
            self.edges[eid] = Edge(id=eid, user_id=USER, kind=kind, source=source, target=target, relation=relation)
        return eid

    def change(self) -> ChangeSet:
        return ChangeSet(
            id=f"c_2wiki_{self.label}",
            user_id=USER,
            event_ids=[f"2wiki-{self.label}"],
            vertices=list(self.vertices.values()),
            edges=list(self.edges.values()),
        )

    def degrees(self) -> Counter[str]:
        """Triplets per vertex over the edges a walk follows here (episodic ones only when episodes are shown)."""
        walked = {EdgeKind.RELATION, EdgeKind.THESIS} | (
            {EdgeKind.EPISODIC} if VertexKind.EPISODIC in self.kinds else set()
        )
        out: Counter[str] = Counter()
        for e in self.edges.values():
            if e.kind in walked:
                out[e.source] += 1
                out[e.target] += 1
        return out


def load(path: Path, limit: int | None = None) -> list[dict[str, Any]]:
    data: list[dict[str, Any]] = json.loads(path.read_text(encoding="utf-8"))
    return data[:limit] if limit else data


def gold_graph(records: list[dict[str, Any]]) -> tuple[Graph, list[Question]]:
    g = Graph("gold")
    questions = []
    for rec in records:
        chain: dict[tuple[str, str], tuple[str, str]] = {}
        for subject, relation, obj in rec["evidence"]:
            s, o = g.obj(subject), g.obj(obj)
            statement = f"{subject} {relation} {obj}"
            rid = g.link(EdgeKind.RELATION, s, relation, o)
            g.texts[rid] = ("triplet", statement)
            tid = thesis_id(USER, statement)
            if tid not in g.vertices:
                g.vertices[tid] = Vertex(id=tid, user_id=USER, kind=VertexKind.THESIS, name=statement)
                g.texts[tid] = ("thesis", statement)
                for end in dict.fromkeys((s, o)):
                    g.link(EdgeKind.THESIS, end, "thesis", tid)
            chain[rid, tid] = (subject, obj)
        paragraphs: list[set[str]] = [set() for _ in chain]
        questions.append(
            Question(rec["id"], rec["question_type"], rec["question"], list(chain), list(chain.values()), paragraphs)
        )
    return g, questions


def words(text: str) -> tuple[str, ...]:
    return tuple(_WORD.findall(normalize_text(text)))


def realistic_graph(records: list[dict[str, Any]], corpus: list[dict[str, str]]) -> tuple[Graph, list[Question]]:
    """The gold graph plus the corpus paragraphs as episodes linked to their title and the objects they name."""
    g, questions = gold_graph(records)
    g.label, g.kinds = "realistic", frozenset(VertexKind)
    titles = [g.obj(p["title"]) for p in corpus]
    names: dict[tuple[str, ...], str] = {}
    for v in g.vertices.values():
        key = words(v.name) if v.kind is VertexKind.OBJECT else ()
        # a one-letter or stop-word "name" would link nearly every paragraph: not a mention
        if (
            key
            and len(key) <= MAX_NAME_WORDS
            and not (len(key) == 1 and (len(key[0]) < 2 or key[0] in common.STOPWORDS))
        ):
            names[key] = v.id
    by_title: dict[str, list[tuple[str, str]]] = defaultdict(list)  # title object -> (episode, its text's words)
    for i, (p, title) in enumerate(zip(corpus, titles, strict=True)):
        eid = f"para-{i}"
        text = f"{p['title']}: {p['text']}"
        g.vertices[eid] = Vertex(id=eid, user_id=USER, kind=VertexKind.EPISODIC, name=text)
        g.texts[eid] = ("episodic", text)
        found = words(p["text"])
        mentioned = {title}
        for a in range(len(found)):
            for b in range(a + 1, min(len(found), a + MAX_NAME_WORDS) + 1):
                if (vid := names.get(found[a:b])) is not None:
                    mentioned.add(vid)
        for vid in sorted(mentioned):
            g.link(EdgeKind.EPISODIC, vid, "episodic", eid)
        by_title[title].append((eid, " ".join(found)))
    for q in questions:
        for i, (subject, obj) in enumerate(q.ends):
            want = f" {' '.join(words(obj))} "
            q.paragraphs[i] = {e for e, text in by_title.get(object_id(USER, subject), []) if want in f" {text} "}
    return g, questions


def read_cache(cache: Path | None) -> dict[str, list[float]]:
    if cache is None or not cache.exists():
        return {}
    with np.load(cache) as data:
        return dict(zip(data["ids"].tolist(), data["vectors"].tolist(), strict=True))


async def embed_all(embedder: MiniLMEmbedder, texts: dict[str, str], cache: Path | None) -> dict[str, list[float]]:
    """Vectors by id; with ``cache``, those embedded before are read from it and the new ones added to it."""
    known = read_cache(cache)
    missing = [i for i in texts if i not in known]
    if missing:
        for i, v in zip(missing, await embedder.embed([texts[i] for i in missing]), strict=True):
            known[i] = list(v)
        if cache is not None:
            np.savez(cache, ids=np.array(list(known)), vectors=np.array(list(known.values()), dtype=np.float32))
    return {i: known[i] for i in texts}


@contextlib.contextmanager
def stopwords(extra: frozenset[str]) -> Iterator[None]:
    """The production stop list plus ``extra`` for the duration (``tokens`` reads the module's list per call)."""
    saved = common.STOPWORDS
    common.STOPWORDS = saved | extra
    try:
        yield
    finally:
        common.STOPWORDS = saved


def uses_aliases(name: str) -> bool:
    members = ["beamsearch", "watercircles"] if name == "mixture" else name.split("+")
    return any("aliases" in RETRIEVERS[m][0].params_model.model_fields for m in members)


async def run_graph(
    args: argparse.Namespace, g: Graph, questions: list[Question], vectors: dict[str, list[float]], embedder: Any
) -> dict[str, Any]:
    items = [VectorItem(id=i, kind=kind, text=text, vector=vectors[i]) for i, (kind, text) in g.texts.items()]
    questions = questions[: args.eval_limit] if args.eval_limit else questions
    with tempfile.TemporaryDirectory() as tmp:
        store = await SqliteMemoryStore.open(Path(tmp) / "bench.sqlite3", dim=embedder.dim)
        try:
            await store.apply(g.change(), items)
            matcher = EntityMatcher(store, store, embedder)
            for q in questions:
                q.seeds = await matcher.question_seeds(USER, q.text)
            question_vecs = [vectors["q:" + q.id] for q in questions]
            degree = g.degrees()
            seed_degrees = [degree[s] for q in questions for s in q.seeds]
            summary: dict[str, Any] = {
                "vertices": dict(Counter(v.kind.value for v in g.vertices.values())),
                "edges": dict(Counter(e.kind.value for e in g.edges.values())),
                "seeds": {
                    "mean_per_question": round(statistics.mean(len(q.seeds) for q in questions), 2),
                    "degree_median": statistics.median(seed_degrees) if seed_degrees else 0,
                    "degree_p90": float(np.percentile(seed_degrees, 90)) if seed_degrees else 0,
                    "gold_seeded": round(statistics.mean(bool(set(q.seeds) & gold_ends(g, q)) for q in questions), 3),
                },
                "runs": {},
            }
            print(f"\n{g.label} graph: {summary}", file=sys.stderr)
            for name in args.retrievers.split(","):
                retriever = get_retriever(name, store, store, embedder)
                variants = [(a, False) for a in args.aliases if not a or uses_aliases(name)]
                variants += [(0, True)] if name in args.old_stopwords else []
                for aliases, old in variants:
                    label = f"{name} aliases={aliases}" + (" +2wiki stopwords" if old else "")
                    with stopwords(OLD_2WIKI_STOPWORDS if old else frozenset()):
                        result = await evaluate(retriever, g, questions, question_vecs, args.budget, aliases)
                    summary["runs"][label] = result
                    report(label, result)
        finally:
            await store.close()
    return summary


def gold_ends(g: Graph, q: Question) -> set[str]:
    return {end for rid, _ in q.chain for end in (g.edges[rid].source, g.edges[rid].target)}


async def evaluate(
    retriever: Any, g: Graph, questions: list[Question], vecs: list[list[float]], budget: int, aliases: int
) -> dict[str, Any]:
    whole: dict[str, list[bool]] = defaultdict(list)
    with_paragraphs: list[bool] = []
    triples_hit = triples_all = 0
    sizes: list[int] = []
    # flat searches the episodes too when they are shown; the walks take the alias setting (others ignore both)
    params = {"aliases": aliases, "kinds": sorted({"triplet", "thesis"} | {k.value for k in g.kinds} - {"object"})}
    started = time.perf_counter()
    for q, vec in zip(questions, vecs, strict=True):
        request = RetrievalRequest(
            user_id=USER,
            query=q.text,
            query_vector=vec,
            seeds=q.seeds,
            budget=budget,
            context_kinds=g.kinds,
            params=params,
        )
        context = await retriever.retrieve(request)
        shown = {t.edge.id for t in context} | {t.end.id for t in context if t.edge.kind is not EdgeKind.RELATION}
        hit = [rid in shown or tid in shown for rid, tid in q.chain]
        triples_hit += sum(hit)
        triples_all += len(hit)
        whole[q.type].append(all(hit))
        whole["all"].append(all(hit))
        with_paragraphs.append(all(h or bool(p & shown) for h, p in zip(hit, q.paragraphs, strict=True)))
        sizes.append(len(context))
    elapsed = time.perf_counter() - started
    return {
        "whole_chain_recall": round(statistics.mean(whole["all"]), 4),
        "triple_recall": round(triples_hit / triples_all, 4),
        "whole_chain_with_paragraphs": round(statistics.mean(with_paragraphs), 4),
        "mean_context": round(statistics.mean(sizes), 2),
        "ms_per_question": round(1000 * elapsed / len(questions), 2),
        "by_type": {k: round(statistics.mean(v), 4) for k, v in sorted(whole.items()) if k != "all"},
    }


def report(label: str, r: dict[str, Any]) -> None:
    print(
        f"{label:<40} chain={r['whole_chain_recall']:.3f} triples={r['triple_recall']:.3f} "
        f"chain+para={r['whole_chain_with_paragraphs']:.3f} ctx={r['mean_context']:.1f} "
        f"{r['ms_per_question']:.1f} ms/q",
        file=sys.stderr,
    )


async def run(args: argparse.Namespace) -> dict[str, Any]:
    base = args.data_dir / "2wikimultihopqa"
    records = load(args.questions or base / "questions_dev600.json", args.limit)
    graphs = []
    for label in args.graphs.split(","):
        if label == "gold":
            graphs.append(gold_graph(records))
        else:
            graphs.append(realistic_graph(records, load(base / "corpus.json", args.corpus_limit)))
    texts = {i: text for g, _ in graphs for i, (_, text) in g.texts.items()}
    texts |= {"q:" + r["id"]: r["question"] for r in records}
    embedder = MiniLMEmbedder()
    started = time.perf_counter()
    vectors = await embed_all(embedder, texts, args.vectors)
    embed_s = time.perf_counter() - started
    print(f"embedded {len(texts)} texts in {embed_s:.0f} s", file=sys.stderr)
    return {
        "benchmark": "retrieval_2wiki",
        "questions": len(records),
        "evaluated": min(len(records), args.eval_limit or len(records)),
        "budget": args.budget,
        "graphs": {g.label: await run_graph(args, g, qs, vectors, embedder) for g, qs in graphs},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--questions", type=Path, default=None, help="default: DATA_DIR/2wikimultihopqa/...dev600")
    parser.add_argument("--budget", type=int, default=20)
    parser.add_argument("--limit", type=int, default=None, help="first N questions only")
    parser.add_argument("--eval-limit", type=int, default=None, help="evaluate the first N (the graph has all)")
    parser.add_argument("--corpus-limit", type=int, default=None, help="first N corpus paragraphs only")
    parser.add_argument("--retrievers", default=DEFAULT_RETRIEVERS)
    parser.add_argument("--graphs", default="gold,realistic")
    parser.add_argument("--aliases", default="0,2", type=lambda s: [int(x) for x in s.split(",")])
    # with aliases off the stop list is read only by WaterCircles' lexical boost (and a mixture holding it)
    parser.add_argument(
        "--old-stopwords",
        default="",
        type=lambda s: set(s.split(",")) - {""},
        help="retrievers also measured with 2Wiki's ordinal stop words, e.g. watercircles",
    )
    parser.add_argument("--vectors", type=Path, default=None, help="an .npz cache of the embeddings")
    args = parser.parse_args()
    configure_logging("WARNING", json=False)
    summary = asyncio.run(run(args))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
