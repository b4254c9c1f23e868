"""The embedded stores and the real stack side by side: same data, same machine, same run.

* ``store``: write latency per change set (one memorize step: 8 vertices, 7 edges, 15 vectors), dense and hybrid
  top-10 search over that user's vectors;
* ``traversal``: one hop (``neighbors``) for frontiers of 1, 10 and 100 vertices of a 2,000-object graph, and a
  3-hop walk from one seed (frontier capped at 100 per hop), i.e. time per hop;
* ``qa``: the PAI-2 pipeline on 2WikiMultihopQA with the zero-latency scripted reader (benchmarks/qa_latency.py);
* ``ingest``: messages/s through broker -> Faust worker -> store with the zero-latency rule-based LLM, as
  benchmarks/ingest.py: embedded Tansu + SQLite against Apache Kafka + Dgraph + Weaviate.

The embedder is the in-process MiniLM for both, so the differences are the broker's and the stores'.
Needs the real stack's addresses (``eval "$(scripts/stack up)"``):

    python -m benchmarks.real_stack [--sections store,traversal,qa,ingest] [--messages 300] [--qa-limit 30]

Prints a table to stderr and a JSON summary as the last line of stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, cast

import numpy as np
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from benchmarks import qa_latency
from benchmarks.ingest import load_messages, settings_for
from benchmarks.store_latency import _change_set
from memstream.runtime import Stack
from schemas.events import MemoryUpdate
from services import ids
from services.adapters.minilm import MiniLMEmbedder
from services.adapters.remote import RemoteMemoryStore
from services.adapters.sqlite import SqliteMemoryStore
from services.domain import ChangeSet, Edge, EdgeKind, Vertex, VertexKind
from services.llm.factory import build_embedder
from services.llm.scripted import ScriptedLLM
from services.qa.base import QAConfig
from services.qa.planning import PlanningQA
from services.retrieval.base import Retriever
from services.retrieval.registry import get_retriever
from services.settings import Settings
from streams.codec import encode
from streams.topics import TopicNames

DIM = 384
PREFIX = "MemstreamBench"
BACKENDS = ("embedded", "real")
DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def addresses() -> dict[str, str]:
    names = ("MEMSTREAM_BROKER", "MEMSTREAM_DGRAPH", "MEMSTREAM_WEAVIATE_HTTP", "MEMSTREAM_WEAVIATE_GRPC")
    missing = [n for n in names if not os.environ.get(n)]
    if missing:
        raise SystemExit(f'{", ".join(missing)} not set: run eval "$(scripts/stack up)" first')
    return {n: os.environ[n] for n in names}


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50_ms": round(statistics.median(ordered) * 1000, 2),
        "p95_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.95))] * 1000, 2),
        "n": len(ordered),
    }


async def timed(samples: list[float], call: Awaitable[Any]) -> Any:
    started = time.perf_counter()
    result = await call
    samples.append(time.perf_counter() - started)
    return result


@asynccontextmanager
async def open_store(
    backend: str, users: list[str], dim: int = DIM, prefix: str = PREFIX
) -> AsyncIterator[SqliteMemoryStore | RemoteMemoryStore]:
    """A fresh store: a new SQLite file, or the real servers with these users forgotten first."""
    if backend == "embedded":
        with tempfile.TemporaryDirectory() as tmp:
            async with await SqliteMemoryStore.open(Path(tmp) / "bench.sqlite3", dim=dim) as store:
                yield store
        return
    env = addresses()
    remote = await RemoteMemoryStore.open(
        env["MEMSTREAM_DGRAPH"], env["MEMSTREAM_WEAVIATE_HTTP"], env["MEMSTREAM_WEAVIATE_GRPC"], dim, prefix=prefix
    )
    try:
        for user in users:
            await remote.delete_user(user)
        yield remote
        for user in users:
            await remote.delete_user(user)
    finally:
        await remote.close()


# -- store ----------------------------------------------------------------------------------------------------------


async def bench_store(backend: str, change_sets: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    user = "bench-store"
    async with open_store(backend, [user]) as store:
        writes: list[float] = []
        for i in range(change_sets):
            cs, items = _change_set(user, f"e{i}", rng)
            await timed(writes, store.apply(cs, items))
        query = rng.normal(size=DIM)
        query = (query / np.linalg.norm(query)).tolist()
        dense: list[float] = []
        hybrid: list[float] = []
        for i in range(50):
            await timed(dense, store.search(user, ["object", "thesis"], query, k=10))
            await timed(hybrid, store.search(user, ["object", "thesis"], query, f"fact e{i}", k=10))
    return {
        "apply_change_set": summary(writes),
        f"dense_top10_of_{change_sets * 15}": summary(dense),
        "hybrid_top10": summary(hybrid),
    }


# -- traversal ------------------------------------------------------------------------------------------------------


def random_graph(user: str, objects: int, out_degree: int) -> list[ChangeSet]:
    """``objects`` objects, each with ``out_degree`` relation edges to random others, in change sets of 200."""
    rnd = random.Random(0)
    vertices = [
        Vertex(id=ids.object_id(user, f"entity {n}"), user_id=user, kind=VertexKind.OBJECT, name=f"entity {n}")
        for n in range(objects)
    ]
    out = []
    for start in range(0, objects, 200):
        chunk = vertices[start : start + 200]
        edges = []
        for v in chunk:
            for target in rnd.sample(vertices, out_degree):
                relation = f"rel{rnd.randrange(20)}"
                eid = ids.edge_id(user, "relation", v.id, relation, target.id)
                edges.append(
                    Edge(id=eid, user_id=user, kind=EdgeKind.RELATION, source=v.id, target=target.id, relation=relation)
                )
        event = f"graph-{start}"
        out.append(ChangeSet(id=f"c-{event}", user_id=user, event_ids=[event], vertices=chunk, edges=edges))
    return out


async def bench_traversal(backend: str, objects: int) -> dict[str, Any]:
    user = "bench-graph"
    graph = random_graph(user, objects, out_degree=3)
    all_ids = [v.id for cs in graph for v in cs.vertices]
    rnd = random.Random(1)
    async with open_store(backend, [user]) as store:
        build = time.perf_counter()
        for cs in graph:
            await store.apply(cs, [])
        result: dict[str, Any] = {"graph": {"objects": objects, "edges": objects * 3}}
        result["graph"]["build_s"] = round(time.perf_counter() - build, 2)
        for size in (1, 10, 100):
            hops: list[float] = []
            for _ in range(30):
                await timed(hops, store.neighbors(user, rnd.sample(all_ids, size)))
            result[f"hop_frontier_{size}"] = summary(hops)
        walk: list[float] = []
        reached: list[int] = []
        for _ in range(20):
            frontier, seen = [rnd.choice(all_ids)], set[str]()
            for _hop in range(3):
                triplets = await timed(walk, store.neighbors(user, frontier))
                seen.update(frontier)
                nxt = {end for t in triplets for end in (t.start.id, t.end.id)} - seen
                frontier = sorted(nxt)[:100]
            reached.append(len(seen))
        result["walk_3_hops_per_hop"] = summary(walk)
        result["walk_vertices_visited_mean"] = round(statistics.fmean(reached), 1)
    return result


# -- qa -------------------------------------------------------------------------------------------------------------


async def bench_qa(backend: str, limit: int) -> dict[str, Any]:
    questions = json.loads(qa_latency.DEFAULT_QUESTIONS.read_text())[:limit]
    embedder = MiniLMEmbedder()
    async with open_store(backend, [qa_latency.USER]) as store:
        build = time.perf_counter()
        # build_graph is typed for the embedded store; it only calls the graph, vector and writer ports
        vertices = await qa_latency.build_graph(cast(Any, store), embedder, questions)
        build_s = time.perf_counter() - build
        names = [v for q in questions for t in q["evidence"] for v in (t[0], t[2])]
        llm = ScriptedLLM(qa_latency.Reader(questions, names).responders())
        cache: dict[str, Retriever] = {}

        def retrievers(name: str) -> Retriever:
            return cache.setdefault(name, get_retriever(name, store, store, embedder))

        qa = PlanningQA(store, store, embedder, llm, retrievers, QAConfig(retriever="beamsearch"))
        await qa.answer(qa_latency._query(questions[0]["question"], "warmup"))
        latencies = []
        for i, q in enumerate(questions):
            answer = await qa.answer(qa_latency._query(q["question"], f"q{i}"))
            latencies.append(answer.duration_ms / 1000)
    return {"questions": len(questions), "graph_vertices": vertices, "build_s": round(build_s, 2), **summary(latencies)}


# -- ingest ---------------------------------------------------------------------------------------------------------


async def bench_ingest(
    backend: str, messages: int, users: int, workers: int = 1, embedder: str = "minilm"
) -> dict[str, Any]:
    batch = load_messages(DATA, messages, users)
    run = uuid.uuid4().hex[:8]
    overrides: dict[str, Any] = {"batch_wait_s": 0.2, "topic_prefix": f"bench-{run}", "consumer_group": f"bench-{run}"}
    overrides["broker"] = None  # embedded: `up` starts Tansu (and MEMSTREAM_BROKER in the environment must not win)
    overrides["embedder"] = embedder
    # a collection holds one embedder's vectors: each embedder its own prefix
    prefix = PREFIX if embedder == "minilm" else f"{PREFIX}{embedder.title()}"
    if backend == "real":
        env = addresses()
        overrides |= {
            "broker": env["MEMSTREAM_BROKER"],
            "store": "remote",
            "dgraph": env["MEMSTREAM_DGRAPH"],
            "weaviate_http": env["MEMSTREAM_WEAVIATE_HTTP"],
            "weaviate_grpc": env["MEMSTREAM_WEAVIATE_GRPC"],
            "weaviate_prefix": prefix,
        }
        dim = build_embedder(Settings(_env_file=None, embedder=embedder)).dim  # type: ignore[call-arg]
        async with open_store("real", sorted({m.user_id for m in batch}), dim, prefix):
            pass  # forget the users a previous run left
    with tempfile.TemporaryDirectory() as tmp:
        settings = settings_for(Path(tmp), **overrides)
        # the workers' embedder loaded (a static table distilled into this data dir) before the clock starts
        await build_embedder(settings).embed(["warm up"])
        stack = Stack(settings, settings.host, settings.port, workers=workers, startup_timeout_s=120)
        await stack.start()
        try:
            topics = TopicNames.from_settings(settings)
            producer = AIOKafkaProducer(bootstrap_servers=stack.bootstrap, acks="all", linger_ms=5)
            consumer = AIOKafkaConsumer(
                topics.memory_updates, bootstrap_servers=stack.bootstrap, auto_offset_reset="earliest"
            )
            await producer.start()
            await consumer.start()
            try:
                started = time.perf_counter()
                for m in batch:
                    await producer.send(topics.chat, encode(m), key=m.user_id.encode())
                await producer.flush()
                wanted, done = {m.event_id for m in batch}, set[str]()
                applied: dict[str, list[str]] = {}  # per user, event ids in the order their updates came
                deadline = time.monotonic() + max(300.0, messages * 1.0)
                while not wanted <= done:
                    stack.check_children()
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{len(done & wanted)}/{len(wanted)} memorized before the deadline")
                    for records in (await consumer.getmany(timeout_ms=500)).values():
                        for record in records:
                            update = MemoryUpdate.model_validate_json(record.value or b"")
                            fresh = [e for e in update.source_event_ids if e not in done]
                            applied.setdefault(update.user_id, []).extend(fresh)
                            done.update(fresh)
                elapsed = time.perf_counter() - started
            finally:
                await producer.stop()
                await consumer.stop()
        finally:
            await asyncio.to_thread(stack.stop)
    sent: dict[str, list[str]] = {}
    for m in batch:
        sent.setdefault(m.user_id, []).append(m.event_id)
    return {
        "workers": workers,
        "embedder": embedder,
        "messages": len(batch),
        "seconds": round(elapsed, 2),
        "messages_per_s": round(len(batch) / elapsed, 2),
        # every user's messages memorized in the order they were sent (one partition per user, one worker at a time)
        "per_user_order_held": all(applied.get(u) == ids for u, ids in sent.items()),
    }


# -- main -----------------------------------------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> dict[str, Any]:
    sections: dict[str, Callable[[str], Awaitable[dict[str, Any]]]] = {
        "store": lambda b: bench_store(b, args.change_sets),
        "traversal": lambda b: bench_traversal(b, args.objects),
        "qa": lambda b: bench_qa(b, args.qa_limit),
        "ingest": lambda b: bench_ingest(b, args.messages, args.users, args.workers, args.embedder),
    }
    out: dict[str, Any] = {"benchmark": "real_stack", "load_average_start": os.getloadavg()[0]}
    for name in args.sections.split(","):
        out[name] = {backend: await sections[name](backend) for backend in BACKENDS}
        sys.stderr.write(f"{name}: {json.dumps(out[name])}\n")
    out["load_average_end"] = os.getloadavg()[0]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default="store,traversal,qa,ingest")
    parser.add_argument("--change-sets", type=int, default=60)
    parser.add_argument("--objects", type=int, default=2000)
    parser.add_argument("--qa-limit", type=int, default=30)
    parser.add_argument("--messages", type=int, default=300)
    parser.add_argument("--users", type=int, default=10)
    parser.add_argument("--workers", type=int, default=1, help="ingest: Faust workers in the one consumer group")
    parser.add_argument(
        "--embedder", choices=["minilm", "static"], default="minilm", help="ingest: the workers' embedder"
    )
    args = parser.parse_args()
    addresses()
    sys.stdout.write(json.dumps(asyncio.run(run(args))) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
