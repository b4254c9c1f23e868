"""Row <-> domain conversions. Everything is stored as deterministic text so a replay writes identical bytes."""

from __future__ import annotations

import json
import re
from array import array
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from services.domain import Edge, Vertex, VertexKind
from services.ids import digest, normalize_name

# FTS5 query syntax has operators, column filters and quoting; we keep only word tokens and quote each one, so
# nothing a user types can change the shape of the MATCH expression.
_WORD = re.compile(r"\w+", re.UNICODE)
MAX_QUERY_TOKENS = 64
#: how FTS5 cuts and stems the indexed texts; ``terms`` cuts a big user's texts and questions the same way
FTS_TOKENIZER = "porter unicode61 remove_diacritics 2"

VERTEX_COLUMNS = (
    "id, user_id, kind, name, norm_name, props, t_created, t_valid, t_expired, t_invalid, invalidated_by, "
    "episode_label, temporal_label"
)
EDGE_COLUMNS = "id, user_id, kind, source, target, relation, props, t_valid, t_expired, t_invalid, invalidated_by"
N_VERTEX_COLUMNS = 13
N_EDGE_COLUMNS = 11


def dt_to_text(value: datetime | None) -> str | None:
    """Fixed-width ISO-8601 in UTC (so text order is time order). Naive datetimes are taken as UTC."""
    if value is None:
        return None
    aware = value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    return aware.isoformat(timespec="microseconds")


def text_to_dt(value: str | None) -> datetime | None:
    return None if value is None else datetime.fromisoformat(value)


def props_to_text(props: Mapping[str, str]) -> str:
    return json.dumps(dict(props), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def text_to_props(text: str) -> dict[str, str]:
    # most edges and many vertices have none: a flat retrieval decodes ~90 triplets a read
    return {} if text == "{}" else json.loads(text)


def vertex_row(v: Vertex) -> tuple[Any, ...]:
    return (
        v.id,
        v.user_id,
        v.kind.value,
        v.name,
        normalize_name(v.name) if v.kind is VertexKind.OBJECT else None,
        props_to_text(v.props),
        dt_to_text(v.t_created),
        dt_to_text(v.t_valid),
        dt_to_text(v.t_expired),
        dt_to_text(v.t_invalid),
        v.invalidated_by,
        v.episode_label.value if v.episode_label else None,
        v.temporal_label.value if v.temporal_label else None,
    )


def row_vertex(row: Sequence[Any]) -> Vertex:
    return Vertex(
        id=row[0],
        user_id=row[1],
        kind=row[2],
        name=row[3],
        props=text_to_props(row[5]),
        t_created=text_to_dt(row[6]),
        t_valid=text_to_dt(row[7]),
        t_expired=text_to_dt(row[8]),
        t_invalid=text_to_dt(row[9]),
        invalidated_by=row[10],
        episode_label=row[11],
        temporal_label=row[12],
    )


def edge_row(e: Edge) -> tuple[Any, ...]:
    props = props_to_text(e.props)
    return (
        e.id,
        e.user_id,
        e.kind.value,
        e.source,
        e.target,
        e.relation,
        props,
        dt_to_text(e.t_valid),
        dt_to_text(e.t_expired),
        dt_to_text(e.t_invalid),
        e.invalidated_by,
    )


def row_edge(row: Sequence[Any]) -> Edge:
    return Edge(
        id=row[0],
        user_id=row[1],
        kind=row[2],
        source=row[3],
        target=row[4],
        relation=row[5],
        props=text_to_props(row[6]),
        t_valid=text_to_dt(row[7]),
        t_expired=text_to_dt(row[8]),
        t_invalid=text_to_dt(row[9]),
        invalidated_by=row[10],
    )


def vector_blob(vector: Sequence[float], dim: int) -> bytes:
    if len(vector) != dim:
        raise ValueError(f"vector has {len(vector)} dimensions, the store has {dim}")
    return array("f", vector).tobytes()


def blob_vector(blob: bytes) -> list[float]:
    return array("f", blob).tolist()


#: ``x IN IN_LIST`` with ``json_list(values)`` bound to its ``?``
IN_LIST = "(SELECT value FROM json_each(?))"


def json_list(values: Sequence[str]) -> str:
    """A list parameter for ``json_each(?)``: one bound value however long the list, and no SQL built from data."""
    return json.dumps(list(values))


def user_key(user_id: str) -> str:
    """The user id as a single alphanumeric FTS5 token (user ids may hold separators the tokenizer splits on)."""
    return "u" + digest(user_id)


def _fts_string(value: str) -> str:
    return '"' + value.replace('"', '""') + '"'


def fts_match(user_id: str, kinds: Sequence[str], text: str) -> str | None:
    """The MATCH expression: this user's rows, of these kinds (empty: all), containing any word of ``text``."""
    terms = fts_query(text)
    if terms is None:
        return None
    match = f"user_key : {_fts_string(user_key(user_id))}"
    if kinds:
        match += f" AND kind : ({' OR '.join(_fts_string(kind) for kind in kinds)})"
    return f"{match} AND text : ({terms})"


def query_words(text: str) -> list[str]:
    """The distinct words of a search text (casefolded, at most ``MAX_QUERY_TOKENS``), each one OR-ed phrase."""
    seen: dict[str, None] = {}
    for token in _WORD.findall(text):
        seen.setdefault(token.casefold(), None)
        if len(seen) >= MAX_QUERY_TOKENS:
            break
    return list(seen)


def fts_query(text: str) -> str | None:
    """Any user text -> a safe FTS5 expression: distinct word tokens, each quoted, OR-ed (BM25 ranks overlap)."""
    words = query_words(text)
    if not words:
        return None
    # \w never matches '"', so wrapping in quotes is a complete escape
    return " OR ".join(f'"{token}"' for token in words)
