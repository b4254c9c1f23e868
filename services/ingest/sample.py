"""A tiny built-in conversation for `memstream up --demo`."""

from __future__ import annotations

from datetime import UTC, datetime

from schemas.events import ChatMessage

DEMO_USER = "demo"
DEMO_QUESTION = "Where does Anna work now?"

_TURNS = [
    ("2024-03-02T10:00:00", "Anna", "Hi Ben! I just started my new job as a nurse at St. Mary's hospital."),
    ("2024-03-02T10:01:00", "Ben", "Congrats Anna! Didn't you work at Siemens before?"),
    ("2024-03-02T10:02:00", "Anna", "Yes, I quit Siemens in February. I also adopted a cat called Miso."),
    ("2024-03-02T10:03:00", "Ben", "Nice! I'm still in Munich, training for the Berlin marathon in September."),
]


def demo_messages(user_id: str = DEMO_USER) -> list[ChatMessage]:
    return [
        ChatMessage(
            event_id=f"demo:{n}",
            user_id=user_id,
            event_time=datetime.fromisoformat(when).replace(tzinfo=UTC),
            conversation_id="demo",
            speaker=speaker,
            text=text,
        )
        for n, (when, speaker, text) in enumerate(_TURNS, start=1)
    ]
