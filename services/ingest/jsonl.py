"""A simple chat format: one JSON object per line, ``{"speaker", "text", "time"?, "conversation_id"?}``.

``time`` is ISO 8601 (a time without a zone is taken as UTC); a line without one inherits the previous line's time,
and the first lines without any use the ingest time. Event ids come from the line's position and content, so
ingesting the same file twice sends the same events (and the memory ignores the replay).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from schemas.events import ChatMessage
from services.ids import digest


class JsonlError(ValueError):
    pass


def parse_time(value: Any) -> datetime:
    if isinstance(value, int | float):
        return datetime.fromtimestamp(value, UTC)
    when = datetime.fromisoformat(str(value).strip().replace("Z", "+00:00"))
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


def jsonl_messages(
    lines: Iterable[str],
    user_id: str,
    conversation_id: str = "default",
    source: str = "<jsonl>",
    now: datetime | None = None,
) -> Iterator[ChatMessage]:
    ingest_time = now or datetime.now(UTC)
    last_time: datetime | None = None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{source}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise JsonlError(f"{where}: not valid JSON: {exc.msg}") from exc
        if not isinstance(row, dict):
            raise JsonlError(f"{where}: expected a JSON object")
        unknown = set(row) - {"speaker", "text", "time", "conversation_id"}
        if unknown:
            raise JsonlError(f"{where}: unknown field(s) {sorted(unknown)}")
        if row.get("time") is not None:
            try:
                last_time = parse_time(row["time"])
            except (ValueError, OverflowError, OSError) as exc:
                raise JsonlError(f"{where}: bad time {row['time']!r}: {exc}") from exc
        conversation = str(row.get("conversation_id") or conversation_id)
        speaker, text = row.get("speaker"), row.get("text")
        try:
            yield ChatMessage(
                event_id="jl_" + digest(conversation, str(number), str(speaker), str(text)),
                user_id=user_id,
                event_time=last_time or ingest_time,
                ingest_time=ingest_time,
                conversation_id=conversation,
                speaker=speaker,
                text=text,
            )
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(p) for p in first["loc"]) or "<root>"
            raise JsonlError(f"{where}: {field}: {first['msg']}") from exc
