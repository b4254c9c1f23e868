"""Flat retrieval, the paper's baseline: no traversal, one hybrid (dense + BM25, rank-fused) search over the
indexed triplet and thesis texts, hits turned into context triplets in rank order."""

from __future__ import annotations

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


async def episode_triplets(scope: Scope, vertex_ids: list[str]) -> dict[str, Triplet]:
    """The triplet that shows each thesis with the message it came from (thesis -> episode), and each episode
    (object -> episode, preferring one from a thesis): ranked by either, one item per message."""
    if not vertex_ids:
        return {}
    out = await _episode_triplets(scope, vertex_ids, [VertexKind.THESIS, VertexKind.EPISODIC])
    # a message that stated no thesis is shown from an object it names
    return out | await _episode_triplets(scope, [i for i in vertex_ids if i not in out], None)


async def _episode_triplets(
    scope: Scope, vertex_ids: list[str], far_kinds: list[VertexKind] | None
) -> dict[str, Triplet]:
    """One read: ``far_kinds`` thesis and episodic reads only a thesis's messages and a message's theses (an
    episode links to every entity of its message: most of what a plain read decodes would be dropped here)."""
    if not vertex_ids:
        return {}
    wanted = set(vertex_ids)
    out: dict[str, Triplet] = {}
    for t in await scope.neighbors(vertex_ids, kinds=[EdgeKind.EPISODIC], far_kinds=far_kinds):
        if t.end.kind is not VertexKind.EPISODIC:
            continue
        if t.start.id in wanted and t.start.kind is VertexKind.THESIS:
            out.setdefault(t.start.id, t)  # the thesis's first source; a repeat's later ones are alike
        if t.end.id in wanted:
            prev = out.get(t.end.id)
            if prev is None or (prev.start.kind is not VertexKind.THESIS and t.start.kind is VertexKind.THESIS):
                out[t.end.id] = t
    return out


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
        if "triplet" in kinds:  # hits may be edges: tell them from vertices
            vertices = await scope.graph.get_vertices(scope.user_id, ids)
            found, rest = [i for i in ids if i in vertices], [i for i in ids if i not in vertices]
        else:  # every hit is a vertex's text, read below with the triplet that shows it (one read less)
            found, rest = ids, []
        # a thesis and its message are one item: whichever ranks first shows both (``Triplet.context``)
        shown = await episode_triplets(scope, found) if episodic else {}
        # a thesis with no message (written by hand or from a graph import) is shown from its object
        shown = await vertex_triplets(scope, [i for i in found if i not in shown]) | shown
        edges = await scope.graph.get_triplets(scope.user_id, rest) if rest else {}
        return [t for i in ids if (t := shown.get(i) or edges.get(i)) is not None]
