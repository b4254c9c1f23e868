"""Domain <-> Dgraph. Writes are predicate -> string maps (sent as typed N-Quads), reads parse query JSON.

Times are stored in UTC; props as JSON text with sorted keys.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from services.domain import Edge, Vertex, VertexKind
from services.ids import normalize_name

VERTEX_TYPES = {VertexKind.OBJECT: "Object", VertexKind.THESIS: "Thesis", VertexKind.EPISODIC: "Episode"}

# every predicate a vertex or edge is read back from (a DQL fragment each, see queries.FRAGMENTS)
VERTEX_FIELDS = (
    "vertex.id",
    "vertex.user",
    "vertex.kind",
    "vertex.name",
    "vertex.props",
    "vertex.t_created",
    "vertex.t_valid",
    "vertex.t_expired",
    "vertex.t_invalid",
    "vertex.invalidated_by",
    "vertex.episode_label",
    "vertex.temporal_label",
)
EDGE_FIELDS = (
    "edge.id",
    "edge.user",
    "edge.kind",
    "edge.relation",
    "edge.props",
    "edge.t_valid",
    "edge.t_expired",
    "edge.t_invalid",
    "edge.invalidated_by",
    "edge.rank",
)


def dt_text(value: datetime | None) -> str | None:
    """RFC 3339 in UTC with microseconds, fixed width (so text order is time order). Naive means UTC."""
    if value is None:
        return None
    aware = value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    return aware.isoformat(timespec="microseconds")


def parse_dt(value: str | None) -> datetime | None:
    return None if value is None else datetime.fromisoformat(value).astimezone(UTC)


def props_text(props: Mapping[str, str]) -> str:
    return json.dumps(dict(props), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def rank_key(*times: datetime | None) -> str:
    """One string that sorts like ``ORDER BY t1 DESC NULLS LAST, t2 DESC NULLS LAST`` under ``orderdesc``."""
    parts = []
    for value in times:
        text = dt_text(value)
        parts.append("0" if text is None else "1" + text)
    return "".join(parts)


Values = dict[str, str | list[str]]


def _without_none(data: dict[str, str | list[str] | None]) -> Values:
    return {key: value for key, value in data.items() if value is not None}


def vertex_values(v: Vertex) -> Values:
    """The predicates of a vertex node (no ``uid``: the caller names the node)."""
    return _without_none(
        {
            "dgraph.type": ["Vertex", VERTEX_TYPES[v.kind]],
            "vertex.id": v.id,
            "vertex.user": v.user_id,
            "vertex.kind": v.kind.value,
            "vertex.name": v.name,
            "vertex.norm_name": normalize_name(v.name) if v.kind is VertexKind.OBJECT else None,
            "vertex.props": props_text(v.props),
            "vertex.t_created": dt_text(v.t_created),
            "vertex.t_valid": dt_text(v.t_valid),
            "vertex.t_expired": dt_text(v.t_expired),
            "vertex.t_invalid": dt_text(v.t_invalid),
            "vertex.invalidated_by": v.invalidated_by,
            "vertex.episode_label": v.episode_label.value if v.episode_label else None,
            "vertex.temporal_label": v.temporal_label.value if v.temporal_label else None,
            "vertex.rank": rank_key(v.t_valid, v.t_created),
        }
    )


def edge_values(e: Edge) -> Values:
    """The scalar predicates of an edge node (the caller adds ``uid``, ``edge.source`` and ``edge.target``)."""
    return _without_none(
        {
            "dgraph.type": "Edge",
            "edge.id": e.id,
            "edge.user": e.user_id,
            "edge.kind": e.kind.value,
            "edge.relation": e.relation,
            "edge.props": props_text(e.props),
            "edge.t_valid": dt_text(e.t_valid),
            "edge.t_expired": dt_text(e.t_expired),
            "edge.t_invalid": dt_text(e.t_invalid),
            "edge.invalidated_by": e.invalidated_by,
            "edge.rank": rank_key(e.t_valid),
        }
    )


def read_vertex(node: Mapping[str, Any]) -> Vertex:
    return Vertex(
        id=node["vertex.id"],
        user_id=node["vertex.user"],
        kind=node["vertex.kind"],
        name=node.get("vertex.name", ""),
        props=json.loads(node.get("vertex.props", "{}")),
        t_created=parse_dt(node.get("vertex.t_created")),
        t_valid=parse_dt(node.get("vertex.t_valid")),
        t_expired=parse_dt(node.get("vertex.t_expired")),
        t_invalid=parse_dt(node.get("vertex.t_invalid")),
        invalidated_by=node.get("vertex.invalidated_by"),
        episode_label=node.get("vertex.episode_label"),
        temporal_label=node.get("vertex.temporal_label"),
    )


def is_vertex(node: Mapping[str, Any] | None) -> bool:
    """A written vertex, not a bare one an edge created before the vertex itself arrived."""
    return node is not None and "vertex.kind" in node


def read_edge(node: Mapping[str, Any], source: str, target: str) -> Edge:
    return Edge(
        id=node["edge.id"],
        user_id=node["edge.user"],
        kind=node["edge.kind"],
        source=source,
        target=target,
        relation=node.get("edge.relation", ""),
        props=json.loads(node.get("edge.props", "{}")),
        t_valid=parse_dt(node.get("edge.t_valid")),
        t_expired=parse_dt(node.get("edge.t_expired")),
        t_invalid=parse_dt(node.get("edge.t_invalid")),
        invalidated_by=node.get("edge.invalidated_by"),
    )
