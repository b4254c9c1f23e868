"""A generic signed webhook, for any other source.

Signed like Slack's, with a key of its own: ``X-Memstream-Timestamp`` (Unix seconds) and
``X-Memstream-Signature: v1=<hex HMAC-SHA256 of "<timestamp>." + raw body>``; a timestamp outside the replay
window is refused. The body:

    {"source": "crm", "messages": [{"id": "42", "conversation": "ticket-7", "speaker": "Ana", "text": "...",
      "time": "2024-05-01T12:00:00Z", "edited_at": "2024-05-01T12:05:00Z"}], "deleted": ["41"]}

``id`` names a message across edits (``edited_at`` is the version); ``deleted`` forgets messages by id.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from pydantic import BaseModel, Field, ValidationError

from streams.gateway.connectors.base import Delete, Mapped, Post, Refused

SIGNATURE_HEADER = "x-memstream-signature"
TIMESTAMP_HEADER = "x-memstream-timestamp"


def sign(secret: str, timestamp: str, body: bytes) -> str:
    """The signature header's value for ``body`` sent at ``timestamp`` (a sender's side, and the tests')."""
    mac = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256)
    return "v1=" + mac.hexdigest()


class _Message(BaseModel):
    id: str = Field(min_length=1, max_length=120, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:@/+=-]*$")
    conversation: str = Field(default="default", min_length=1, max_length=60, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:@-]*$")
    speaker: str
    text: str
    time: datetime
    edited_at: datetime | None = None


class _Body(BaseModel):
    source: str = Field(default="webhook", min_length=1, max_length=40, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    messages: list[_Message] = Field(default_factory=list, max_length=1000)
    deleted: list[str] = Field(default_factory=list, max_length=1000)


class WebhookConnector:
    platform = "webhook"

    def __init__(self, secret: str, user: str, window_s: int = 300) -> None:
        self.secret = secret
        self.user = user
        self.window_s = window_s

    def verify(self, headers: Mapping[str, str], body: bytes, now: float) -> None:
        stamp, signature = headers.get(TIMESTAMP_HEADER), headers.get(SIGNATURE_HEADER)
        if not stamp or not signature:
            raise Refused(401, "unsigned", "send X-Memstream-Timestamp and X-Memstream-Signature")
        if not stamp.isdigit() or abs(now - int(stamp)) > self.window_s:
            raise Refused(401, "stale", f"the request timestamp is outside the {self.window_s} s replay window")
        if not hmac.compare_digest(signature, sign(self.secret, stamp, body)):
            raise Refused(401, "bad_signature", "the signature does not match")

    def map(self, payload: Any) -> Mapped:
        try:
            body = _Body.model_validate(payload)
        except ValidationError as exc:
            first = exc.errors(include_url=False)[0]
            where = ".".join(str(p) for p in first["loc"])
            raise Refused(400, "malformed", f"invalid webhook body: {where}: {first['msg']}") from exc
        prefix = f"webhook:{body.source}"
        posts = [
            Post(
                f"{prefix}:{m.id}",
                f"{prefix}:{m.conversation}",
                m.speaker,
                m.text,
                m.time,
                "" if m.edited_at is None else str(int(m.edited_at.timestamp())),
                self.user,
            )
            for m in body.messages
        ]
        return Mapped(posts=posts, deletes=[Delete(f"{prefix}:{d}", self.user) for d in body.deleted])
