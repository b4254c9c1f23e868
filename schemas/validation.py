"""The limits every input is held to, in one place: the gateway (request bodies) and the workers (topic records)
parse JSON with ``parse_json`` and validate with the contracts in ``schemas.events``, which use the field types
below, so the edge and the workers reject exactly the same things.

Why each limit exists:
- nesting depth: ``json.loads`` recurses, and 100,000 nested brackets raise ``RecursionError`` (it crashed the
  worker's agent); the depth is measured on the text before anything is parsed;
- size: a record or request body is read whole into memory;
- strict UTF-8 and no lone surrogates: a ``\\ud800`` escape decodes to a Python string that cannot be encoded
  again, so it would fail later, far from its cause (the gateway's 500s, the worker's encode);
- the time window: ``9999-12-31T23:59:59-14:00`` is a valid ISO time whose UTC value does not exist; it failed the
  store write of every event of its batch;
- control characters in names (speaker, title, platform) and NUL in text: they are never meant, and NUL breaks
  C-string based stores and tools.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

from pydantic import AfterValidator, AwareDatetime

#: Deepest nesting of arrays/objects accepted anywhere (an event is 2 deep; a stage event's detail a few more).
MAX_JSON_DEPTH = 32
#: Largest topic record a worker decodes: the largest valid event (a 200,000-character document, 4 UTF-8 bytes
#: per character at worst) with room to spare.
MAX_RECORD_BYTES = 2 * 1024 * 1024
#: Default of ``MEMSTREAM_MAX_BODY_BYTES``, the largest request body the gateway reads.
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
#: Timestamps are accepted from this instant...
EARLIEST_TIME = datetime(1900, 1, 1, tzinfo=UTC)
#: ...up to this far after the validating clock's now.
MAX_FUTURE = timedelta(days=3660)

_TOKENS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.DOTALL)  # a string literal, or a bracket
_OPENERS = frozenset("[{")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


class MalformedJSON(ValueError):
    """Input that is not JSON memstream accepts; the message says why, for the client or the dead letter.
    ``parsed``: what was parsed anyway, when the JSON parsed (a dead letter can still name the user)."""

    def __init__(self, message: str, status: int = 422, parsed: Any = None) -> None:
        super().__init__(message)
        self.status = status
        self.parsed = parsed


def parse_json(raw: bytes, max_bytes: int, what: str = "the body") -> Any:
    """``raw`` parsed as strict JSON within the limits above; ``MalformedJSON`` otherwise, never anything else."""
    if len(raw) > max_bytes:
        raise MalformedJSON(f"{what} is {len(raw)} bytes, more than the limit of {max_bytes}", status=413)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MalformedJSON(f"{what} is not valid JSON: not UTF-8 ({exc.reason} at byte {exc.start})") from exc
    check_depth(text, what)
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except ValueError as exc:  # JSONDecodeError, NaN/Infinity, an integer of more than 4,300 digits
        raise MalformedJSON(f"{what} is not valid JSON: {exc}") from exc
    if (where := _surrogate(data, "")) is not None:
        where = where or "<root>"
        raise MalformedJSON(f"{what} has a lone UTF-16 surrogate escape (not a character) at {where}", parsed=data)
    return data


def check_depth(text: str, what: str = "the body") -> None:
    """Reject nesting deeper than ``MAX_JSON_DEPTH`` without parsing (brackets inside strings do not count)."""
    if text.count("[") + text.count("{") <= MAX_JSON_DEPTH:
        return  # cannot be too deep: the common case costs two counts
    depth = 0
    for match in _TOKENS.finditer(text):
        token = match.group()
        if token in _OPENERS:
            depth += 1
            if depth > MAX_JSON_DEPTH:
                raise MalformedJSON(f"{what} nests arrays/objects more than {MAX_JSON_DEPTH} levels deep")
        elif token in "]}":
            depth -= 1


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _surrogate(value: Any, path: str) -> str | None:
    """The path of the first string (key or value) holding a lone surrogate, or None."""
    if isinstance(value, str):
        return None if _encodable(value) else path
    if isinstance(value, dict):
        for key, item in value.items():
            if not _encodable(key):
                return f"{path}.<key>".lstrip(".")
            if (found := _surrogate(item, f"{path}.{key}".lstrip("."))) is not None:
                return found
    elif isinstance(value, list):
        for n, item in enumerate(value):
            if (found := _surrogate(item, f"{path}[{n}]")) is not None:
                return found
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def printable(text: str, limit: int | None = None) -> str:
    """``text`` made safe to encode and to show: lone surrogates replaced, cut to ``limit`` characters."""
    text = text if _encodable(text) else text.encode("utf-8", "replace").decode("utf-8")
    return text if limit is None else text[:limit]


# -- field types of the contracts -----------------------------------------------------------------------------


def _in_window(value: datetime) -> datetime:
    latest = datetime.now(UTC) + MAX_FUTURE
    if not EARLIEST_TIME <= value <= latest:
        raise ValueError(f"must be between {EARLIEST_TIME:%Y-%m-%d} and {latest:%Y-%m-%d} (UTC)")
    return value


def valid_text(value: str) -> str:
    if not _encodable(value):
        raise ValueError("contains a lone UTF-16 surrogate, which is not a character")
    if "\x00" in value:
        raise ValueError("contains a NUL character")
    return value


def valid_name(value: str) -> str:
    valid_text(value)
    if _CONTROL.search(value):
        raise ValueError("contains a control character")
    return value


#: A timezone-aware instant within [EARLIEST_TIME, now + MAX_FUTURE].
Timestamp = Annotated[AwareDatetime, AfterValidator(_in_window)]
