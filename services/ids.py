"""Deterministic ids. Every id is derived from the user and the content, so a replay writes the same rows."""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections.abc import Mapping

_WS = re.compile(r"\s+")
_EDGE_PUNCT = re.compile(r"^[\W_]+|[\W_]+$", re.UNICODE)
_ARTICLES = ("the ", "a ", "an ")


def normalize_text(text: str) -> str:
    """Case-, width- and whitespace-insensitive form used for exact-match dedup of theses."""
    text = unicodedata.normalize("NFKC", text).casefold()
    return _WS.sub(" ", text).strip().rstrip(".!;")


def normalize_name(name: str) -> str:
    """Entity-name key: casefolded, underscores as spaces, punctuation trimmed, leading article dropped."""
    text = normalize_text(name.replace("_", " "))
    text = _EDGE_PUNCT.sub("", text)
    for article in _ARTICLES:
        if text.startswith(article) and len(text) > len(article):
            text = text[len(article) :]
            break
    return text


def digest(*parts: str) -> str:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        data = part.encode("utf-8")
        h.update(len(data).to_bytes(4, "big"))
        h.update(data)
    return h.hexdigest()


def object_id(user_id: str, name: str) -> str:
    return "o_" + digest(user_id, "object", normalize_name(name))


def thesis_id(user_id: str, text: str) -> str:
    return "t_" + digest(user_id, "thesis", normalize_text(text))


def episode_id(user_id: str, event_id: str, chunk: int = 0) -> str:
    return "e_" + digest(user_id, "episodic", event_id, str(chunk))


def edge_id(user_id: str, kind: str, source: str, relation: str, target: str) -> str:
    return "r_" + digest(user_id, kind, source, normalize_text(relation), target)


def stated_relation(user_id: str, props: Mapping[str, str]) -> str | None:
    """The relation edge id a thesis with these props states (``ChangeSetBuilder.add`` wrote it), if any."""
    subject, relation, obj = (props.get(k) for k in ("subject", "relation", "object"))
    if not (subject and relation and obj):
        return None
    start, end = object_id(user_id, subject), object_id(user_id, obj)
    if start == end:
        return None
    return edge_id(user_id, "relation", start, relation, end)


def change_set_id(user_id: str, event_ids: list[str]) -> str:
    return "c_" + digest(user_id, "changeset", *sorted(event_ids))
