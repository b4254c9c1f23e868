"""``RemoteMemoryStore``: every store port on real servers: the graph, the applied events, the announcements and the
LLM cache in Dgraph, the vectors and BM25 index in Weaviate.

There is no transaction across the two, so ``apply`` writes in an order that a replay repairs: the graph (one
Dgraph transaction, idempotent upserts), then the vectors (Weaviate objects keyed by our ids, overwritten on
replay), then the events as applied together with the change set's pending announcement (one Dgraph transaction,
so an applied event always has its announcement until it was published). A crash before the last step leaves the
events unapplied, so the replay that follows writes the same things again and changes nothing that was already
there (and announces counts of zero: what it added this time).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Self

from pydantic import SecretStr

from services.adapters.dgraph import DgraphGraphStore
from services.adapters.weaviate import WeaviateVectorStore
from services.domain import (
    Announcement,
    ApplyResult,
    ChangeSet,
    EdgeKind,
    Erasure,
    Stats,
    Triplet,
    Vertex,
    VertexKind,
)
from services.logging import get_logger
from services.metrics import STORE_WRITE_LATENCY
from services.ports import (
    CacheScope,
    Vector,
    VectorHit,
    VectorItem,
    WholeBackend,
)
from services.settings import Settings

log = get_logger(__name__)


def check_change_set(change_set: ChangeSet, vectors: Sequence[VectorItem], dim: int) -> None:
    """Refuse, before anything is written, what would land in another user's memory or has the wrong size."""
    user = change_set.user_id
    owners = [(v.id, v.user_id) for v in change_set.vertices] + [(e.id, e.user_id) for e in change_set.edges]
    for item_id, owner in owners:
        if owner != user:
            raise ValueError(f"{item_id} belongs to {owner!r}, the change set to {user!r}")
    for vector in vectors:
        if len(vector.vector) != dim:
            raise ValueError(f"vector {vector.id} has {len(vector.vector)} dimensions, the store has {dim}")


class RemoteMemoryStore(WholeBackend):
    def __init__(self, graph: DgraphGraphStore, vectors: WeaviateVectorStore) -> None:
        """Both parts already open (see ``open``); the store closes them."""
        self.graph = graph
        self.vectors = vectors
        self.dim = vectors.dim

    @classmethod
    async def open(
        cls,
        dgraph: str,
        weaviate_http: str,
        weaviate_grpc: str,
        dim: int,
        *,
        prefix: str = "Memstream",
        timeout_s: float = 30.0,
        outage_s: float = 600.0,
        dgraph_user: str | None = None,
        dgraph_password: SecretStr | str | None = None,
        dgraph_namespace: int = 0,
        dgraph_token: SecretStr | str | None = None,
        weaviate_api_key: SecretStr | str | None = None,
    ) -> Self:
        """``outage_s``: how long each call waits for a server that cannot be reached (``services.backends``);
        the ``dgraph_*`` and ``weaviate_api_key`` credentials as ``DgraphGraphStore`` and ``WeaviateVectorStore``
        take them (docs/security.md, "Transport security")."""
        graph = await DgraphGraphStore.open(
            dgraph,
            timeout_s=timeout_s,
            outage_s=outage_s,
            user=dgraph_user,
            password=dgraph_password,
            namespace=dgraph_namespace,
            token=dgraph_token,
        )
        try:
            vectors = await WeaviateVectorStore.open(
                weaviate_http,
                weaviate_grpc,
                dim,
                prefix=prefix,
                timeout_s=timeout_s,
                outage_s=outage_s,
                api_key=weaviate_api_key,
            )
        except BaseException:
            await graph.close()
            raise
        return cls(graph, vectors)

    @classmethod
    async def from_settings(cls, settings: Settings, dim: int) -> Self:
        missing = [
            f"MEMSTREAM_{name.upper()}"
            for name in ("dgraph", "weaviate_http", "weaviate_grpc")
            if not getattr(settings, name)
        ]
        if missing:
            raise ValueError(f"MEMSTREAM_STORE=remote needs {', '.join(missing)} (see docs/real-stack.md)")
        assert settings.dgraph and settings.weaviate_http and settings.weaviate_grpc
        return await cls.open(
            settings.dgraph,
            settings.weaviate_http,
            settings.weaviate_grpc,
            dim,
            prefix=settings.weaviate_prefix,
            outage_s=settings.backend_outage_s,
            dgraph_user=settings.dgraph_user,
            dgraph_password=settings.dgraph_password,
            dgraph_namespace=settings.dgraph_namespace,
            dgraph_token=settings.dgraph_token,
            weaviate_api_key=settings.weaviate_api_key,
        )

    async def close(self) -> None:
        try:
            await self.vectors.close()
        finally:
            await self.graph.close()

    # -- writes ------------------------------------------------------------------------------------------------------

    async def apply(self, change_set: ChangeSet, vectors: Sequence[VectorItem]) -> ApplyResult:
        check_change_set(change_set, vectors, self.dim)
        started = time.perf_counter()
        try:
            result = await self.graph.apply_graph(change_set)
            if change_set.event_ids and len(result.skipped_events) == len(set(change_set.event_ids)):
                return result  # a replay: the graph wrote nothing, and the vectors are there
            await self.vectors.upsert(change_set.user_id, vectors)
            result.announcement = Announcement.of(change_set, result)
            await self.graph.mark_applied(change_set, result.announcement)
        finally:
            STORE_WRITE_LATENCY.labels(store="remote").observe(time.perf_counter() - started)
        log.debug(
            "change_set_applied",
            user_id=change_set.user_id,
            change_set_id=change_set.id,
            **result.model_dump(exclude={"skipped_events", "announcement"}),
            skipped=len(result.skipped_events),
        )
        return result

    async def delete_user(self, user_id: str) -> None:
        """Forget a user: graph, applied events and vectors (the LLM cache is shared and keyed by prompt)."""
        await self.vectors.delete_user(user_id)
        await self.graph.delete_user(user_id)

    # -- GraphStore ------------------------------------------------------------------------------------------------

    async def get_vertices(self, user_id: str, ids: Sequence[str]) -> dict[str, Vertex]:
        return await self.graph.get_vertices(user_id, ids)

    async def find_objects(self, user_id: str, normalized_names: Sequence[str]) -> dict[str, Vertex]:
        return await self.graph.find_objects(user_id, normalized_names)

    async def neighbors(
        self,
        user_id: str,
        vertex_ids: Sequence[str],
        edge_kinds: Sequence[EdgeKind] | None = None,
        limit_per_vertex: int | None = None,
        far_kinds: Sequence[VertexKind] | None = None,
    ) -> list[Triplet]:
        return await self.graph.neighbors(user_id, vertex_ids, edge_kinds, limit_per_vertex, far_kinds)

    async def get_triplets(self, user_id: str, edge_ids: Sequence[str]) -> dict[str, Triplet]:
        return await self.graph.get_triplets(user_id, edge_ids)

    async def valid_theses(self, user_id: str, about: Sequence[str] | None = None, limit: int = 50) -> list[Vertex]:
        return await self.graph.valid_theses(user_id, about, limit)

    async def seen_events(self, user_id: str, event_ids: Sequence[str]) -> set[str]:
        return await self.graph.seen_events(user_id, event_ids)

    async def stats(self, user_id: str) -> Stats:
        return await self.graph.stats(user_id)

    # -- VectorStore -------------------------------------------------------------------------------------------------

    async def search(
        self,
        user_id: str,
        kinds: Sequence[str],
        query_vector: Vector | None,
        query_text: str | None = None,
        k: int = 10,
        restrict_to: Sequence[str] | None = None,
    ) -> list[VectorHit]:
        return await self.vectors.search(user_id, kinds, query_vector, query_text, k, restrict_to)

    async def get_vectors(self, user_id: str, ids: Sequence[str]) -> dict[str, list[float]]:
        return await self.vectors.get_vectors(user_id, ids)

    # -- AnnouncementLog: in Dgraph, written in the transaction that marks the events applied ---------------------

    async def pending_announcements(self, user_id: str, event_ids: Sequence[str]) -> list[Announcement]:
        return await self.graph.pending_announcements(user_id, event_ids)

    async def mark_announced(self, user_id: str, change_set_ids: Sequence[str]) -> None:
        await self.graph.mark_announced(user_id, change_set_ids)

    # -- KeyValueCache -----------------------------------------------------------------------------------------------

    async def get(self, key: str) -> str | None:
        return await self.graph.get(key)

    async def put(self, key: str, value: str, scope: CacheScope | None = None) -> None:
        await self.graph.put(key, value, scope)

    async def forget(self, user_id: str, event_ids: Sequence[str] | None) -> int:
        return await self.graph.forget(user_id, event_ids)

    # -- ForgetStore: vectors first, then the graph in one transaction (see ``ForgetStore.erase``) ---------------

    async def episodes(self, user_id: str, match: Mapping[str, str] | None) -> list[Vertex]:
        return await self.graph.episodes(user_id, match)

    async def invalidated_by(self, user_id: str, thesis_ids: Sequence[str]) -> list[Vertex]:
        return await self.graph.invalidated_by(user_id, thesis_ids)

    async def forget_outcome(self, user_id: str, forget_id: str) -> str | None:
        return await self.graph.forget_outcome(user_id, forget_id)

    async def erase(self, erasure: Erasure, vectors: Sequence[VectorItem] = ()) -> None:
        started = time.perf_counter()
        try:
            if erasure.whole_user:
                await self.vectors.delete_user(erasure.user_id)
            else:
                await self.vectors.delete(erasure.user_id, erasure.delete_vectors)
                await self.vectors.upsert(erasure.user_id, vectors)
            await self.graph.erase(erasure)
        finally:
            STORE_WRITE_LATENCY.labels(store="remote").observe(time.perf_counter() - started)
