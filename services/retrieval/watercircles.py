"""WaterCircles: breadth-first circles spreading from every seed at once, ranked by where they meet.

Each seed's circle grows one hop per round (one ``neighbors`` call for the union of all frontiers, plus one to step
out of the theses just entered: a thesis is a hyperedge, and the objects it names lie in the same circle). A thin
object's aliases (``Scope.aliases``: the same entity under another name; with ``aliases > 0``, off by default) join
its circle, at the cost of their name dissimilarity. A circle keeps at most ``width`` new vertices per round, those
reached by the best chains (chain cost as in BeamSearch: sum of ``-log sim`` over its edges, normalised by
``len**alpha``), so hubs do not flood it.

The ranked context, best first:

1. *meetings*: the chains joining two seeds, where their circles touch (shortest and most query-like first);
2. *chains*: each seed's best multi-hop chains, for ``chain_share`` of the budget;
3. *plain neighbours*: each seed's own edges;
4. anything else the circles reached.

Within tiers 2-4 a triplet whose text names another query entity (another seed, or a query word not in this
seed's own name) is boosted; the seeds' lists are interleaved so each seed gets a share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from pydantic import Field

from services.domain import EdgeKind, Triplet, Vertex, VertexKind
from services.ids import normalize_name
from services.retrieval.common import GraphRetriever, Scope, WalkParams, interleave, other_end, tokens


class WaterCirclesParams(WalkParams):
    depth: int = Field(default=2, ge=1, description="circles (hops) around each seed")
    width: int = Field(default=25, ge=1, description="new vertices kept per seed per circle")
    alpha: float = Field(default=0.75, ge=0.0)
    chain_share: float = Field(default=0.5, ge=0.0, le=1.0, description="budget share of multi-hop chains")
    entity_boost: float = Field(default=0.5, ge=0.0, description="score bonus per other query entity named")


@dataclass(frozen=True, slots=True)
class Chain:
    """Edges from a seed to ``tail``; ``length`` counts the paid edges (free thesis exits do not)."""

    tail: str
    triplets: tuple[Triplet, ...]
    cost: float
    length: int

    def score(self, alpha: float) -> float:
        return self.cost / (self.length**alpha) if self.length else 0.0

    def jump(self, alias: str, sim: float) -> Chain:
        """To an alias of the tail: no edge, the name dissimilarity as cost."""
        return Chain(alias, self.triplets, self.cost - math.log(sim), self.length)

    def then(self, t: Triplet, tail: str, cost: float, free: bool = False) -> Chain:
        paid = 0 if free else 1
        return Chain(tail, (*self.triplets, t), self.cost + (0.0 if free else cost), self.length + paid)


class WaterCircles(GraphRetriever):
    name = "watercircles"
    params_model = WaterCirclesParams

    async def rank(self, scope: Scope, params: WaterCirclesParams) -> list[Triplet]:
        seed_ids = list(dict.fromkeys(scope.request.seeds))
        found_seeds = await scope.graph.get_vertices(scope.user_id, seed_ids)
        seeds = [found_seeds[s] for s in seed_ids if s in found_seeds and found_seeds[s].user_id == scope.user_id]
        if not seeds:
            return []
        known: dict[str, Vertex] = {s.id: s for s in seeds}
        reach: list[dict[str, Chain]] = [{s.id: Chain(s.id, (), 0.0, 0)} for s in seeds]
        found: list[dict[str, Chain]] = [{} for _ in seeds]  # edge id -> best chain ending with that edge
        frontier: list[set[str]] = [{s.id} for s in seeds]
        for _ in range(params.depth):
            union = set().union(*frontier)
            if not union:
                break
            hops = await scope.hop([known[v] for v in sorted(union)], params)
            every = list({t.edge.id: t for ts in hops.by_vertex.values() for t in ts}.values())
            costs = dict(zip((t.edge.id for t in every), (-np.log(await scope.sims(every))).tolist(), strict=True))
            new: list[dict[str, Chain]] = [{} for _ in seeds]
            for i, ring in enumerate(frontier):
                for u in ring:
                    sources = [(u, reach[i][u])]
                    for alias, sim in hops.aliases.get(u, ()):
                        if alias.id not in reach[i]:
                            jump = reach[i][u].jump(alias.id, sim)
                            reach[i][alias.id] = jump
                            known[alias.id] = alias
                            sources.append((alias.id, jump))
                    for x, chain_x in sources:
                        for t in hops.of(x):
                            v = other_end(t, x)
                            known.setdefault(v.id, v)
                            chain = chain_x.then(t, v.id, costs[t.edge.id])
                            self._note(found[i], t.edge.id, chain, params.alpha)
                            if v.id not in reach[i] and v.kind is not VertexKind.EPISODIC:
                                self._note(new[i], v.id, chain, params.alpha)
            await self._step_out_of_theses(scope, reach, new, found, known, params)
            for i in range(len(seeds)):
                best = sorted(new[i].items(), key=lambda kv: kv[1].score(params.alpha))[: params.width]
                reach[i].update(best)
                # a thesis needs no expanding: the step out of it already reached the objects it names
                frontier[i] = {v for v, _ in best if known[v].kind is VertexKind.OBJECT}
        names = [normalize_name(s.name) for s in seeds]
        return self._ranked(scope, params, [s.id for s in seeds], names, reach, found)

    @staticmethod
    def _note(table: dict[str, Chain], key: str, chain: Chain, alpha: float) -> None:
        prev = table.get(key)
        if prev is None or chain.score(alpha) < prev.score(alpha):
            table[key] = chain

    async def _step_out_of_theses(
        self,
        scope: Scope,
        reach: list[dict[str, Chain]],
        new: list[dict[str, Chain]],
        found: list[dict[str, Chain]],
        known: dict[str, Vertex],
        params: WaterCirclesParams,
    ) -> None:
        """Theses entered this round lead, for free, to the other objects they name (same circle)."""
        entered = {
            v
            for ring in new
            for v, c in ring.items()
            if c.triplets[-1].edge.kind is EdgeKind.THESIS and c.triplets[-1].end.id == v
        }
        if not entered:
            return
        exits = await scope.neighbors(entered, kinds=[EdgeKind.THESIS])
        for t in exits:
            for i, ring in enumerate(new):
                entry = ring.get(t.end.id)
                if entry is None or t.start.id == entry.triplets[-1].start.id:
                    continue
                known.setdefault(t.start.id, t.start)
                chain = entry.then(t, t.start.id, 0.0, free=True)
                self._note(found[i], t.edge.id, chain, params.alpha)
                if t.start.id not in reach[i]:
                    self._note(ring, t.start.id, chain, params.alpha)

    def _ranked(
        self,
        scope: Scope,
        params: WaterCirclesParams,
        seeds: list[str],
        names: list[str],
        reach: list[dict[str, Chain]],
        found: list[dict[str, Chain]],
    ) -> list[Triplet]:
        alpha = params.alpha
        # 1. meetings: a chain of seed i whose last edge lands in the circle of seed j
        meetings: list[Chain] = []
        for i, table in enumerate(found):
            for chain in table.values():
                for j in range(len(seeds)):
                    back = reach[j].get(chain.tail) if j != i else None
                    if back is not None:
                        meetings.append(
                            Chain(
                                seeds[j],
                                chain.triplets + back.triplets[::-1],
                                chain.cost + back.cost,
                                chain.length + back.length,
                            )
                        )
        meetings.sort(key=lambda m: (m.length, m.score(alpha)))
        tier1 = [t for chain in meetings for t in chain.triplets]

        # 2-4: per-seed lists, with a bonus for naming other query entities
        query_words = tokens(scope.request.query)
        chains_by_seed: list[list[Triplet]] = []
        plain_by_seed: list[list[Triplet]] = []
        rest_by_seed: list[list[Triplet]] = []
        chain_cap = math.ceil(scope.request.budget * params.chain_share / len(seeds))
        for i, table in enumerate(found):
            others = [n for j, n in enumerate(names) if j != i and n]
            own = tokens(names[i])
            words = query_words - own

            def boosted(chain: Chain, others: list[str] = others, words: set[str] = words) -> float:
                text = " ".join(normalize_name(t.text) for t in chain.triplets)
                hits = sum(1 for n in others if n in text) + (len(tokens(text) & words) / len(words) if words else 0)
                return chain.score(alpha) - params.entity_boost * hits

            ranked = sorted(table.values(), key=boosted)
            chains: dict[str, Triplet] = {}
            for chain in ranked:
                if chain.length >= 2 and len(chains) < chain_cap:
                    chains.update((t.edge.id, t) for t in chain.triplets)
            chains_by_seed.append(list(chains.values()))
            plain_by_seed.append([c.triplets[-1] for c in ranked if c.length <= 1])
            rest_by_seed.append([c.triplets[-1] for c in ranked])
        return tier1 + interleave(chains_by_seed) + interleave(plain_by_seed) + interleave(rest_by_seed)
