"""Flat retrieval, the paper's baseline: no traversal, one hybrid (dense + BM25, rank-fused) search over the
indexed triplet and thesis texts, hits turned into context triplets in rank order."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from pydantic import Field

from services.domain import EdgeKind, Triplet, VertexKind
from services.logging import get_logger
from services.retrieval.common import GraphRetriever, Params, Scope

log = get_logger(__name__)


class FlatParams(Params):
    mode: Literal["hybrid", "dense", "lexical"] = "hybrid"
    kinds: list[str] = Field(
        default_factory=lambda: ["triplet", "thesis", "episodic"],
        description="indexed kinds searched (thesis and episodic only where the request asks for them)",
    )
    overfetch: int = Field(default=3, ge=1, description="hits fetched per budget slot (invalid ones are dropped)")
    first_read: int | None = Field(
        default=30,
        ge=1,
        description="hits whose triplets are read first (at least the budget); the rest only when these show "
        "fewer than the budget. None: all in one read (the same triplets, more of them decoded)",
    )


async def vertex_triplets(scope: Scope, vertex_ids: list[str]) -> dict[str, Triplet]:
    """The triplet that shows each thesis/episode: the edge that points at it, preferring one from an object."""
    if not vertex_ids:
        return {}
    wanted = set(vertex_ids)
    out: dict[str, Triplet] = {}
    for t in await scope.neighbors(vertex_ids, kinds=[EdgeKind.THESIS, EdgeKind.EPISODIC]):
        if t.end.id not in wanted:
            continue
        prev = out.get(t.end.id)
        if prev is None or (prev.start.kind is not VertexKind.OBJECT and t.start.kind is VertexKind.OBJECT):
            out[t.end.id] = t
    return out


async def episode_triplets(
    scope: Scope, vertex_ids: list[str], rank: Mapping[str, int] | None = None
) -> dict[str, Triplet]:
    """The triplet that shows each thesis with the message it came from (thesis -> episode), and each episode
    (object -> episode, preferring one from a thesis): ranked by either, one item per message. ``rank``: each id's
    place among every hit (default: its place here), so the hits can be read a part at a time with the same
    choices as one read of them all."""
    if not vertex_ids:
        return {}
    places = rank if rank is not None else {id_: n for n, id_ in enumerate(vertex_ids)}
    out = await _episode_triplets(scope, vertex_ids, [VertexKind.THESIS, VertexKind.EPISODIC], places)
    # a message that stated no thesis is shown from an object it names (an invalidated thesis is shown by none)
    rest = [i for i in vertex_ids if i not in out and i not in scope.unshowable]
    return out | await _episode_triplets(scope, rest, None, places)


async def _episode_triplets(
    scope: Scope, vertex_ids: list[str], far_kinds: list[VertexKind] | None, rank: Mapping[str, int]
) -> dict[str, Triplet]:
    """One read: ``far_kinds`` thesis and episodic reads only a thesis's messages and a message's theses (an
    episode links to every entity of its message: most of what a plain read decodes would be dropped here).

    Among an id's triplets the first is the one met first by walking the hits in rank order, each one's edges
    newest first: an edge to a hit ranked earlier comes first (a thesis repeated in two messages is shown with
    the one that ranked)."""
    if not vertex_ids:
        return {}
    wanted = set(vertex_ids)
    unranked = len(rank)
    best: dict[str, tuple[bool, int, int, Triplet]] = {}  # id -> (not from a thesis, place met, order, triplet)

    def offer(id_: str, key: tuple[bool, int, int], t: Triplet) -> None:
        prev = best.get(id_)
        if prev is None or key < prev[:3]:
            best[id_] = (*key, t)

    found = await scope.neighbors(vertex_ids, kinds=[EdgeKind.EPISODIC], far_kinds=far_kinds)
    for order, t in enumerate(found):
        if t.end.kind is not VertexKind.EPISODIC:
            continue
        met = min(rank.get(t.start.id, unranked), rank.get(t.end.id, unranked))
        if t.start.id in wanted and t.start.kind is VertexKind.THESIS:
            offer(t.start.id, (False, met, order), t)  # the thesis's first source; a repeat's later ones are alike
        if t.end.id in wanted:
            offer(t.end.id, (t.start.kind is not VertexKind.THESIS, met, order), t)
    return {id_: entry[3] for id_, entry in best.items()}


class Flat(GraphRetriever):
    name = "flat"
    params_model = FlatParams

    async def rank(self, scope: Scope, params: FlatParams) -> list[Triplet]:
        request = scope.request
        episodic = VertexKind.EPISODIC in request.context_kinds
        # With the messages in context, relation triplets are left out: each restates a thesis, whose message is
        # shown with it (LoCoMo evidence recall@10 0.636 with them, 0.694 without; docs/evaluation.md).
        kinds = [
            k
            for k in params.kinds
            if (k == "triplet" and not episodic) or (k != "triplet" and VertexKind(k) in request.context_kinds)
        ]
        if not kinds:
            return []
        vector = None if params.mode == "lexical" else (await scope.query_vector()).tolist()
        text = None if params.mode == "dense" else request.query
        scope.store_calls += 1
        hits = await scope.vectors.search(scope.user_id, kinds, vector, text, k=request.budget * params.overfetch)
        ids = [h.id for h in hits]
        rank = {id_: n for n, id_ in enumerate(ids)}
        # the hits' triplets are read in rank order, the first part first: most questions fill their budget from
        # it, and the rest (overfetched for the hits that turn out invalid or shown already) is read only if not
        first = len(ids) if params.first_read is None else max(params.first_read, request.budget)
        ranked = await self._shown(scope, kinds, ids[:first], rank, episodic)
        if len(ids) > first and len(scope.finalize(ranked)) < request.budget:
            ranked += await self._shown(scope, kinds, ids[first:], rank, episodic)
        return ranked

    @staticmethod
    async def _shown(
        scope: Scope, kinds: list[str], ids: list[str], rank: Mapping[str, int], episodic: bool
    ) -> list[Triplet]:
        """The triplet that shows each hit, in their order (a hit with none is left out)."""
        if "triplet" in kinds:  # hits may be edges: tell them from vertices
            vertices = await scope.graph.get_vertices(scope.user_id, ids)
            found, rest = [i for i in ids if i in vertices], [i for i in ids if i not in vertices]
        else:  # every hit is a vertex's text, read below with the triplet that shows it (one read less)
            found, rest = ids, []
        # a thesis and its message are one item: whichever ranks first shows both (``Triplet.context``)
        shown = await episode_triplets(scope, found, rank) if episodic else {}
        # a thesis with no message (written by hand or from a graph import) is shown from its object
        shown = await vertex_triplets(scope, [i for i in found if i not in shown and i not in scope.unshowable]) | shown
        edges = await scope.graph.get_triplets(scope.user_id, rest) if rest else {}
        return [t for i in ids if (t := shown.get(i) or edges.get(i)) is not None]
