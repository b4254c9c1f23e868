"""A*: the shortest path between every pair of seeds; the triplets along the paths found are the context.

Each hop costs 1 (leaving a thesis towards another object it names is free: a thesis is a hyperedge; jumping from a
thin object to an alias of it costs ``1 - name similarity``, see ``Scope.aliases``); the heuristic is the embedding
dissimilarity ``1 - cos`` of a vertex with the goal. Search is bounded by ``max_expanded`` vertices; it expands the
``batch`` most promising open vertices per ``neighbors`` call, and neighbourhoods are cached across the pairs of
one request. Each pair is searched both ways (a search that reaches its goal makes the reverse one unnecessary).
When the goal is not reached, the paths to the ``fallback_paths`` reached vertices closest to the goal are returned
instead. With a single seed the goal is the query itself: paths run to the reached vertices most like the query.
"""

from __future__ import annotations

import heapq
import itertools

import numpy as np
from pydantic import Field

from services.domain import EdgeKind, Triplet, Vertex, VertexKind
from services.retrieval.common import GraphRetriever, Hops, Scope, WalkParams, interleave, other_end

Arrival = tuple[str, Triplet | None]  # previous vertex, and the edge taken (None: an alias jump)


class AStarParams(WalkParams):
    max_expanded: int = Field(default=150, ge=1, description="vertices expanded per search")
    batch: int = Field(default=8, ge=1, description="open vertices expanded per neighbors call")
    fallback_paths: int = Field(default=3, ge=1, description="paths returned when the goal is not reached")


class Neighbourhoods:
    """Per-request cache of one-hop neighbourhoods (with aliases), fetched in batches."""

    def __init__(self, scope: Scope, params: AStarParams) -> None:
        self.scope = scope
        self.params = params
        self.hops: dict[str, tuple[list[Triplet], list[tuple[Vertex, float]]]] = {}

    async def of(self, vertices: list[Vertex]) -> dict[str, tuple[list[Triplet], list[tuple[Vertex, float]]]]:
        missing = [v for v in vertices if v.id not in self.hops]
        if missing:
            hops: Hops = await self.scope.hop(missing, self.params)
            for v in missing:
                self.hops[v.id] = (hops.of(v.id), hops.aliases.get(v.id, []))
        return {v.id: self.hops[v.id] for v in vertices}


class AStar(GraphRetriever):
    name = "astar"
    params_model = AStarParams

    async def rank(self, scope: Scope, params: AStarParams) -> list[Triplet]:
        seed_ids = list(dict.fromkeys(scope.request.seeds))
        found = await scope.graph.get_vertices(scope.user_id, seed_ids)
        seeds = [found[s] for s in seed_ids if s in found and found[s].user_id == scope.user_id]
        if not seeds:
            return []
        cache = Neighbourhoods(scope, params)
        if len(seeds) == 1:
            paths, _ = await self._search(scope, cache, params, seeds[0], None, await scope.query_vector())
            return interleave(paths)
        vecs = await scope.vectors_for([s.id for s in seeds], {s.id: s.name for s in seeds})
        reached: list[list[Triplet]] = []
        fallback: list[list[Triplet]] = []
        for a, b in itertools.combinations(seeds, 2):
            for start, goal in ((a, b), (b, a)):
                target = vecs[goal.id] if goal.id in vecs else await scope.query_vector()
                paths, ok = await self._search(scope, cache, params, start, goal.id, target)
                if ok:
                    reached.extend(paths)
                    break
                fallback.append(interleave(paths))
        reached.sort(key=len)
        return [t for path in reached for t in path] + interleave(fallback)

    async def _search(
        self,
        scope: Scope,
        cache: Neighbourhoods,
        params: AStarParams,
        start: Vertex,
        goal: str | None,
        target: np.ndarray,
    ) -> tuple[list[list[Triplet]], bool]:
        """Paths from ``start``: to ``goal`` if reached (``True``), else to the reached vertices closest to it."""
        g: dict[str, float] = {start.id: 0.0}
        h: dict[str, float] = {}
        came: dict[str, Arrival] = {}
        known: dict[str, Vertex] = {start.id: start}
        tie = itertools.count()
        heap: list[tuple[float, int, str]] = [(0.0, next(tie), start.id)]
        closed: set[str] = set()
        expanded = 0
        while heap and expanded < params.max_expanded and (goal is None or goal not in g):
            batch: list[Vertex] = []
            while heap and len(batch) < params.batch:
                _, _, vid = heapq.heappop(heap)
                if vid not in closed and known[vid].kind is not VertexKind.EPISODIC:
                    closed.add(vid)
                    batch.append(known[vid])
            if not batch:
                break
            expanded += len(batch)
            fresh: dict[str, Vertex] = {}

            def relax(u: str, v: Vertex, cost: float, edge: Triplet | None, fresh: dict[str, Vertex] = fresh) -> None:
                if g[u] + cost < g.get(v.id, float("inf")):
                    g[v.id] = g[u] + cost
                    came[v.id] = (u, edge)
                    known[v.id] = v
                    fresh[v.id] = v

            for u, (triplets, aliases) in (await cache.of(batch)).items():
                for alias, sim in aliases:  # expanded later like any other vertex
                    relax(u, alias, 1.0 - sim, None)
                for t in triplets:
                    relax(u, other_end(t, u), 0.0 if self._thesis_exit(came.get(u), u, t) else 1.0, t)
            todo = [v for v in fresh.values() if v.id not in h]
            for v, sim in zip(todo, (await scope.vertex_sims(todo, target)).tolist(), strict=True):
                h[v.id] = 1.0 - sim
            for vid in fresh:
                heapq.heappush(heap, (g[vid] + h[vid], next(tie), vid))
        if goal is not None and goal in g:
            return [self._path(came, goal)], True
        closest = sorted((v for v in h if v != start.id), key=lambda v: (h[v], g[v]))
        return [p for v in closest[: params.fallback_paths] if (p := self._path(came, v))], False

    @staticmethod
    def _thesis_exit(arrival: Arrival | None, u: str, t: Triplet) -> bool:
        edge = arrival[1] if arrival is not None else None
        return (
            edge is not None
            and edge.edge.kind is EdgeKind.THESIS
            and edge.end.id == u
            and t.edge.kind is EdgeKind.THESIS
            and t.end.id == u
        )

    @staticmethod
    def _path(came: dict[str, Arrival], end: str) -> list[Triplet]:
        path: list[Triplet] = []
        while end in came:
            end, t = came[end]
            if t is not None:
                path.append(t)
        return path[::-1]
