"""Breadth-first baseline: no scoring at all. Every triplet of the seeds, then every triplet of their neighbours,
up to ``depth`` hops, in the store's order, until the budget is full.

It is the yardstick for the walks: on a graph where a seed's neighbourhood is little more than the answer's
chain, breadth-first search already finds the chain, and a walk's score over it measures the graph, not the walk.
"""

from __future__ import annotations

from pydantic import Field

from services.domain import Triplet
from services.retrieval.common import GraphRetriever, Params, Scope


class BFSParams(Params):
    depth: int = Field(default=2, ge=1, description="hops from the seeds")
    fanout: int | None = Field(default=256, ge=1, description="neighbors per vertex per hop (a cap for hubs)")


class BFS(GraphRetriever):
    name = "bfs"
    params_model = BFSParams

    async def rank(self, scope: Scope, params: BFSParams) -> list[Triplet]:
        budget = scope.request.budget
        seen = set(scope.request.seeds)
        frontier = list(scope.request.seeds)
        out: list[Triplet] = []
        for _ in range(params.depth):
            if not frontier:
                break
            found = await scope.neighbors(frontier, limit=params.fanout)
            out.extend(found)
            if len(scope.finalize(out)) >= budget:
                break  # full: a further hop could only add triplets past the budget
            following = []
            for t in found:
                for end in (t.start, t.end):
                    if end.id not in seen:
                        seen.add(end.id)
                        following.append(end.id)
            frontier = following
        return out
