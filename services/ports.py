"""Ports: one small interface per concern. Services depend on these; adapters implement them.

Every method takes the ``user_id`` explicitly and an adapter must scope every read and write to it: there is no
way to ask a store for more than one user's memory.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

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

Vector = Sequence[float]


class VectorHit(BaseModel):
    model_config = ConfigDict(frozen=True)

    id: str
    score: float = Field(description="Higher is better. Dense: cosine similarity; lexical: BM25; hybrid: fused.")


class VectorItem(BaseModel):
    """An indexed text: a vertex (by vertex id) or a relation triplet (by edge id, kind 'triplet')."""

    id: str
    kind: str  # a VertexKind value or "triplet"
    text: str
    vector: list[float]


class GraphStore(ABC):
    """Vertices and edges of the memory graph."""

    @abstractmethod
    async def get_vertices(self, user_id: str, ids: Sequence[str]) -> dict[str, Vertex]: ...

    @abstractmethod
    async def find_objects(self, user_id: str, normalized_names: Sequence[str]) -> dict[str, Vertex]:
        """Exact lookup of object vertices by ``ids.normalize_name`` key (dedup without any embedding threshold)."""

    @abstractmethod
    async def neighbors(
        self,
        user_id: str,
        vertex_ids: Sequence[str],
        edge_kinds: Sequence[EdgeKind] | None = None,
        limit_per_vertex: int | None = None,
        far_kinds: Sequence[VertexKind] | None = None,
    ) -> list[Triplet]:
        """One hop, both directions, for a whole frontier in one round trip. Triplets keep the edge direction.
        ``far_kinds``: only edges whose other end (the vertex that is not the frontier's) is of these kinds; the
        limit counts those only."""

    @abstractmethod
    async def get_triplets(self, user_id: str, edge_ids: Sequence[str]) -> dict[str, Triplet]:
        """Edges by id with both ends (turns "triplet" vector hits into context)."""

    @abstractmethod
    async def valid_theses(self, user_id: str, about: Sequence[str] | None = None, limit: int = 50) -> list[Vertex]:
        """Theses not yet invalidated; ``about`` restricts to theses linked to these object ids."""

    async def valid_theses_each(
        self, user_id: str, object_ids: Sequence[str], limit: int = 50
    ) -> dict[str, list[Vertex]]:
        """``valid_theses(user_id, [o], limit)`` for each object id (memorize's subjects of a whole batch), read
        together. This default sends them at once; a store that can answer them in one read overrides it."""
        wanted = list(dict.fromkeys(object_ids))
        found = await asyncio.gather(*(self.valid_theses(user_id, [o], limit) for o in wanted))
        return dict(zip(wanted, found, strict=True))

    @abstractmethod
    async def seen_events(self, user_id: str, event_ids: Sequence[str]) -> set[str]:
        """The subset of ``event_ids`` already applied (idempotent replay)."""

    @abstractmethod
    async def stats(self, user_id: str) -> Stats: ...


class VectorStore(ABC):
    """Dense and lexical indexes over vertex and triplet texts."""

    @abstractmethod
    async def search(
        self,
        user_id: str,
        kinds: Sequence[str],
        query_vector: Vector | None,
        query_text: str | None = None,
        k: int = 10,
        restrict_to: Sequence[str] | None = None,
    ) -> list[VectorHit]:
        """Dense search if only a vector is given, lexical (BM25) if only text, reciprocal-rank fusion if both."""

    @abstractmethod
    async def get_vectors(self, user_id: str, ids: Sequence[str]) -> dict[str, list[float]]: ...

    async def search_many(
        self, user_id: str, kinds: Sequence[str], query_vectors: Sequence[Vector], k: int = 10
    ) -> list[list[VectorHit]]:
        """Dense search for each of ``query_vectors`` (memorize's candidates of a whole batch of facts): the same hits
        as one ``search`` each, read together. This default sends them at once; a store that can answer them in one
        read overrides it."""
        return list(await asyncio.gather(*(self.search(user_id, kinds, v, None, k) for v in query_vectors)))


class MemoryWriter(ABC):
    """The one write path memorize uses."""

    @abstractmethod
    async def apply(self, change_set: ChangeSet, vectors: Sequence[VectorItem]) -> ApplyResult:
        """Write a change set and its vectors. Embedded: one transaction. Remote: idempotent upserts, marking the
        events as seen last, so a crash in between is repaired by the replay that follows.

        With the events marked applied, the store records the change set's ``Announcement`` as pending (see
        ``AnnouncementLog``) and returns it in the result; nothing is written, and none returned, when every event
        was applied before."""


class AnnouncementLog(ABC):
    """Memory updates a store wrote with their change sets and that are not yet announced.

    ``MemoryWriter.apply`` records a change set's ``Announcement`` in the same transaction that marks its events
    applied; it stays pending until ``mark_announced``. So a crash between the store write and the publish loses
    no announcement: the replay of the events finds them applied and gets their pending announcements here.
    Announcements are at-least-once, with a stable id (the change set id)."""

    @abstractmethod
    async def pending_announcements(self, user_id: str, event_ids: Sequence[str]) -> list[Announcement]:
        """The pending announcements of the change sets that applied any of ``event_ids``, oldest first."""

    @abstractmethod
    async def mark_announced(self, user_id: str, change_set_ids: Sequence[str]) -> None:
        """The broker acknowledged these announcements: they are no longer pending (unknown ids are ignored)."""


class ForgetStore(ABC):
    """The reads and the one write that forgetting needs (``services.memorize.forget``)."""

    @abstractmethod
    async def episodes(self, user_id: str, match: Mapping[str, str] | None) -> list[Vertex]:
        """The user's episodes whose props hold every ``match`` item (``{"event_id": ...}``, ``{"document_id":
        ...}``, ``{"conversation_id": ...}``); ``None``: all of them."""

    @abstractmethod
    async def invalidated_by(self, user_id: str, thesis_ids: Sequence[str]) -> list[Vertex]:
        """Theses whose ``invalidated_by`` is one of ``thesis_ids``."""

    @abstractmethod
    async def forget_outcome(self, user_id: str, forget_id: str) -> str | None:
        """The outcome an applied forget kept (``Erasure.outcome``); None if it was never applied."""

    @abstractmethod
    async def erase(self, erasure: Erasure, vectors: Sequence[VectorItem] = ()) -> None:
        """Apply ``erasure`` and index ``vectors`` (of what it writes anew). Embedded: one transaction. Remote:
        vectors first, then one graph transaction that also records the forgotten events and the outcome, so a
        crash in between is repaired by the replay of the tombstone (which computes the same erasure from the
        untouched graph)."""


class CacheScope(BaseModel):
    """Whose text a cached LLM answer was built from: the user, and the events when they are known (extraction).
    An entry with no events (questions, contradiction checks) may quote any of the user's memory."""

    model_config = ConfigDict(frozen=True)

    user_id: str
    event_ids: tuple[str, ...] = ()


class KeyValueCache(ABC):
    """Persistent cache (LLM calls), with the scope each entry was built from, so forgetting can remove it."""

    @abstractmethod
    async def get(self, key: str) -> str | None: ...

    @abstractmethod
    async def put(self, key: str, value: str, scope: CacheScope | None = None) -> None: ...

    @abstractmethod
    async def forget(self, user_id: str, event_ids: Sequence[str] | None) -> int:
        """Remove the user's entries built from any of ``event_ids`` and those with no events; ``None``: every
        entry of the user. Returns how many went."""


@dataclass(frozen=True)
class Stores:
    """One backend's stores, a port per concern. The backend builds this (``stores()`` on its adapter), so a service
    is handed exactly the ports it uses and nothing asks an object what it can do. One object may serve several
    ports (the embedded SQLite file serves all of them)."""

    graph: GraphStore
    vectors: VectorStore
    writer: MemoryWriter
    announcements: AnnouncementLog
    forget: ForgetStore
    cache: KeyValueCache
    close: Callable[[], Awaitable[None]]


class WholeBackend(GraphStore, VectorStore, MemoryWriter, AnnouncementLog, KeyValueCache, ForgetStore):
    """A backend that serves every store port itself: the embedded SQLite file, or the Dgraph + Weaviate pair behind
    one facade (its writes and forgetting span both servers)."""

    @abstractmethod
    async def close(self) -> None: ...

    def stores(self) -> Stores:
        return Stores(
            graph=self, vectors=self, writer=self, announcements=self, forget=self, cache=self, close=self.close
        )


class Embedder(ABC):
    dim: int
    name: str

    @abstractmethod
    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        """L2-normalised vectors, one per text."""

    async def close(self) -> None:
        return None


class BlockingEmbedder(Embedder):
    """An embedder that computes in this process: ``embed`` runs the blocking ``embed_sync`` off the event loop."""

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        if not texts:
            return []
        return await asyncio.to_thread(self.embed_sync, list(texts))

    @abstractmethod
    def embed_sync(self, texts: Sequence[str]) -> list[list[float]]:
        """Blocking variant, for callers that are already off the event loop."""


class LLMMessage(BaseModel):
    role: str
    content: str


class StopRule(ABC):
    """Ends a generation early: called with the whole output so far at every new piece of text, ``True`` stops it
    (``LLMResponse.finish_reason`` "stop_rule", the text so far returned). A caller that reads the output applies the
    same rule to it, so a backend that cannot stop mid-way gives the same result, only later. ``key`` names all it
    decides on: two rules with equal keys stop the same text at the same place (cache keys include it)."""

    key: str

    @abstractmethod
    def __call__(self, text: str) -> bool: ...


class LLMRequest(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)

    task: str = Field(description="Which LLM task asks (extract, plan, ner, ...): for metrics, cache and logs.")
    messages: list[LLMMessage]
    json_schema: dict[str, Any] | None = Field(default=None, description="Constrain output to this JSON schema.")
    grammar: str | None = Field(
        default=None,
        description="Constrain output to this llama.cpp GBNF grammar instead (plain text out); an adapter that "
        "takes none refuses the request",
    )
    max_tokens: int = 1024
    temperature: float = 0.0
    seed: int | None = Field(default=None, description="Sampling seed; None: the adapter's fixed one.")
    validated: bool = Field(
        default=False,
        description="The caller validates the output and calls ``LLM.accept`` for a good one: cache only then.",
    )
    metadata: Mapping[str, str] = Field(default_factory=dict)
    #: Streaming: called with the whole output so far at every new piece of text (a cache hit calls it once with
    #: all of it). A retry starts again from "", so a listener shows the latest text, never a concatenation.
    #: Not part of what determines the answer (cache keys ignore it) and never serialised.
    on_text: Callable[[str], None] | None = Field(default=None, exclude=True, repr=False)
    #: Stops the generation where this rule says (its ``key`` is in the cache key); never serialised.
    stop_when: StopRule | None = Field(default=None, exclude=True, repr=False)


class LLMResponse(BaseModel):
    text: str
    model: str
    tokens_in: int = 0
    tokens_out: int = 0
    #: of ``tokens_in``, those the model did not read again: served from its KV cache (a prompt prefix it read
    #: before, such as the fixed instructions of a task); 0 where the backend does not say
    prompt_reused: int = 0
    cached: bool = False
    finish_reason: str | None = None


class LLM(ABC):
    model: str

    @abstractmethod
    async def complete(self, request: LLMRequest) -> LLMResponse: ...

    async def accept(self, request: LLMRequest, response: LLMResponse) -> None:
        """The caller validated ``response`` to ``request`` (a ``validated`` request): layers may now keep it."""
        return None

    async def close(self) -> None:
        return None


def as_of_filter(when: datetime | None) -> Any:
    """Predicate for retrievers: keep vertices valid at ``when``."""

    def keep(v: Vertex) -> bool:
        return v.valid_at(when)

    return keep


__all__ = [
    "LLM",
    "AnnouncementLog",
    "CacheScope",
    "Embedder",
    "ForgetStore",
    "GraphStore",
    "KeyValueCache",
    "LLMMessage",
    "LLMRequest",
    "LLMResponse",
    "MemoryWriter",
    "Stores",
    "VectorHit",
    "VectorItem",
    "VectorStore",
    "VertexKind",
    "as_of_filter",
]
