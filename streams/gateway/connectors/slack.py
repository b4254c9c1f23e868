"""Slack Events API: https://api.slack.com/apis/events-api

Verified with ``slack_sdk``'s ``SignatureVerifier`` (the ``v0`` HMAC over ``v0:<timestamp>:<raw body>`` with the
app's signing secret), the timestamp within the replay window. ``url_verification`` is answered with its challenge.
``message`` events become chat messages (workspace -> memstream user, channel -> conversation, the author ->
speaker, ``ts`` -> the time); ``message_changed`` is an edit, ``message_deleted`` a deletion; bots' messages and
notices (joins, topic changes) are skipped. A retry (``X-Slack-Retry-Num``) carries the same ``event_id``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from slack_sdk.signature import SignatureVerifier

from services.ingest.platforms import slack_conversation, slack_key
from streams.gateway.connectors.base import Delete, Mapped, Places, Post, Question, Refused, no_places, user_for, when

#: how Slack names a person by id (``U...``, ``W...`` in Enterprise Grid)
SLACK_USER_ID = re.compile(r"[UW][A-Z0-9]{2,}")
#: message subtypes that are someone saying something (others are notices: joins, topic changes, ...)
_SAID = {None, "thread_broadcast", "file_share", "me_message"}


class SlackConnector:
    platform = "slack"

    def __init__(
        self,
        signing_secret: str,
        user: str | None,
        workspaces: Mapping[str, str],
        window_s: int = 300,
        places: Places = no_places,
    ) -> None:
        self.places = places
        self.verifier = SignatureVerifier(signing_secret)
        self.user = user
        self.workspaces = dict(workspaces)
        self.window_s = window_s

    def verify(self, headers: Mapping[str, str], body: bytes, now: float) -> None:
        stamp = headers.get("x-slack-request-timestamp")
        signature = headers.get("x-slack-signature")
        if not stamp or not signature:
            raise Refused(401, "unsigned", "send X-Slack-Request-Timestamp and X-Slack-Signature")
        if not stamp.isdigit() or abs(now - int(stamp)) > self.window_s:
            raise Refused(401, "stale", f"the request timestamp is outside the {self.window_s} s replay window")
        if not self.verifier.is_valid(body, stamp, signature):
            raise Refused(401, "bad_signature", "the Slack signature does not match the signing secret")

    def map(self, payload: Any) -> Mapped:
        if not isinstance(payload, dict):
            raise Refused(400, "malformed", "a Slack request is a JSON object")
        kind = payload.get("type")
        if kind == "url_verification":
            return Mapped(response={"challenge": str(payload.get("challenge", ""))})
        if kind != "event_callback" or not isinstance(payload.get("event"), dict):
            return Mapped(ignored=f"type {kind}")
        team = str(payload.get("team_id") or "")
        user = user_for("slack", team, self.workspaces, self.user, self.places)
        event = payload["event"]
        delivery = str(payload.get("event_id") or "") or None
        if event.get("type") == "app_mention":
            # a question to the bot, answered back in its thread; the message event of the same post (sent too,
            # when the app is in the channel) memorizes what was said
            return Mapped(questions=_question(team, user, event), delivery_id=delivery)
        if event.get("type") != "message":
            return Mapped(ignored=f"event {event.get('type')}", delivery_id=delivery)
        channel = str(event.get("channel") or "")
        subtype = event.get("subtype")
        if subtype == "message_deleted":
            deleted = str(event.get("deleted_ts") or (event.get("previous_message") or {}).get("ts") or "")
            return Mapped(deletes=[Delete(_key(team, channel, deleted), user)], delivery_id=delivery)
        if subtype == "message_changed":
            message = event.get("message") or {}
            edit = str((message.get("edited") or {}).get("ts") or event.get("event_ts") or "")
            post = _post(team, channel, user, message, edit)
            return Mapped(posts=[post] if post else [], ignored=None if post else "bot or empty", delivery_id=delivery)
        if subtype not in _SAID:
            return Mapped(ignored=f"subtype {subtype}", delivery_id=delivery)
        post = _post(team, channel, user, event, "")
        return Mapped(posts=[post] if post else [], ignored=None if post else "bot or empty", delivery_id=delivery)


_MENTION = re.compile(r"<@[A-Z0-9]+(?:\|[^>]*)?>")


def _question(team: str, user: str, event: dict[str, Any]) -> list[Question]:
    text = _MENTION.sub("", str(event.get("text") or "")).strip()
    channel, ts = str(event.get("channel") or ""), str(event.get("ts") or "")
    if not text or not channel or not ts:
        return []
    thread = str(event.get("thread_ts") or ts)
    return [Question(_key(team, channel, ts), user, text, when(ts), channel, thread)]


def _key(team: str, channel: str, ts: str) -> str:
    if not (team and channel and ts):
        raise Refused(400, "malformed", "a Slack message needs team_id, channel and ts")
    return slack_key(team, channel, ts)


def _post(team: str, channel: str, user: str, message: dict[str, Any], version: str) -> Post | None:
    """A person's message as a ``Post``; None for a bot's or one without text."""
    if message.get("bot_id") or message.get("subtype") == "bot_message":
        return None
    text = str(message.get("text") or "").strip()
    if not text:
        return None
    profile = message.get("user_profile") or {}
    speaker = str(profile.get("real_name") or profile.get("display_name") or message.get("user") or "someone")
    ts = str(message.get("ts") or "")
    try:
        said = when(ts)
    except ValueError as exc:
        raise Refused(400, "malformed", f"a Slack ts is seconds.micro, not {ts!r}") from exc
    return Post(_key(team, channel, ts), slack_conversation(team, channel), speaker, text, said, version, user)
