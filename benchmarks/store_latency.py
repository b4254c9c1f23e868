"""Embedded store latency: apply one memorize-sized change set; dense and hybrid top-10 among many users.

Usage: python benchmarks/store_latency.py [--users 20] [--per-user 5000]. Prints a JSON summary as its last line.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from services import ids
from services.adapters.sqlite import SqliteMemoryStore
from services.domain import ChangeSet, Edge, EdgeKind, Vertex, VertexKind
from services.ports import VectorItem

DIM = 384


def _unit(rng: np.random.Generator, n: int) -> list[list[float]]:
    m = rng.normal(size=(n, DIM))
    m /= np.linalg.norm(m, axis=1, keepdims=True)
    return m.tolist()  # type: ignore[no-any-return]


def _change_set(user: str, event: str, rng: np.random.Generator) -> tuple[ChangeSet, list[VectorItem]]:
    """6 objects in a chain, a thesis, an episode (8 vertices, 7 edges, 15 vectors): one memorize step."""
    objects = [
        Vertex(id=ids.object_id(user, f"{event} e{i}"), user_id=user, kind=VertexKind.OBJECT, name=f"{event} e{i}")
        for i in range(6)
    ]
    thesis = Vertex(id=ids.thesis_id(user, event), user_id=user, kind=VertexKind.THESIS, name=f"fact {event}")
    episode = Vertex(id=ids.episode_id(user, event), user_id=user, kind=VertexKind.EPISODIC, name=f"said {event}")
    edges = [
        Edge(id=ids.edge_id(user, "relation", a.id, "next", b.id), user_id=user, kind=EdgeKind.RELATION,
             source=a.id, target=b.id, relation="next")
        for a, b in itertools.pairwise(objects)
    ]  # fmt: skip
    edges.append(
        Edge(id=ids.edge_id(user, "thesis", objects[0].id, "thesis", thesis.id), user_id=user, kind=EdgeKind.THESIS,
             source=objects[0].id, target=thesis.id, relation="thesis")
    )  # fmt: skip
    vertices = [*objects, thesis, episode]
    vecs = _unit(rng, len(vertices) + len(edges))
    items = [
        VectorItem(id=v.id, kind=v.kind.value, text=v.name, vector=x) for v, x in zip(vertices, vecs, strict=False)
    ]
    items += [
        VectorItem(id=e.id, kind="triplet", text=e.relation, vector=x)
        for e, x in zip(edges, vecs[len(vertices) :], strict=True)
    ]
    cs = ChangeSet(id=ids.change_set_id(user, [event]), user_id=user, event_ids=[event], vertices=vertices, edges=edges)
    return cs, items


def _summary(samples: list[float]) -> dict[str, float]:
    samples = sorted(samples)
    return {
        "p50_ms": round(statistics.median(samples) * 1000, 2),
        "p95_ms": round(samples[int(len(samples) * 0.95)] * 1000, 2),
    }


async def main(users: int, per_user: int) -> dict[str, object]:
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        async with await SqliteMemoryStore.open(Path(tmp) / "bench.sqlite3", dim=DIM) as store:
            apply_times = []
            for i in range(100):
                cs, items = _change_set("apply-user", f"e{i}", rng)
                started = time.perf_counter()
                await store.apply(cs, items)
                apply_times.append(time.perf_counter() - started)
            for u in range(users):
                for batch in range(0, per_user, 1000):
                    n = min(1000, per_user - batch)
                    items = [
                        VectorItem(id=f"x{u}-{batch + j}", kind="thesis", text=f"fact {j}", vector=v)
                        for j, v in enumerate(_unit(rng, n))
                    ]
                    await store.apply(ChangeSet(id=f"c{u}-{batch}", user_id=f"u{u}", event_ids=[f"b{batch}"]), items)
            query = _unit(rng, 1)[0]
            dense, hybrid = [], []
            for _ in range(100):
                started = time.perf_counter()
                await store.search("u3", ["thesis"], query, k=10)
                dense.append(time.perf_counter() - started)
            for j in range(50):
                started = time.perf_counter()
                await store.search("u3", ["thesis"], query, f"fact {j}", k=10)
                hybrid.append(time.perf_counter() - started)
    return {
        "apply_change_set_15_vectors": _summary(apply_times),
        f"dense_top10_{per_user}_of_{users * per_user}": _summary(dense),
        "hybrid_top10": _summary(hybrid),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--users", type=int, default=20)
    parser.add_argument("--per-user", type=int, default=5000)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(main(args.users, args.per_user))))
