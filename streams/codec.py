"""Events travel as raw bytes (the JSON of the pydantic models) and are validated where they enter an agent.

Decoding never raises anything but ``InvalidEvent``: bad or too deep JSON, a field out of its limits
(``schemas.validation``), an unknown schema version, or a record keyed by another user all end up as a dead letter
with the reason and the original payload.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, TypeAdapter, ValidationError

from schemas.events import DeadLetter, Event, Identifier, UserId
from schemas.validation import MAX_RECORD_BYTES, MalformedJSON, parse_json, printable
from services.ids import digest

M = TypeVar("M", bound=BaseModel)
E = TypeVar("E", bound=Event)

INVALID_EVENT = "invalid_event"
KEY_MISMATCH = "key_mismatch"
PROCESSING_FAILED = "processing_failed"
#: How much of a record a dead letter keeps (it says how big the original was).
PAYLOAD_LIMIT = 100_000

_USER_ID: TypeAdapter[str] = TypeAdapter(UserId)
_EVENT_ID: TypeAdapter[str] = TypeAdapter(Identifier)


class InvalidEvent(ValueError):
    def __init__(
        self, message: str, user_id: str | None = None, event_id: str | None = None, reason: str = INVALID_EVENT
    ) -> None:
        super().__init__(message)
        self.user_id = user_id
        self.event_id = event_id
        self.reason = reason


def encode(event: BaseModel) -> bytes:
    return event.model_dump_json().encode("utf-8")


def user_key(user_id: str | None) -> bytes | None:
    return user_id.encode("utf-8") if user_id else None


def decode(raw: bytes | None, model: type[M]) -> M:
    """Validate ``raw`` as ``model``; ``InvalidEvent`` (with whatever user/event id could be read) otherwise."""
    if raw is None:
        raise InvalidEvent("empty message value")
    try:
        data = parse_json(raw, MAX_RECORD_BYTES, "the record")
    except MalformedJSON as exc:
        raise InvalidEvent(str(exc), *_ids(exc.parsed)) from exc
    user_id, event_id = _ids(data)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}" for e in exc.errors()[:5])
        raise InvalidEvent(f"{model.__name__} schema violation: {errors}", user_id, event_id) from exc


def decode_keyed(key: bytes | None, raw: bytes | None, model: type[E]) -> E:
    """``decode``, and the record must be keyed by its ``user_id``: the key decides the partition, so a record
    under another key could be ordered against another user's events, never against its own user's."""
    event = decode(raw, model)
    if key != user_key(event.user_id):
        shown = printable(key.decode("utf-8", "replace"), 200) if key is not None else None
        raise InvalidEvent(
            f"record key {shown!r} is not the event's user_id {event.user_id!r}",
            event.user_id,
            event.event_id,
            KEY_MISMATCH,
        )
    return event


def is_tombstone(raw: bytes | None) -> bool:
    """Whether a record on a memory topic is a ``Forget`` (its kind says so; decoding then checks the rest)."""
    if not raw or b'"forget"' not in raw:
        return False  # cheap: most records are messages, whose JSON never holds the quoted word alone
    try:
        data = parse_json(raw, MAX_RECORD_BYTES, "the record")
    except MalformedJSON:
        return False
    return isinstance(data, dict) and data.get("kind") == "forget"


def _ids(data: object) -> tuple[str | None, str | None]:
    return _id_field(data, "user_id", _USER_ID), _id_field(data, "event_id", _EVENT_ID)


def _id_field(data: object, name: str, kind: TypeAdapter[str]) -> str | None:
    """The field if it is a valid id (a dead letter may carry it), else None."""
    value: Any = data.get(name) if isinstance(data, dict) else None
    try:
        return kind.validate_python(value) if isinstance(value, str) else None
    except ValidationError:
        return None


def payload_text(raw: bytes | None, limit: int = PAYLOAD_LIMIT) -> str:
    return (raw or b"")[:limit].decode("utf-8", errors="replace")


def dead_letter(
    *,
    source_topic: str,
    reason: str,
    error: str,
    raw: bytes | None = None,
    user_id: str | None = None,
    failed_event_ids: Sequence[str] = (),
    attempts: int = 1,
) -> DeadLetter:
    """A dead letter whose id is derived from what failed, so a replay of the same failure has the same id."""
    payload = payload_text(raw)
    event_id = "dl_" + digest(source_topic, reason, payload, *sorted(failed_event_ids))
    return DeadLetter(
        event_id=event_id,
        user_id=user_id,
        source_topic=source_topic,
        reason=reason,
        error=printable(error, 4000),
        payload=payload,
        payload_bytes=len(raw) if raw is not None else None,
        failed_event_ids=list(failed_event_ids),
        attempts=attempts,
    )
