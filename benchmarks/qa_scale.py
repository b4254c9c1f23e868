"""QA without the model at 10k to 1M triplets: the time the default (fast) QA engine spends per question on
everything but the LLM (entity matching, vector and keyword search, traversal, filtering, bookkeeping) as one
user's memory grows, on the embedded store (SQLite + sqlite-vec + FTS5).

The memory is generated: entities named "Entity <n>" with Zipf-like degrees, relation edges between them from 40
relation names, and for every tenth edge the message (episode) that said it and the thesis kept of it, linked as
memorize links them, and two other users holding a tenth as much each (so every
read filters by user). Vectors are synthetic: unit vectors around 1,000 random centres (embedding a million
texts with MiniLM takes hours on two cores); a question's vector is one of its edges' plus noise, so the nearest
neighbours are not arbitrary. The LLM is a zero-latency scripted reader and the embedder a zero-latency lookup,
so what is timed is what the engine does around them.

    python -m benchmarks.qa_scale --sizes 10000 100000 [1000000] [--questions 60]

Prints a table to stderr and a JSON summary as the last line of stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.qa_latency import percentile
from schemas.events import Query, StageEvent
from services import ids
from services.adapters.sqlite import SqliteMemoryStore
from services.container import build_engine
from services.domain import ChangeSet, Edge, EdgeKind, Vertex, VertexKind
from services.llm.scripted import ScriptedLLM, rule_answer_check, rule_search_plan
from services.ports import Embedder, VectorItem
from services.settings import Settings

DIM = 384
USER = "bench"
OTHERS = ("other-1", "other-2")
RELATIONS = [f"relation {n}" for n in range(40)]
T0 = datetime(2024, 1, 1, tzinfo=UTC)
BATCH = 20_000


class Vectors:
    """Unit vectors around fixed random centres; a text's vector is fixed by the text."""

    def __init__(self, seed: int = 7, centres: int = 1000) -> None:
        self.rng = np.random.default_rng(seed)
        self.centres = self._unit(self.rng.standard_normal((centres, DIM)).astype(np.float32))

    @staticmethod
    def _unit(m: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        return m / np.linalg.norm(m, axis=-1, keepdims=True)

    def near(self, n: int) -> np.ndarray[Any, Any]:
        which = self.rng.integers(0, len(self.centres), n)
        noise = self.rng.standard_normal((n, DIM)).astype(np.float32) * 0.05
        return self._unit(self.centres[which] + noise)


class LookupEmbedder(Embedder):
    """Zero-latency: the vector a question was given, else one near a random centre (embedding is model time)."""

    name = "lookup"
    dim = DIM

    def __init__(self, vectors: Vectors) -> None:
        self.vectors = vectors
        self.known: dict[str, list[float]] = {}

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        out = []
        for text in texts:
            if text not in self.known:
                self.known[text] = self.vectors.near(1)[0].tolist()
            out.append(self.known[text])
        return out


def entity(n: int) -> str:
    return f"Entity {n}"


async def generate(
    store: SqliteMemoryStore, user: str, triplets: int, vectors: Vectors, rng: np.random.Generator
) -> list[tuple[int, int, str, list[float]]]:
    """``triplets`` relation edges for ``user``; returns (subject, object, relation, vector) of a sample of them."""
    entities = max(100, triplets // 10)
    sample: list[tuple[int, int, str, list[float]]] = []
    made = 0
    seen_vertices: set[int] = set()
    while made < triplets:
        n = min(BATCH, triplets - made)
        subjects = np.minimum(rng.zipf(1.6, n) - 1, entities - 1)  # a few hubs, a long tail
        objects = rng.integers(0, entities, n)
        relations = rng.integers(0, len(RELATIONS), n)
        edge_vectors = vectors.near(n)
        vertices: dict[str, Vertex] = {}
        edges: list[Edge] = []
        items: list[VectorItem] = []
        for i in range(n):
            s, o, r = int(subjects[i]), int(objects[i]), RELATIONS[int(relations[i])]
            for e in (s, o):
                if e not in seen_vertices:
                    seen_vertices.add(e)
                    v = Vertex(id=ids.object_id(user, entity(e)), user_id=user, kind=VertexKind.OBJECT, name=entity(e))
                    vertices[v.id] = v
                    items.append(VectorItem(id=v.id, kind="object", text=v.name, vector=vectors.near(1)[0].tolist()))
            a, b = ids.object_id(user, entity(s)), ids.object_id(user, entity(o))
            edge_id = ids.edge_id(user, "relation", a, f"{r} {made + i}", b)
            text = f"{entity(s)} {r} {entity(o)}"
            edges.append(
                Edge(id=edge_id, user_id=user, kind=EdgeKind.RELATION, source=a, target=b, relation=r, t_valid=T0)
            )
            vector = edge_vectors[i].tolist()
            items.append(VectorItem(id=edge_id, kind="triplet", text=text, vector=vector))
            if i % 10 == 0:  # a message (episode) that said it, and the thesis memorize kept of it
                episode = Vertex(
                    id=f"ep_{edge_id}",
                    user_id=user,
                    kind=VertexKind.EPISODIC,
                    name=f"Ana: {text}, I think.",
                    t_valid=T0,
                )
                thesis = Vertex(id=f"th_{edge_id}", user_id=user, kind=VertexKind.THESIS, name=f"{text}.", t_valid=T0)
                vertices[episode.id], vertices[thesis.id] = episode, thesis
                items.append(VectorItem(id=thesis.id, kind="thesis", text=thesis.name, vector=vector))
                items.append(VectorItem(id=episode.id, kind="episodic", text=episode.name, vector=vector))
                links = [(EdgeKind.THESIS, end, thesis.id) for end in (a, b)]
                links += [(EdgeKind.EPISODIC, start, episode.id) for start in (a, b, thesis.id)]
                for kind, start, end in links:
                    link = ids.edge_id(user, kind.value, start, "states", end)
                    edges.append(Edge(id=link, user_id=user, kind=kind, source=start, target=end, relation="states"))
            if len(sample) < 500 and rng.random() < 0.01:
                sample.append((s, o, r, vector))
        change = ChangeSet(
            id=ids.change_set_id(user, [f"gen-{made}"]),
            user_id=user,
            event_ids=[f"gen-{made}"],
            vertices=list(vertices.values()),
            edges=edges,
        )
        await store.apply(change, items)
        made += n
    return sample


async def measure(size: int, questions: int, data_dir: Path) -> dict[str, Any]:
    vectors = Vectors()
    rng = np.random.default_rng(size)
    path = data_dir / f"scale-{size}.sqlite3"
    async with SqliteMemoryStore(path, DIM) as store:
        started = time.perf_counter()
        sample = await generate(store, USER, size, vectors, rng)
        for other in OTHERS:
            await generate(store, other, max(1000, size // 10), vectors, rng)
        build_s = time.perf_counter() - started
        embedder = LookupEmbedder(vectors)
        llm = ScriptedLLM({"answer_check": rule_answer_check, "search_plan": rule_search_plan})
        settings = Settings(_env_file=None, qa_engine="fast", qa_max_rounds=0)
        engine = build_engine(settings, store.stores(), embedder, llm)
        asked = [sample[i % len(sample)] for i in range(questions + 1)]
        timings: list[float] = []
        stage_ms: dict[str, list[float]] = {}

        async def emit(event: StageEvent) -> None:
            stage_ms.setdefault(event.stage_name, []).append(event.duration_ms)

        for n, (s, _o, r, vector) in enumerate(asked):
            question = f"What is the {r} of {entity(s)}?"
            embedder.known[question] = (np.asarray(vector) + vectors.near(1)[0] * 0.02).tolist()
            query = Query(event_id=f"q{size}-{n}", user_id=USER, event_time=datetime.now(UTC), question=question)
            begun = time.perf_counter()
            await engine.answer(query, emit if n else None)
            if n:  # the first warms the caches
                timings.append((time.perf_counter() - begun) * 1000)
    size_mb = store_mb(data_dir, size)
    return {
        "triplets": size,
        "build_s": round(build_s, 1),
        "store_mb": round(size_mb, 1),
        "questions": len(timings),
        "p50_ms": round(percentile(timings, 0.5), 1),
        "p95_ms": round(percentile(timings, 0.95), 1),
        "p99_ms": round(percentile(timings, 0.99), 1),
        "mean_ms": round(sum(timings) / len(timings), 1),
        "stage_p50_ms": {name: round(percentile(ms, 0.5), 1) for name, ms in stage_ms.items() if max(ms) > 0},
    }


def store_mb(data_dir: Path, size: int) -> float:
    return sum(p.stat().st_size for p in data_dir.glob(f"scale-{size}.sqlite3*")) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--questions", type=int, default=60)
    parser.add_argument("--data-dir", type=Path, help="default: a temporary folder, removed after")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = args.data_dir or Path(tmp)
        for size in args.sizes:
            result = asyncio.run(measure(size, args.questions, data_dir))
            results.append(result)
            sys.stderr.write(
                f"{size:>9,} triplets: built in {result['build_s']} s ({result['store_mb']} MB); non-LLM time per "
                f"question p50 {result['p50_ms']} ms, p95 {result['p95_ms']} ms, p99 {result['p99_ms']} ms; "
                f"stages (p50 ms) {result['stage_p50_ms']}\n"
            )
    print(json.dumps({"results": results}))


if __name__ == "__main__":
    main()
