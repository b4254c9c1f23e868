"""Telegram bot webhook: https://core.telegram.org/bots/api#setwebhook

Verified by the ``X-Telegram-Bot-Api-Secret-Token`` header (the ``secret_token`` given to ``setWebhook``),
compared in constant time. ``message`` and ``channel_post`` become chat messages (chat -> conversation and, by
configuration, memstream user; the sender -> speaker; ``date`` -> the time), ``edited_message`` and
``edited_channel_post`` are edits (``edit_date`` the version). A redelivered update has the same ``update_id``.
The Bot API tells a bot of deletions only for business chats (``deleted_business_messages``): those are forgotten.
Bots' messages are skipped.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Mapping
from typing import Any

from services.ingest.platforms import telegram_conversation, telegram_key
from streams.gateway.connectors.base import Delete, Mapped, Places, Post, Question, Refused, no_places, user_for, when

_NEW = ("message", "channel_post", "business_message")
#: a command to the bot: /ask, or /ask@TheBot in a group
_ASK = re.compile(r"^/ask(?:@\w+)?(?:\s+|$)")
_EDITED = ("edited_message", "edited_channel_post", "edited_business_message")


class TelegramConnector:
    platform = "telegram"

    def __init__(
        self, secret_token: str, user: str | None, chats: Mapping[str, str], places: Places = no_places
    ) -> None:
        self.places = places
        self.secret = secret_token.encode()
        self.user = user
        self.chats = dict(chats)

    def verify(self, headers: Mapping[str, str], body: bytes, now: float) -> None:
        given = headers.get("x-telegram-bot-api-secret-token")
        if not given:
            raise Refused(401, "unsigned", "send X-Telegram-Bot-Api-Secret-Token (the webhook's secret_token)")
        if not hmac.compare_digest(given.encode(), self.secret):
            raise Refused(401, "bad_signature", "the secret token does not match")

    def map(self, payload: Any) -> Mapped:
        if not isinstance(payload, dict) or not isinstance(payload.get("update_id"), int):
            raise Refused(400, "malformed", "a Telegram update is a JSON object with an integer update_id")
        delivery = f"update:{payload['update_id']}"
        for kind in (*_NEW, *_EDITED):
            message = payload.get(kind)
            if isinstance(message, dict) and kind in _NEW and (question := self._question(message)) is not None:
                return Mapped(questions=[question], delivery_id=delivery)
            if isinstance(message, dict):
                post = self._post(message, edited=kind in _EDITED)
                ignored = None if post else "bot or no text"
                return Mapped(posts=[post] if post else [], ignored=ignored, delivery_id=delivery)
        deleted = payload.get("deleted_business_messages")
        if isinstance(deleted, dict):
            chat = str((deleted.get("chat") or {}).get("id", ""))
            user = user_for("telegram", chat, self.chats, self.user, self.places)
            ids = [str(i) for i in deleted.get("message_ids") or []]
            return Mapped(deletes=[Delete(_key(chat, i), user) for i in ids], delivery_id=delivery)
        return Mapped(ignored="no message in the update", delivery_id=delivery)

    def _question(self, message: dict[str, Any]) -> Question | None:
        """``/ask ...`` (or ``/ask@bot ...``), or a reply to the bot's message: a question, not conversation."""
        text = str(message.get("text") or "").strip()
        replied = (message.get("reply_to_message") or {}).get("from") or {}
        command = _ASK.match(text)
        if command is None and not replied.get("is_bot"):
            return None
        asked = text[command.end() :].strip() if command else text
        chat = str((message.get("chat") or {}).get("id", ""))
        user = user_for("telegram", chat, self.chats, self.user, self.places)
        if not asked or (message.get("from") or {}).get("is_bot"):
            return None
        try:
            said = when(message["date"])
        except (KeyError, TypeError, ValueError) as exc:
            raise Refused(400, "malformed", "a Telegram message needs date") from exc
        message_id = str(message.get("message_id", ""))
        return Question(_key(chat, message_id), user, asked, said, chat, message_id)

    def _post(self, message: dict[str, Any], edited: bool) -> Post | None:
        chat = message.get("chat") or {}
        chat_id = str(chat.get("id", ""))
        user = user_for("telegram", chat_id, self.chats, self.user, self.places)
        sender = message.get("from") or {}
        if sender.get("is_bot"):
            return None
        text = str(message.get("text") or message.get("caption") or "").strip()
        if not text:
            return None
        name = " ".join(str(sender.get(k)) for k in ("first_name", "last_name") if sender.get(k))
        speaker = name or sender.get("username") or message.get("author_signature") or chat.get("title") or "someone"
        try:
            said = when(message["date"])
            version = str(int(message["edit_date"])) if edited else ""
        except (KeyError, TypeError, ValueError) as exc:
            raise Refused(400, "malformed", "a Telegram message needs date (and edit_date when edited)") from exc
        key = _key(chat_id, str(message.get("message_id", "")))
        return Post(key, telegram_conversation(chat_id), str(speaker), text, said, version, user)


def _key(chat: str, message_id: str) -> str:
    if not chat or not message_id:
        raise Refused(400, "malformed", "a Telegram message needs chat.id and message_id")
    return telegram_key(chat, message_id)
