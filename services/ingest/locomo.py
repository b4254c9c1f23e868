"""LoCoMo conversations: a list of samples, each with ``conversation.session_N`` turn lists and a
``session_N_date_time`` such as ``"1:56 pm on 8 May, 2023"``. Every turn of a session gets that time as its event
time (LoCoMo dates sessions, not turns); an image a speaker shared is kept as its caption."""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from schemas.events import ChatMessage

_SESSION = re.compile(r"^session_(\d+)$")
DATE_FORMAT = "%I:%M %p on %d %B, %Y"


class LocomoError(ValueError):
    pass


def parse_session_time(text: str) -> datetime:
    """``"1:56 pm on 8 May, 2023"`` -> an aware datetime (LoCoMo gives no zone: UTC)."""
    try:
        return datetime.strptime(" ".join(text.split()), DATE_FORMAT).replace(tzinfo=UTC)
    except ValueError as exc:
        raise LocomoError(f"unrecognised LoCoMo session time {text!r}") from exc


def is_locomo(data: Any) -> bool:
    first = data[0] if isinstance(data, list) and data else data
    return isinstance(first, dict) and isinstance(first.get("conversation"), dict)


def _turn_text(turn: dict[str, Any]) -> str:
    text = str(turn.get("text", "")).strip()
    caption = turn.get("blip_caption")
    if caption:
        text = f"{text} [shares a photo: {str(caption).strip()}]".strip()
    return text


def locomo_messages(
    data: Any, user_id: str, samples: set[str] | None = None, now: datetime | None = None
) -> Iterator[ChatMessage]:
    """Chat messages of every (or the selected) sample, session by session, turn by turn."""
    items = data if isinstance(data, list) else [data]
    ingest_time = now or datetime.now(UTC)
    for index, sample in enumerate(items):
        if not isinstance(sample, dict) or not isinstance(sample.get("conversation"), dict):
            raise LocomoError(f"sample #{index} has no 'conversation' object")
        sample_id = str(sample.get("sample_id") or f"sample-{index}")
        if samples and sample_id not in samples:
            continue
        conversation: dict[str, Any] = sample["conversation"]
        sessions = sorted((int(m.group(1)), key) for key in conversation if (m := _SESSION.match(key)))
        for number, key in sessions:
            when = parse_session_time(str(conversation.get(f"{key}_date_time", "")))
            for position, turn in enumerate(conversation[key] or []):
                text = _turn_text(turn)
                if not text:
                    continue
                turn_id = str(turn.get("dia_id") or f"S{number}:{position}")
                yield ChatMessage(
                    event_id=f"locomo:{sample_id}:{turn_id}".replace(" ", "_"),
                    user_id=user_id,
                    event_time=when,
                    ingest_time=ingest_time,
                    conversation_id=sample_id,
                    speaker=str(turn.get("speaker") or "unknown"),
                    text=text[:20_000],
                )
