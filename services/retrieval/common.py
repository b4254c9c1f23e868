"""Shared machinery for graph retrievers: per-request scope, filtering, batched scoring, ranking output.

Every retriever sees the memory only through ``GraphStore``/``VectorStore`` calls made by a ``Scope``, which binds
them to ``request.user_id`` and drops anything that does not belong to that user (a defence in depth: the stores
already scope every call), anything not valid at ``request.as_of`` and, in the output, any triplet touching a vertex
kind the request did not ask for.
"""

from __future__ import annotations

import asyncio
import re
import time
from abc import abstractmethod
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

import numpy as np
from prometheus_client import Histogram
from pydantic import BaseModel, ConfigDict, Field

from services.domain import EdgeKind, Triplet, Vertex, VertexKind
from services.ids import normalize_text
from services.logging import get_logger
from services.metrics import RETRIEVAL_SIZE
from services.ports import Embedder, GraphStore, VectorStore
from services.retrieval.base import RetrievalRequest, Retriever

log = get_logger(__name__)

RETRIEVAL_LATENCY = Histogram(
    "memstream_retrieval_seconds",
    "Retriever latency per call",
    ["retriever"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)

MIN_SIM = 1e-6
_TOKEN = re.compile(r"\w+", re.UNICODE)
# Small English stop list: lexical boosts must not fire on function words.
STOPWORDS = frozenset(
    {
        "a",
        "an",
        "and",
        "are",
        "as",
        "at",
        "be",
        "been",
        "by",
        "did",
        "do",
        "does",
        "for",
        "from",
        "had",
        "has",
        "have",
        "he",
        "her",
        "his",
        "how",
        "i",
        "in",
        "is",
        "it",
        "its",
        "me",
        "my",
        "of",
        "on",
        "or",
        "our",
        "she",
        "that",
        "the",
        "their",
        "them",
        "they",
        "this",
        "to",
        "was",
        "were",
        "what",
        "when",
        "where",
        "which",
        "who",
        "whom",
        "whose",
        "why",
        "will",
        "with",
        "you",
        "your",
        "than",
        "then",
        "there",
        "these",
        "those",
        "both",
        "either",
        "same",
        "more",
        "most",
    }
)


def tokens(text: str) -> set[str]:
    """Content words of a text (casefolded, stop words and 1-letter tokens dropped)."""
    return {t for t in _TOKEN.findall(text.casefold()) if len(t) > 1 and t not in STOPWORDS}


_MONTHS = frozenset(
    [
        "january",
        "february",
        "march",
        "april",
        "may",
        "june",
        "july",
        "august",
        "september",
        "october",
        "november",
        "december",
        "jan",
        "feb",
        "mar",
        "apr",
        "jun",
        "jul",
        "aug",
        "sep",
        "sept",
        "oct",
        "nov",
        "dec",
    ]
)


def _numbers(words: set[str]) -> set[str]:
    return {w for w in words if w.isdigit()}


def is_literal(name: str) -> bool:
    """A value rather than an entity (a number, a date): it has no aliases, only near-miss values."""
    words = _TOKEN.findall(name.casefold())
    return bool(words) and all(w.isdigit() or w in _MONTHS for w in words)


def vector_key(triplet: Triplet) -> str:
    """The id whose stored vector represents this triplet: relation edges are indexed by edge id (kind
    "triplet"); thesis and episodic triplets read as their end vertex, so they use that vertex's vector."""
    return triplet.edge.id if triplet.edge.kind is EdgeKind.RELATION else triplet.end.id


def other_end(triplet: Triplet, vertex_id: str) -> Vertex:
    return triplet.end if triplet.start.id == vertex_id else triplet.start


def unit(vec: Sequence[float] | np.ndarray) -> np.ndarray:
    arr = np.asarray(vec, dtype=np.float32)
    norm = float(np.linalg.norm(arr))
    return arr / norm if norm > 0 else arr


class Params(BaseModel):
    """Retriever knobs. Constructor values are strict; a request's ``params`` override the known ones only (a
    Mixture passes one params dict to all its members)."""

    model_config = ConfigDict(extra="forbid")

    def merged(self, overrides: dict[str, Any]) -> Self:
        known = {k: v for k, v in overrides.items() if k in type(self).model_fields}
        return self.model_validate({**self.model_dump(), **known}) if known else self


class WalkParams(Params):
    """Knobs shared by the graph walks."""

    fanout: int | None = Field(
        default=256, ge=1, description="neighbors per vertex per hop, newest first (a cap for hubs; None: all)"
    )
    # Off by default: alias bridging has only been measured on 2Wiki, whose gold-triple graph makes nearly every
    # vertex "thin" (docs/benchmarks.md); an option until another dataset shows it helps.
    aliases: int = Field(default=0, ge=0, description="aliases tried per thin object (0: off)")
    alias_min_sim: float = Field(default=0.75, ge=0.0, le=1.0, description="name cosine for an alias")
    thin_degree: int = Field(default=2, ge=0, description="objects with at most this many triplets are thin")
    thin_relations: int = Field(default=1, ge=0, description="...or with at most this many relation names")


def is_thin(vertex: Vertex, hops: Sequence[Triplet], params: WalkParams) -> bool:
    """Few triplets, or only one kind of relation (say, only "director" edges from films): a likely fragment of an
    entity whose other facts sit under another name."""
    if vertex.kind is not VertexKind.OBJECT:
        return False
    relations = {t.edge.relation for t in hops if t.edge.kind is EdgeKind.RELATION}
    return len(hops) <= params.thin_degree or len(relations) <= params.thin_relations


@dataclass
class Hops:
    """One hop from a set of vertices: their triplets, and for thin objects their aliases and the aliases'
    triplets (``by_vertex`` is keyed by the vertex the triplet touches)."""

    by_vertex: dict[str, list[Triplet]] = field(default_factory=lambda: defaultdict(list))
    aliases: dict[str, list[tuple[Vertex, float]]] = field(default_factory=dict)

    def of(self, vertex_id: str) -> list[Triplet]:
        return self.by_vertex.get(vertex_id, [])


class Scope:
    """One retrieval call: the request, the user-bound store calls and caches of vectors and similarities."""

    def __init__(
        self, request: RetrievalRequest, graph: GraphStore, vectors: VectorStore, embedder: Embedder | None
    ) -> None:
        self.request = request
        self.user_id = request.user_id
        self.graph = graph
        self.vectors = vectors
        self.embedder = embedder
        self._query: np.ndarray | None = None
        self._vecs: dict[str, np.ndarray] = {}
        self.store_calls = 0
        # vertices a read met that did not hold at ``as_of``: no triplet shows them, so no later read need look
        self.unshowable: set[str] = set()

    def for_tenant(self, user_id: str) -> Scope:
        """The same request bound to another tenant (PGraphRAG's allowlisted shared corpus), same query vector."""
        other = Scope(self.request.model_copy(update={"user_id": user_id}), self.graph, self.vectors, self.embedder)
        other._query = self._query
        return other

    # --- query -----------------------------------------------------------------------------------------------
    async def query_vector(self) -> np.ndarray:
        if self._query is None:
            if self.request.query_vector is not None:
                self._query = unit(self.request.query_vector)
            elif self.embedder is not None:
                self._query = unit((await self.embedder.embed([self.request.query]))[0])
            else:
                raise ValueError("retrieval needs request.query_vector or an embedder")
        return self._query

    # --- filters ---------------------------------------------------------------------------------------------
    def owned(self, t: Triplet) -> bool:
        u = self.user_id
        return t.edge.user_id == u and t.start.user_id == u and t.end.user_id == u

    def valid(self, t: Triplet) -> bool:
        when = self.request.as_of
        return t.edge.valid_at(when) and t.start.valid_at(when) and t.end.valid_at(when)

    def traversable(self, t: Triplet) -> bool:
        return self.owned(t) and self.valid(t)

    def in_context(self, t: Triplet) -> bool:
        kinds = self.request.context_kinds
        return self.traversable(t) and t.start.kind in kinds and t.end.kind in kinds

    def walk_kinds(self) -> list[EdgeKind]:
        """Edges a walk may follow: relations always, theses and episodic links only when they may be shown (an
        episode links to every entity of its message, so walking through one that is not shown is mostly noise)."""
        kinds = [EdgeKind.RELATION]
        if VertexKind.THESIS in self.request.context_kinds:
            kinds.append(EdgeKind.THESIS)
        if VertexKind.EPISODIC in self.request.context_kinds:
            kinds.append(EdgeKind.EPISODIC)
        return kinds

    # --- store calls -----------------------------------------------------------------------------------------
    async def neighbors(
        self,
        vertex_ids: Iterable[str],
        kinds: Sequence[EdgeKind] | None = None,
        limit: int | None = None,
        far_kinds: Sequence[VertexKind] | None = None,
    ) -> list[Triplet]:
        ids = list(dict.fromkeys(vertex_ids))
        if not ids:
            return []
        self.store_calls += 1
        found = await self.graph.neighbors(self.user_id, ids, kinds or self.walk_kinds(), limit, far_kinds)
        kept = []
        for t in found:
            if self.traversable(t):
                kept.append(t)
            else:
                self.unshowable.update(v.id for v in (t.start, t.end) if not v.valid_at(self.request.as_of))
        return kept

    async def hop(self, vertices: Sequence[Vertex], params: WalkParams) -> Hops:
        """One hop for a whole frontier: one ``neighbors`` call, plus one for the aliases of its thin objects."""
        hops = Hops()
        await self._group(hops, [v.id for v in vertices], params.fanout)
        if params.aliases:
            thin = [v for v in vertices if is_thin(v, hops.of(v.id), params)]
            hops.aliases = await self.aliases(thin, params.aliases, params.alias_min_sim)
            jumps = {a.id for found in hops.aliases.values() for a, _ in found} - hops.by_vertex.keys()
            await self._group(hops, sorted(jumps - {v.id for v in vertices}), params.fanout)
        return hops

    async def _group(self, hops: Hops, vertex_ids: list[str], fanout: int | None) -> None:
        wanted = set(vertex_ids)
        for t in await self.neighbors(vertex_ids, limit=fanout):
            for end in {t.start.id, t.end.id} & wanted:
                hops.by_vertex[end].append(t)

    async def vectors_for(self, keys: Iterable[str], texts: dict[str, str] | None = None) -> dict[str, np.ndarray]:
        """Stored unit vectors by id, fetched once per call; ids the index lacks are embedded from ``texts``."""
        missing = [k for k in dict.fromkeys(keys) if k not in self._vecs]
        if missing:
            self.store_calls += 1
            got = await self.vectors.get_vectors(self.user_id, missing)
            for k, v in got.items():
                self._vecs[k] = unit(v)
            absent = [k for k in missing if k not in got and texts is not None and k in texts]
            if texts is not None and absent and self.embedder is not None:
                for k, v in zip(absent, await self.embedder.embed([texts[k] for k in absent]), strict=True):
                    self._vecs[k] = unit(v)
        return self._vecs

    async def sims(self, triplets: Sequence[Triplet], target: np.ndarray | None = None) -> np.ndarray:
        """Cosine of each triplet's stored vector with the query (or ``target``), clipped to [1e-6, 1]."""
        if not triplets:
            return np.zeros(0, dtype=np.float32)
        keys = [vector_key(t) for t in triplets]
        vecs = await self.vectors_for(keys, {vector_key(t): t.text for t in triplets})
        return self._cos(keys, vecs, await self.query_vector() if target is None else target)

    async def aliases(
        self, vertices: Sequence[Vertex], k: int, min_sim: float
    ) -> dict[str, list[tuple[Vertex, float]]]:
        """Other object vertices that probably name the same entity: dense neighbours of each vertex's name with
        cosine >= ``min_sim``, or >= ``min_sim - 0.2`` when one name's words contain the other's ("Oswiu" and
        "Oswiu of Northumbria"). Exact-name dedup leaves such fragments ("Henri Lepage" / "Henri Lepage
        (director)"), and a chain split across them is otherwise unreachable."""
        objects = [v for v in vertices if v.kind is VertexKind.OBJECT and not is_literal(v.name)]
        if not objects or k <= 0:
            return {}
        vecs = await self.vectors_for([v.id for v in objects], {v.id: v.name for v in objects})
        searched = [v for v in objects if v.id in vecs]
        self.store_calls += len(searched)
        hit_lists = await asyncio.gather(
            *(
                self.vectors.search(self.user_id, [VertexKind.OBJECT.value], vecs[v.id].tolist(), None, k + 1)
                for v in searched
            )
        )
        wanted = {h.id for hits in hit_lists for h in hits}
        self.store_calls += 1
        found = await self.graph.get_vertices(self.user_id, sorted(wanted)) if wanted else {}
        out: dict[str, list[tuple[Vertex, float]]] = {}
        for v, hits in zip(searched, hit_lists, strict=True):
            own = tokens(v.name)
            for h in hits:
                other = found.get(h.id)
                if other is None or other.id == v.id or other.user_id != self.user_id:
                    continue
                theirs = tokens(other.name)
                nested = bool(own and theirs) and (own <= theirs or theirs <= own)
                numbers, their_numbers = _numbers(own), _numbers(theirs)
                if not (numbers <= their_numbers or their_numbers <= numbers):
                    continue  # "Wrong Turn 4" is not "Wrong Turn 5"
                if h.score >= min_sim or (nested and h.score >= min_sim - 0.2):
                    out.setdefault(v.id, []).append((other, min(1.0, max(h.score, MIN_SIM))))
            if v.id in out:
                out[v.id] = out[v.id][:k]
        return out

    async def vertex_sims(self, vertices: Sequence[Vertex], target: np.ndarray | None = None) -> np.ndarray:
        if not vertices:
            return np.zeros(0, dtype=np.float32)
        keys = [v.id for v in vertices]
        vecs = await self.vectors_for(keys, {v.id: v.text for v in vertices})
        return self._cos(keys, vecs, await self.query_vector() if target is None else target)

    @staticmethod
    def _cos(keys: Sequence[str], vecs: dict[str, np.ndarray], target: np.ndarray) -> np.ndarray:
        dim = target.shape[0]
        zero = np.zeros(dim, dtype=np.float32)
        mat = np.stack([vecs.get(k, zero) for k in keys])
        return np.clip(mat @ target, MIN_SIM, 1.0)

    # --- output ----------------------------------------------------------------------------------------------
    def finalize(self, ranked: Iterable[Triplet]) -> list[Triplet]:
        return take((t for t in ranked if self.in_context(t)), self.request.budget)


def take(ranked: Iterable[Triplet], budget: int) -> list[Triplet]:
    """Best-first triplets -> at most ``budget``, one per edge and per statement (the object->thesis edges of both
    ends of a thesis read as the same text: showing it twice wastes budget)."""
    out: list[Triplet] = []
    seen: set[str] = set()
    for t in ranked:
        keys = {t.edge.id, "text:" + normalize_text(t.text)}
        if t.edge.kind is not EdgeKind.RELATION:
            keys.add("vertex:" + t.end.user_id + ":" + t.end.id)
        if keys & seen:
            continue
        seen |= keys
        out.append(t)
        if len(out) >= budget:
            break
    return out


class GraphRetriever(Retriever):
    """Base of the retrievers here: builds the scope, times the call, filters and caps the ranked output."""

    name = "graph"
    params_model: ClassVar[type[Params]] = Params

    def __init__(
        self, graph: GraphStore, vectors: VectorStore, embedder: Embedder | None = None, **params: Any
    ) -> None:
        self.graph = graph
        self.vectors = vectors
        self.embedder = embedder
        self.params = self.params_model(**params)

    async def retrieve(self, request: RetrievalRequest) -> list[Triplet]:
        started = time.perf_counter()
        scope = Scope(request, self.graph, self.vectors, self.embedder)
        ranked = await self.rank(scope, self.params.merged(request.params))
        result = self.finalize(scope, ranked)
        elapsed = time.perf_counter() - started
        RETRIEVAL_LATENCY.labels(self.name).observe(elapsed)
        RETRIEVAL_SIZE.labels(self.name).observe(len(result))
        log.debug(
            "retrieved",
            retriever=self.name,
            user_id=request.user_id,
            seeds=len(request.seeds),
            triplets=len(result),
            store_calls=scope.store_calls,
            ms=round(elapsed * 1000, 1),
        )
        return result

    @abstractmethod
    async def rank(self, scope: Scope, params: Any) -> list[Triplet]:
        """Candidate triplets, best first; may exceed the budget (``finalize`` filters and caps)."""

    def finalize(self, scope: Scope, ranked: list[Triplet]) -> list[Triplet]:
        return scope.finalize(ranked)


def interleave(rankings: Sequence[Sequence[Triplet]]) -> list[Triplet]:
    """Round-robin over several best-first lists (one per seed or per member), so each gets its share."""
    out: list[Triplet] = []
    longest = max((len(r) for r in rankings), default=0)
    for i in range(longest):
        for ranking in rankings:
            if i < len(ranking):
                out.append(ranking[i])
    return out
