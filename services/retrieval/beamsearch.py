"""BeamSearch: best-first paths from each seed, scored by how well their edges match the query.

A path's cost is the sum over its edges of ``-log(sim)``, sim being the cosine of the edge's stored vector with the
query, clipped to [1e-6, 1]; its score is that cost divided by ``len**alpha`` (lower is better), so a long path is
not punished for its length alone but every weak edge on it still costs. (PersonalAI's code applies this formula to
a store that returns similarities, which makes it prefer the *least* similar edges; here sim is a similarity.)

Theses are hyperedges: entering a thesis pays its cost; leaving it towards another of its objects is free and does
not lengthen the path, so a chain through theses scores like the same chain through relation edges.

Aliases: exact-name dedup leaves one entity under several names ("Henri Lepage" / "Henri Lepage (director)"), and
a chain split across them has no edge to follow. With ``aliases > 0`` (off by default), when a path reaches a *thin*
object (at most ``thin_degree`` triplets), it may also continue from its aliases (``Scope.aliases``), paying
``-log(name similarity)``.

All seeds advance together: one ``neighbors`` call per depth for the whole frontier (plus one for the aliases of
thin tails, when there are any), one vector fetch for all the new edges, and numpy for the scores. A triplet's rank
is the score of the best kept path through it; the seeds' rankings are interleaved so every seed gets a share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from pydantic import Field

from services.domain import EdgeKind, Triplet, Vertex, VertexKind
from services.retrieval.common import GraphRetriever, Scope, WalkParams, interleave, other_end


class BeamSearchParams(WalkParams):
    beam_width: int = Field(default=10, ge=1, description="open paths kept per seed")
    depth: int = Field(default=3, ge=1, description="hops (neighbors calls)")
    alpha: float = Field(default=0.75, ge=0.0, description="length normalisation exponent")


@dataclass(frozen=True, slots=True)
class Path:
    seed: int
    vertices: tuple[str, ...]
    tail: Vertex
    triplets: tuple[Triplet, ...]
    cost: float
    length: int  # edges that were paid for (free thesis exits and alias jumps do not count)

    @property
    def open(self) -> bool:
        # an episode is a dead end: it links to every entity of its message
        return self.tail.kind is not VertexKind.EPISODIC

    def score(self, alpha: float) -> float:
        return self.cost / (self.length**alpha) if self.length else math.inf

    def step(self, t: Triplet, cost: float, via: tuple[Vertex, float] | None = None) -> Path:
        start = self.tail if via is None else via[0]
        free = via is None and is_thesis_exit(self, t)
        nxt = other_end(t, start.id)
        jump = () if via is None else (start.id,)
        return Path(
            self.seed,
            (*self.vertices, *jump, nxt.id),
            nxt,
            (*self.triplets, t),
            self.cost + (0.0 if free else cost) + (0.0 if via is None else -math.log(via[1])),
            self.length + (0 if free else 1),
        )


def is_thesis_exit(path: Path, step: Triplet) -> bool:
    """Leaving the thesis the path just entered, towards another object of the same statement."""
    if not path.triplets or step.edge.kind is not EdgeKind.THESIS:
        return False
    last = path.triplets[-1]
    return last.edge.kind is EdgeKind.THESIS and last.end.id == path.tail.id and step.end.id == path.tail.id


class BeamSearch(GraphRetriever):
    name = "beamsearch"
    params_model = BeamSearchParams

    async def rank(self, scope: Scope, params: BeamSearchParams) -> list[Triplet]:
        seed_ids = list(dict.fromkeys(scope.request.seeds))
        found = await scope.graph.get_vertices(scope.user_id, seed_ids)
        seeds = [found[s] for s in seed_ids if s in found and found[s].user_id == scope.user_id]
        open_paths = [Path(i, (s.id,), s, (), 0.0, 0) for i, s in enumerate(seeds)]
        best: list[dict[str, tuple[float, int, Triplet]]] = [{} for _ in seeds]  # edge id -> (score, order, t)
        order = 0
        for _ in range(params.depth):
            if not open_paths:
                break
            steps = await self._steps(scope, params, open_paths)
            if not steps:
                break
            costs = (-np.log(await scope.sims([t for _, t, _ in steps]))).tolist()
            grown: list[list[Path]] = [[] for _ in seeds]
            for (p, t, via), cost in zip(steps, costs, strict=True):
                grown[p.seed].append(p.step(t, cost, via))
            open_paths = []
            for seed_paths in grown:
                seed_paths.sort(key=lambda q: q.score(params.alpha))
                kept = seed_paths[: params.beam_width]
                for path in kept:
                    score = path.score(params.alpha)
                    for t in path.triplets:
                        order += 1
                        prev = best[path.seed].get(t.edge.id)
                        if prev is None or score < prev[0]:
                            best[path.seed][t.edge.id] = (score, order if prev is None else prev[1], t)
                open_paths.extend(q for q in kept if q.open)
        rankings = [[t for _, _, t in sorted(seed_best.values(), key=lambda x: (x[0], x[1]))] for seed_best in best]
        return interleave(rankings)

    async def _steps(
        self, scope: Scope, params: BeamSearchParams, paths: list[Path]
    ) -> list[tuple[Path, Triplet, tuple[Vertex, float] | None]]:
        """Every one-edge extension of every open path (directly, or from an alias of a thin tail)."""
        hops = await scope.hop(list({p.tail.id: p.tail for p in paths}.values()), params)
        steps: list[tuple[Path, Triplet, tuple[Vertex, float] | None]] = []
        for p in paths:
            for t in hops.of(p.tail.id):
                if other_end(t, p.tail.id).id not in p.vertices:
                    steps.append((p, t, None))
            for alias, sim in hops.aliases.get(p.tail.id, ()):
                if alias.id in p.vertices:
                    continue
                for t in hops.of(alias.id):
                    if other_end(t, alias.id).id not in p.vertices:
                        steps.append((p, t, (alias, sim)))
        return steps
