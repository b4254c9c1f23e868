"""ToG-2 style hybrid retrieval (Think-on-Graph 2.0), as an embedding-scored walk with no LLM in the loop.

Per iteration, from the current topic entities (the seeds at first):

1. *relation pruning*: the relations leaving each topic entity are scored against the query (the relation name's
   embedding, and the best of its edges' stored vectors) and only the best ``relations`` per entity are followed;
2. *entity pruning*: each candidate entity is judged by its source texts, the theses and episodes linked to it.
   Every text gets the relevance of "path sentence + text" (mean of the two cosines); the texts are ranked together
   and an entity scores ``sum_k s_k * exp(-decay * k)`` over its texts among the top ``chunks`` (ToG-2's entity
   ranking score); the best ``width`` entities become the next topics;
3. *clues*: the kept triplets and texts are the clue carried into the next iteration; here the query vector is
   moved towards their mean (``clue_weight``), which is what an LLM's clue rewrite would do to the next search.

Output, best first: per iteration, each kept entity's path triplet followed by its ranked texts.
``clue_hook`` (optional) receives the clue texts of each iteration, for an LLM-driven variant to build on.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Awaitable, Callable

import numpy as np
from pydantic import Field

from services.domain import EdgeKind, Triplet, Vertex, VertexKind
from services.retrieval.common import GraphRetriever, Scope, WalkParams, other_end, unit

ClueHook = Callable[[int, list[str]], Awaitable[None]]


class ToG2Params(WalkParams):
    width: int = Field(default=3, ge=1, description="W: topic entities kept per iteration")
    depth: int = Field(default=3, ge=1, description="D: iterations")
    relations: int = Field(default=3, ge=1, description="relations followed per topic entity")
    chunks: int = Field(default=15, ge=1, description="K: top texts that score entities")
    decay: float = Field(default=0.3, ge=0.0, description="alpha of the rank weights exp(-alpha*k)")
    clue_weight: float = Field(default=0.3, ge=0.0, description="how far clues move the next query")


class ToG2(GraphRetriever):
    name = "tog2"
    params_model = ToG2Params
    clue_hook: ClueHook | None = None

    async def rank(self, scope: Scope, params: ToG2Params) -> list[Triplet]:
        query = await scope.query_vector()
        seed_ids = list(dict.fromkeys(scope.request.seeds))
        found = await scope.graph.get_vertices(scope.user_id, seed_ids)
        topics = [found[s] for s in seed_ids if s in found and found[s].user_id == scope.user_id]
        visited = {v.id for v in topics}
        out: list[Triplet] = []
        clue_vecs: list[np.ndarray] = []
        relation_vecs: dict[str, np.ndarray] = {}
        for iteration in range(params.depth):
            if not topics:
                break
            q = unit(query + params.clue_weight * np.mean(clue_vecs, axis=0)) if clue_vecs else query
            paths = await self._prune_relations(scope, params, topics, visited, q, relation_vecs)
            if not paths:
                break
            kept, texts = await self._prune_entities(scope, params, {v: t for v, (t, _) in paths.items()}, q)
            clue: list[Triplet] = []
            for entity in kept:
                clue.append(paths[entity][0])
                clue.extend(texts.get(entity, []))
            out.extend(clue)
            keys = [t.edge.id if t.edge.kind is EdgeKind.RELATION else t.end.id for t in clue]
            vecs = await scope.vectors_for(keys)
            clue_vecs = [vecs[k] for k in keys if k in vecs]
            if self.clue_hook is not None:
                await self.clue_hook(iteration, [t.text for t in clue])
            visited.update(kept)
            topics = [paths[v][1] for v in kept]
        return out

    async def _prune_relations(
        self,
        scope: Scope,
        params: ToG2Params,
        topics: list[Vertex],
        visited: set[str],
        q: np.ndarray,
        relation_vecs: dict[str, np.ndarray],
    ) -> dict[str, tuple[Triplet, Vertex]]:
        """Candidate entity -> the triplet that reaches it (and the entity), through the best relations of each
        topic entity; a thin topic's aliases lend it their relations."""
        hops = await scope.hop(topics, params)
        sources: list[tuple[str, str]] = []  # (topic, vertex whose edges it uses)
        for u in topics:
            sources.append((u.id, u.id))
            sources.extend((u.id, a.id) for a, _ in hops.aliases.get(u.id, ()) if a.id not in visited)
        edges = [(u, x, t) for u, x in sources for t in hops.of(x) if t.edge.kind is EdgeKind.RELATION]
        if not edges:
            return {}
        edge_sims = (await scope.sims([t for _, _, t in edges], q)).tolist()
        names = sorted({t.edge.relation for _, _, t in edges} - relation_vecs.keys())
        if names and scope.embedder is not None:
            for name, vec in zip(names, await scope.embedder.embed(names), strict=True):
                relation_vecs[name] = unit(vec)
        groups: dict[tuple[str, str, bool], list[tuple[float, str, Triplet]]] = defaultdict(list)
        for (topic, x, t), sim in zip(edges, edge_sims, strict=True):
            groups[(topic, t.edge.relation, t.start.id == x)].append((sim, x, t))
        by_topic: dict[str, list[tuple[float, list[tuple[float, str, Triplet]]]]] = defaultdict(list)
        for (topic, relation, _), members in groups.items():
            rel_vec = relation_vecs.get(relation)
            best_edge = max(s for s, _, _ in members)
            score = best_edge if rel_vec is None else 0.5 * (best_edge + float(np.clip(rel_vec @ q, 0.0, 1.0)))
            by_topic[topic].append((score, members))
        paths: dict[str, tuple[float, Triplet, Vertex]] = {}
        for scored in by_topic.values():
            scored.sort(key=lambda x: -x[0])
            for _, members in scored[: params.relations]:
                for sim, x, t in members:
                    v = other_end(t, x)
                    if v.id not in visited and (v.id not in paths or sim > paths[v.id][0]):
                        paths[v.id] = (sim, t, v)
        return {v: (t, vertex) for v, (_, t, vertex) in paths.items()}

    async def _prune_entities(
        self, scope: Scope, params: ToG2Params, paths: dict[str, Triplet], q: np.ndarray
    ) -> tuple[list[str], dict[str, list[Triplet]]]:
        """Rank candidate entities by their linked texts (theses, episodes); keep the best ``width``."""
        candidates = list(paths)
        chunk_kinds = [EdgeKind.THESIS, EdgeKind.EPISODIC]
        links = [
            t
            for t in await scope.neighbors(candidates, kinds=chunk_kinds)
            if t.start.id in paths and t.end.kind in (VertexKind.THESIS, VertexKind.EPISODIC)
        ]
        path_sims = dict(zip(candidates, (await scope.sims(list(paths.values()), q)).tolist(), strict=True))
        chunk_sims = (await scope.sims(links, q)).tolist()
        ranked = sorted(
            ((0.5 * (s + path_sims[t.start.id]), t) for t, s in zip(links, chunk_sims, strict=True)),
            key=lambda x: -x[0],
        )
        scores = {v: path_sims[v] * math.exp(-params.decay * params.chunks) for v in candidates}
        texts: dict[str, list[Triplet]] = defaultdict(list)
        seen: set[str] = set()
        rank = 0
        for s, t in ranked:
            if t.end.id in seen:  # a thesis shared by two candidates counts once, for the better one
                continue
            seen.add(t.end.id)
            if rank >= params.chunks:
                break
            scores[t.start.id] += s * math.exp(-params.decay * rank)
            texts[t.start.id].append(t)
            rank += 1
        kept = sorted(candidates, key=lambda v: -scores[v])[: params.width]
        return kept, texts
