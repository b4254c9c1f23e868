"""The memory-graph neighbourhood of some vertices or edges (an answer's evidence), for the trace page.

Every read is scoped to the user in the path: ids of another user's memory simply are not found.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import datetime

from pydantic import BaseModel, Field

from services.domain import Triplet, Vertex
from services.ports import GraphStore, Stores
from services.settings import Settings

MAX_IDS = 100
MAX_NODES = 300
_NAME_CHARS = 300


class GraphNode(BaseModel):
    id: str
    kind: str
    name: str
    focus: bool = Field(description="one of the asked-for ids, or an end of an asked-for edge")
    valid: bool = Field(default=True, description="held at the asked-for time (an asked-for one is shown anyway)")


class GraphEdge(BaseModel):
    id: str
    kind: str
    source: str
    target: str
    relation: str
    focus: bool
    valid: bool = Field(default=True, description="held at the asked-for time (an asked-for one is shown anyway)")


class Neighbourhood(BaseModel):
    user_id: str
    found: list[str] = Field(description="the asked-for ids that exist in this user's memory")
    nodes: list[GraphNode]
    edges: list[GraphEdge]


def split_ids(raw: Sequence[str]) -> list[str]:
    """``?ids=a,b&ids=c`` -> ``[a, b, c]``, without blanks and repeats."""
    return list(dict.fromkeys(i.strip() for value in raw for i in value.split(",") if i.strip()))


async def neighbourhood(
    store: GraphStore, user_id: str, ids: Sequence[str], per_vertex: int, as_of: datetime | None = None
) -> Neighbourhood:
    """The asked-for vertices and edges (edge ids start with ``r_``), their ends, and one hop around them.

    Around them only what held at ``as_of`` (now by default) is shown, as a retriever would see it: an invalidated
    thesis or relation edge is left out. The asked-for ones and their ends are always shown, marked ``valid``
    false if they did not hold then."""
    edge_ids = [i for i in ids if i.startswith("r_")]
    vertex_ids = [i for i in ids if not i.startswith("r_")]
    triplets, vertices = await asyncio.gather(
        store.get_triplets(user_id, edge_ids), store.get_vertices(user_id, vertex_ids)
    )
    focus_vertices: dict[str, Vertex] = dict(vertices)
    for t in triplets.values():
        focus_vertices |= {t.start.id: t.start, t.end.id: t.end}
    around = await store.neighbors(user_id, sorted(focus_vertices), limit_per_vertex=per_vertex)

    nodes: dict[str, GraphNode] = {}
    edges: dict[str, GraphEdge] = {}

    def add(t: Triplet, focus: bool) -> None:
        held = t.edge.valid_at(as_of) and t.start.valid_at(as_of) and t.end.valid_at(as_of)
        if not (focus or held or (t.start.id in focus_vertices and t.end.id in focus_vertices)):
            return
        for v in (t.start, t.end):
            if v.user_id == user_id and (v.id in nodes or len(nodes) < MAX_NODES):
                nodes.setdefault(v.id, _node(v, v.id in focus_vertices, as_of))
        if t.edge.user_id == user_id and t.start.id in nodes and t.end.id in nodes:
            edges.setdefault(t.id, _edge(t, focus, as_of))

    for v in focus_vertices.values():
        if v.user_id == user_id:
            nodes[v.id] = _node(v, True, as_of)
    for t in triplets.values():
        add(t, True)
    for t in around:
        add(t, t.id in triplets)
    return Neighbourhood(
        user_id=user_id,
        found=[i for i in ids if i in triplets or i in vertices],
        nodes=list(nodes.values()),
        edges=list(edges.values()),
    )


def _node(v: Vertex, focus: bool, as_of: datetime | None) -> GraphNode:
    return GraphNode(id=v.id, kind=v.kind.value, name=v.text[:_NAME_CHARS], focus=focus, valid=v.valid_at(as_of))


def _edge(t: Triplet, focus: bool, as_of: datetime | None) -> GraphEdge:
    e = t.edge
    return GraphEdge(
        id=e.id,
        kind=e.kind.value,
        source=e.source,
        target=e.target,
        relation=e.relation,
        focus=focus,
        valid=e.valid_at(as_of) and t.start.valid_at(as_of) and t.end.valid_at(as_of),
    )


#: a request waits this long for an unreachable store, then gets 503 with Retry-After (a worker waits far longer)
GATEWAY_STORE_WAIT_S = 5.0


class LazyStores:
    """The configured backend's stores, opened on first use (the gateway loads no model: the embedder only tells
    the vector size)."""

    def __init__(self, settings: Settings) -> None:
        wait = min(settings.backend_outage_s, GATEWAY_STORE_WAIT_S)
        self.settings = settings.model_copy(update={"backend_outage_s": wait})
        self._stores: Stores | None = None
        self._lock = asyncio.Lock()

    async def __call__(self) -> Stores:
        async with self._lock:
            if self._stores is None:
                from services.container import open_stores
                from services.llm.factory import build_embedder

                self._stores = await open_stores(self.settings, build_embedder(self.settings).dim)
            return self._stores

    async def close(self) -> None:
        if self._stores is not None:
            await self._stores.close()
            self._stores = None
