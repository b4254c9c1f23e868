"""Stage 4: match the entities of a search step to object vertices of the user's memory graph.

An exact normalised-name hit (``GraphStore.find_objects``) comes first: it is free and certain. The rest of the top-n
comes from the fused dense + lexical search over object vertices, which also finds spelling and naming variants.
An alias record (a name memorize merged into another object, ``services.memorize.entities``) stands for the object
it names: a question about "Mel" reaches Melanie's facts. Several vertices per entity are kept on purpose: the same
thing may live under different names in unconnected subgraphs, and stage 5 combines them.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from services.domain import Vertex, VertexKind
from services.ids import normalize_name
from services.logging import get_logger
from services.ports import Embedder, GraphStore, VectorHit, VectorStore
from services.qa.tasks.common import names_in

log = get_logger(__name__)


@dataclass(frozen=True)
class Match:
    entity: str
    vertex: Vertex
    score: float
    exact: bool

    @property
    def rank_key(self) -> tuple[bool, float]:
        return (not self.exact, -self.score)


class EntityMatcher:
    def __init__(self, graph: GraphStore, vectors: VectorStore, embedder: Embedder) -> None:
        self.graph = graph
        self.vectors = vectors
        self.embedder = embedder

    async def match(self, user_id: str, entities: Sequence[str], per_entity: int = 3) -> dict[str, list[Match]]:
        """Top ``per_entity`` object vertices for each entity, best first (an entity may get none)."""
        entities = list(dict.fromkeys(e for e in entities if e.strip()))
        if not entities:
            return {}
        keys = {e: normalize_name(e) for e in entities}
        # Task groups, not gather: if one call fails the others are cancelled instead of left running.
        async with asyncio.TaskGroup() as group:
            exact_task = group.create_task(self.graph.find_objects(user_id, sorted(set(keys.values()))))
            vectors_task = group.create_task(self.embedder.embed(entities))
        exact = exact_task.result()
        async with asyncio.TaskGroup() as group:
            searches = [
                group.create_task(self._search(user_id, entity, vector, per_entity + 1))
                for entity, vector in zip(entities, vectors_task.result(), strict=True)
            ]
        hit_lists = [task.result() for task in searches]
        wanted = {hit.id for hit in itertools.chain.from_iterable(hit_lists)}
        wanted -= {v.id for v in exact.values()}  # already loaded
        found = await self.graph.get_vertices(user_id, sorted(wanted)) if wanted else {}
        found = {v.id: v for v in exact.values()} | found
        canonical = await self._canonical(user_id, found.values())
        exact = {key: canonical.get(v.id, v) for key, v in exact.items()}
        found = {i: canonical.get(i, v) for i, v in found.items()}

        # Keyed by normalised name per the port; re-keying by the vertex name keeps us right if an adapter differs.
        exact_by_name = {normalize_name(v.name): v for v in exact.values()} | dict(exact)
        result: dict[str, list[Match]] = {}
        for entity, hits in zip(entities, hit_lists, strict=True):
            matches: list[Match] = []
            exact_vertex = exact_by_name.get(keys[entity])
            if exact_vertex is not None and self._usable(user_id, exact_vertex):
                matches.append(Match(entity, exact_vertex, 1.0, exact=True))
            for hit in hits:
                vertex = found.get(hit.id)
                if vertex is None or not self._usable(user_id, vertex):
                    continue
                if any(m.vertex.id == vertex.id for m in matches):
                    continue
                matches.append(Match(entity, vertex, hit.score, exact=False))
            result[entity] = matches[:per_entity]
        return result

    async def question_seeds(self, user_id: str, question: str) -> list[str]:
        """Seed object ids for a question without an LLM: the names it writes capitalised (``names_in``) matched
        like any entity; when none matches, the objects the fused search finds for the whole question. The
        evaluation harness and the LLM-free benchmarks seed the same way, so their figures are comparable."""
        for entities in (sorted(names_in(question)), [question]):
            matches = await self.match(user_id, entities)
            seeds = list(dict.fromkeys(m.vertex.id for ms in matches.values() for m in ms))
            if seeds:
                return seeds
        return []

    async def _search(self, user_id: str, entity: str, vector: list[float], k: int) -> list[VectorHit]:
        try:
            return await self.vectors.search(user_id, [VertexKind.OBJECT.value], vector, entity, k=k)
        except Exception:
            # A lexical query the index cannot parse must not lose the dense half of the match.
            log.warning("entity_search_fused_failed", entity=entity, exc_info=True)
            return await self.vectors.search(user_id, [VertexKind.OBJECT.value], vector, None, k=k)

    async def _canonical(self, user_id: str, vertices: Iterable[Vertex]) -> dict[str, Vertex]:
        """Per alias record among ``vertices``, the object it stands for (a record whose object is gone is itself)."""
        pointing = {v.id: v.alias_of for v in vertices if v.alias_of}
        if not pointing:
            return {}
        targets = await self.graph.get_vertices(user_id, sorted({t for t in pointing.values() if t}))
        return {i: targets[t] for i, t in pointing.items() if t in targets}

    @staticmethod
    def _usable(user_id: str, vertex: Vertex) -> bool:
        # Stores scope by user already; this guards against an adapter bug leaking another user's memory.
        return vertex.user_id == user_id and vertex.kind is VertexKind.OBJECT


def combinations(matches: dict[str, list[Match]], limit: int) -> list[list[Match]]:
    """Combinations of one vertex per matched entity, best first (by rank sum), distinct seed sets, at most
    ``limit``: the paper's "linear combinations" of matched vertices."""
    lists = [m for m in matches.values() if m]
    if not lists or limit < 1:
        return []
    ranked = sorted(
        itertools.product(*(list(enumerate(m)) for m in lists)),
        key=lambda combo: sum(rank for rank, _ in combo),
    )
    out: list[list[Match]] = []
    seen: set[frozenset[str]] = set()
    for combo in ranked:
        chosen = [match for _, match in combo]
        seeds = frozenset(m.vertex.id for m in chosen)
        if seeds in seen:
            continue
        seen.add(seeds)
        out.append(chosen)
        if len(out) >= limit:
            break
    return out
