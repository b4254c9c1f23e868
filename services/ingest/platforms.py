"""How a platform message is named in memstream, shared by the live connectors (``streams/gateway/connectors``) and
the history import (``services/ingest/exports.py``): the same message, live or imported, is the same event."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime


@dataclass(frozen=True)
class PlatformPost:
    """One version of a platform message: ``key`` names it across edits, ``version`` is "" as first sent, else the
    edit's stamp (Slack: the edit's ts; Telegram: its Unix edit date)."""

    key: str
    conversation_id: str
    speaker: str
    text: str
    when: datetime
    version: str = ""

    @property
    def event_id(self) -> str:
        return self.key if not self.version else f"{self.key}:v{self.version}"


def slack_key(team: str, channel: str, ts: str) -> str:
    return f"slack:{team}:{channel}:{ts}"


def slack_conversation(team: str, channel: str) -> str:
    return f"slack:{team}:{channel}"


def telegram_key(chat: str, message_id: str) -> str:
    return f"telegram:{chat}:{message_id}"


def telegram_conversation(chat: str) -> str:
    return f"telegram:{chat}"
