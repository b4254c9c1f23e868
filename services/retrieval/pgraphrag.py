"""PGraphRAG profile retrieval: the top-k entries of a user's profile for a query.

A profile (PGraphRAG, Au et al. 2025) is the user's own interactions with items plus, for personalised generation,
other users' interactions with the same items. Here an interaction is a thesis or episode linked to an item's
object vertex; entries are ranked by the cosine of their stored vectors with the query, and returned as the
object->entry triplets that show them.

Tenant isolation. Reading arbitrary other users' memory would break the guarantee that every user's memory is
isolated. So the "neighbour" part reads from *one shared tenant only*: a user id holding an explicitly public corpus
(say, published product reviews), which must be listed in the constructor's ``shared_tenants`` allowlist. A request
may pick one of the allowlisted tenants with ``params["shared_user_id"]`` but can never name any other; with no
allowlist, the neighbour part is empty. The items are matched in the shared tenant by normalised name (its object
ids differ), and the entries returned from it carry the shared tenant's ``user_id``, so callers can tell them apart.

Modes: ``both`` (user + neighbour, the paper's PGraphRAG), ``user`` (user-only) and ``neighbor`` (neighbour-only).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import Field

from services.domain import EdgeKind, Triplet, VertexKind
from services.ids import normalize_name
from services.ports import Embedder, GraphStore, VectorStore
from services.retrieval.common import GraphRetriever, Params, Scope, take
from services.retrieval.flat import vertex_triplets


class PGraphRAGParams(Params):
    mode: Literal["both", "user", "neighbor"] = "both"
    k: int | None = Field(default=None, ge=1, description="entries returned (None: the request's budget)")
    items: int = Field(default=10, ge=1, description="items taken from the user's best entries (besides seeds)")
    pool: int = Field(default=50, ge=1, description="candidate entries searched per tenant")


class PGraphRAG(GraphRetriever):
    name = "pgraphrag"
    params_model = PGraphRAGParams

    def __init__(
        self,
        graph: GraphStore,
        vectors: VectorStore,
        embedder: Embedder | None = None,
        shared_tenants: Sequence[str] = (),
        **params: Any,
    ) -> None:
        super().__init__(graph, vectors, embedder, **params)
        self.shared_tenants = tuple(shared_tenants)

    def shared_scope(self, scope: Scope) -> Scope | None:
        wanted = scope.request.params.get("shared_user_id")
        if wanted is None:
            wanted = self.shared_tenants[0] if self.shared_tenants else None
        elif wanted not in self.shared_tenants:
            raise PermissionError(f"shared tenant {wanted!r} is not in this retriever's allowlist")
        if wanted is None or wanted == scope.user_id:
            return None
        return scope.for_tenant(wanted)

    async def rank(self, scope: Scope, params: PGraphRAGParams) -> list[Triplet]:
        await scope.query_vector()
        kinds: list[VertexKind] = [
            k for k in (VertexKind.THESIS, VertexKind.EPISODIC) if k in scope.request.context_kinds
        ]
        if not kinds:
            return []
        seeds = list(dict.fromkeys(scope.request.seeds))
        own = await self._entries(scope, params, kinds, seeds, search=True)
        scored: list[tuple[float, Triplet]] = [] if params.mode == "neighbor" else list(own)
        shared = self.shared_scope(scope) if params.mode != "user" else None
        if shared is not None:
            items = await self._items(scope, seeds, own, params.items)
            found = await shared.graph.find_objects(shared.user_id, items)
            ids = [v.id for v in found.values()]
            scored.extend(await self._entries(shared, params, kinds, ids, search=False))
        scored.sort(key=lambda x: -x[0])
        return [t for _, t in scored][: params.k or scope.request.budget]

    async def _entries(
        self, scope: Scope, params: PGraphRAGParams, kinds: list[VertexKind], items: list[str], search: bool
    ) -> list[tuple[float, Triplet]]:
        """Entries about ``items`` (and, with ``search``, the tenant's best entries for the query), scored."""
        entry_ids: dict[str, None] = {}
        if items:
            for t in await scope.neighbors(items, kinds=[EdgeKind.THESIS, EdgeKind.EPISODIC]):
                if t.end.kind in kinds:
                    entry_ids[t.end.id] = None
        if search:
            scope.store_calls += 1
            hits = await scope.vectors.search(
                scope.user_id,
                [k.value for k in kinds],
                (await scope.query_vector()).tolist(),
                scope.request.query,
                k=params.pool,
            )
            entry_ids.update((h.id, None) for h in hits)
        shown = await vertex_triplets(scope, list(entry_ids))
        triplets = [t for t in shown.values() if scope.in_context(t)]
        sims = (await scope.sims(triplets)).tolist()
        return list(zip(sims, triplets, strict=True))

    async def _items(self, scope: Scope, seeds: list[str], own: list[tuple[float, Triplet]], limit: int) -> list[str]:
        """Normalised names of the items: the seeds and the objects of the user's best entries."""
        best = [t for _, t in sorted(own, key=lambda x: -x[0])[:limit]]
        vertices = await scope.graph.get_vertices(scope.user_id, seeds)
        names = [normalize_name(v.name) for v in vertices.values() if v.kind is VertexKind.OBJECT]
        names += [normalize_name(t.start.name) for t in best if t.start.kind is VertexKind.OBJECT]
        return list(dict.fromkeys(names))

    def finalize(self, scope: Scope, ranked: list[Triplet]) -> list[Triplet]:
        # entries were filtered by their own tenant's scope; only the request's user and the allowlist pass
        allowed = {scope.user_id, *self.shared_tenants}
        mine = (t for t in ranked if {t.edge.user_id, t.start.user_id, t.end.user_id} <= allowed)
        return take(mine, scope.request.budget)
