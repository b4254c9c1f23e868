"""Answers back where the question was asked: a message addressed to the bot becomes a question, and its answer is
posted into the thread, then edited as its text streams (Slack ``chat.postMessage`` then ``chat.update``; Telegram
``sendMessage`` then ``editMessageText``), through the platforms' client libraries (``slack_sdk``,
``python-telegram-bot``).

Edits are at most one per ``UPDATE_EVERY_S`` (Slack's ``chat.update`` allows about 50 a minute, Telegram about one
edit a second per chat), and the last one is always the whole answer. A 429 is waited out as the platform says
(``Retry-After``; ``RetryAfter``), then tried again.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import Counter

from schemas.events import Query
from services.logging import get_logger
from streams.gateway.auth import Principal
from streams.gateway.questions import AnswerStreams

log = get_logger(__name__)

REPLIES = Counter("memstream_connector_replies_total", "Answers posted back to a platform", ["platform", "outcome"])

#: the least time between two edits of one answer
UPDATE_EVERY_S = 1.5
PLACEHOLDER = "…"


@dataclass(frozen=True)
class Thread:
    """Where to answer: a channel or chat, and the message or thread the question came in."""

    channel: str
    thread: str


class Replier(Protocol):
    platform: str

    async def post(self, where: Thread, text: str) -> str:
        """Post ``text`` as a reply in ``where``; returns the id to edit it by."""

    async def edit(self, where: Thread, message: str, text: str) -> None: ...

    async def close(self) -> None: ...


class SlackReplier:
    platform = "slack"

    def __init__(self, token: str, api_url: str) -> None:
        from slack_sdk.http_retry.builtin_async_handlers import AsyncRateLimitErrorRetryHandler
        from slack_sdk.web.async_client import AsyncWebClient

        self.client = AsyncWebClient(token=token, base_url=api_url)
        self.client.retry_handlers.append(AsyncRateLimitErrorRetryHandler(max_retry_count=3))
        self._names: dict[str, str | None] = {}

    async def name_of(self, user: str) -> str | None:
        """A Slack user's name (``users.info``, scope ``users:read``), once per user per gateway; None when Slack
        will not say (the message keeps the user id as its speaker)."""
        if user not in self._names:
            try:
                found = (await self.client.users_info(user=user))["user"]
            except Exception as exc:  # no scope, unknown user, Slack away: the id stands, said in the log
                log.warning("slack_user_name_unknown", user=user, error=repr(exc)[:200])
                return None  # not cached: the next message tries again
            profile = found.get("profile") or {}
            self._names[user] = found.get("real_name") or profile.get("real_name") or profile.get("display_name")
        return self._names[user]

    async def post(self, where: Thread, text: str) -> str:
        response = await self.client.chat_postMessage(channel=where.channel, thread_ts=where.thread, text=text)
        return str(response["ts"])

    async def edit(self, where: Thread, message: str, text: str) -> None:
        await self.client.chat_update(channel=where.channel, ts=message, text=text)

    async def close(self) -> None:
        return None  # the client opens a session per call


class TelegramReplier:
    platform = "telegram"

    def __init__(self, token: str, api_url: str) -> None:
        from telegram import Bot

        self.bot = Bot(token, base_url=api_url)
        self._ready = False

    async def _call(self, method: str, **kwargs: Any) -> Any:
        from telegram.error import RetryAfter

        if not self._ready:
            await self.bot.initialize()
            self._ready = True
        for attempt in range(3):
            try:
                return await getattr(self.bot, method)(**kwargs)
            except RetryAfter as exc:  # Telegram's 429: wait as long as it says, then again
                if attempt == 2:
                    raise
                wait = exc.retry_after
                await asyncio.sleep(wait.total_seconds() if hasattr(wait, "total_seconds") else float(wait))
        raise AssertionError("unreachable")

    async def post(self, where: Thread, text: str) -> str:
        from telegram import ReplyParameters

        sent = await self._call(
            "send_message", chat_id=where.channel, text=text, reply_parameters=ReplyParameters(int(where.thread))
        )
        return str(sent.message_id)

    async def edit(self, where: Thread, message: str, text: str) -> None:
        await self._call("edit_message_text", text=text, chat_id=where.channel, message_id=int(message))

    async def close(self) -> None:
        if self._ready:
            await self.bot.shutdown()


async def answer_back(streams: AnswerStreams, replier: Replier, query: Query, where: Thread) -> None:
    """Post a placeholder in ``where``, edit it as the answer's text streams, end with the whole answer."""
    reader = Principal(f"connector:{replier.platform}", frozenset({query.user_id}), frozenset({"read"}))
    outcome = "failed"
    try:
        message = await replier.post(where, PLACEHOLDER)
        shown, pending, last = PLACEHOLDER, PLACEHOLDER, 0.0
        async for update in streams.follow(query.query_id, reader):
            if update.kind == "text":
                pending = update.data["text"] or PLACEHOLDER
            elif update.kind == "answer":
                pending, outcome = _final(update.data), update.data.get("status", "answered")
            elif update.kind != "wait":
                pending, outcome = f"(no answer: {update.kind})", update.kind
            now = time.monotonic()
            final = update.kind not in ("text", "wait")
            if pending != shown and (final or now - last >= UPDATE_EVERY_S):
                await replier.edit(where, message, pending)
                shown, last = pending, now
            if final:
                break
    except Exception as exc:  # the platform refused or is away: said in the log and the metric, not raised
        log.error("answer_back_failed", platform=replier.platform, query_id=query.query_id, error=repr(exc))
    REPLIES.labels(replier.platform, outcome).inc()


def _final(answer: dict[str, Any]) -> str:
    status = answer.get("status")
    if status == "answered":
        return str(answer.get("answer") or "")
    if status == "no_answer":
        return str(answer.get("answer") or "I found nothing about that in memory.")
    return f"(the question could not be answered: {answer.get('error') or status})"
