"""Events travel as raw bytes (the JSON of the pydantic models) and are validated where they enter an agent.

Decoding never raises anything but ``InvalidEvent``: bad JSON, a schema violation or an unknown schema version all
end up as a dead letter with reason ``invalid_event`` and the original payload.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from schemas.events import DeadLetter
from services.ids import digest

M = TypeVar("M", bound=BaseModel)

INVALID_EVENT = "invalid_event"
PROCESSING_FAILED = "processing_failed"


class InvalidEvent(ValueError):
    def __init__(self, message: str, user_id: str | None = None, event_id: str | None = None) -> None:
        super().__init__(message)
        self.user_id = user_id
        self.event_id = event_id


def encode(event: BaseModel) -> bytes:
    return event.model_dump_json().encode("utf-8")


def user_key(user_id: str | None) -> bytes | None:
    return user_id.encode("utf-8") if user_id else None


def decode(raw: bytes | None, model: type[M]) -> M:
    """Validate ``raw`` as ``model``; ``InvalidEvent`` (with whatever user/event id could be read) otherwise."""
    if raw is None:
        raise InvalidEvent("empty message value")
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidEvent(f"not valid JSON: {exc}") from exc
    user_id = _str_field(data, "user_id")
    event_id = _str_field(data, "event_id")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}" for e in exc.errors()[:5])
        raise InvalidEvent(f"{model.__name__} schema violation: {errors}", user_id, event_id) from exc


def _str_field(data: object, name: str) -> str | None:
    if isinstance(data, dict):
        value = data.get(name)
        if isinstance(value, str) and 0 < len(value) <= 200:
            return value
    return None


def payload_text(raw: bytes | None, limit: int = 100_000) -> str:
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
        error=error[:4000],
        payload=payload,
        failed_event_ids=list(failed_event_ids),
        attempts=attempts,
    )
