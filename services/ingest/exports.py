"""Chat history as the platforms export it, read into ``PlatformPost``s named as the live connectors name them.

- Slack: the workspace export (a ZIP: ``channels.json``, ``users.json`` and a folder per channel of one JSON file
  per day, each a list of messages). Messages carry their workspace in ``team``; ``--slack-team`` gives it where
  they do not. Bots' messages and notices (joins, topic changes) are skipped, as live.
- Telegram Desktop: "Export chat history" as machine-readable JSON (``result.json`` of one chat). The Bot API
  names a supergroup or channel ``-100<id>``, the export ``<id>``: mapped, so a message imported and received live
  is the same event.
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any

from services.ingest.platforms import (
    PlatformPost,
    slack_conversation,
    slack_key,
    telegram_conversation,
    telegram_key,
)

_SAID = {None, "thread_broadcast", "file_share", "me_message"}
_TELEGRAM_CHANNELS = {"private_supergroup", "public_supergroup", "private_channel", "public_channel"}


class ExportError(ValueError):
    """Not an export we can read; says where and why."""


def slack_export(path: Path, team: str | None = None) -> list[PlatformPost]:
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as exc:
        raise ExportError(f"{path}: not a Slack export ZIP ({exc})") from exc
    with archive:
        names = set(archive.namelist())
        channels = {c["name"]: c["id"] for c in _json(archive, "channels.json", names, []) if "name" in c}
        users = {u["id"]: _person(u) for u in _json(archive, "users.json", names, []) if "id" in u}
        posts = []
        for name in sorted(names):
            parts = PurePosixPath(name).parts
            if len(parts) != 2 or not parts[1].endswith(".json") or parts[0] not in channels:
                continue
            for message in _json(archive, name, names, []):
                post = _slack_post(message, team, channels[parts[0]], users, name)
                if post is not None:
                    posts.append(post)
    if not channels:
        raise ExportError(f"{path}: no channels.json: not a Slack workspace export")
    return sorted(posts, key=lambda p: p.when)


def _json(archive: zipfile.ZipFile, name: str, names: set[str], default: Any) -> Any:
    if name not in names:
        return default
    try:
        return json.loads(archive.read(name))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ExportError(f"{name} in the export is not JSON: {exc}") from exc


def _person(user: dict[str, Any]) -> str:
    profile = user.get("profile") or {}
    return str(user.get("real_name") or profile.get("real_name") or profile.get("display_name") or user["id"])


def _slack_post(message: Any, team: str | None, channel: str, users: dict[str, str], where: str) -> PlatformPost | None:
    if not isinstance(message, dict) or message.get("type") != "message":
        return None
    if message.get("subtype") not in _SAID or message.get("bot_id"):
        return None
    text = str(message.get("text") or "").strip()
    if not text:
        return None
    workspace = str(message.get("team") or team or "")
    if not workspace:
        raise ExportError(f"{where}: a message names no workspace (team): give --slack-team T...")
    ts = str(message.get("ts", ""))
    try:
        said = datetime.fromtimestamp(float(ts), tz=UTC)
    except ValueError as exc:
        raise ExportError(f"{where}: a message has no ts") from exc
    profile = message.get("user_profile") or {}
    speaker = str(profile.get("real_name") or users.get(str(message.get("user"))) or message.get("user") or "someone")
    version = str((message.get("edited") or {}).get("ts") or "")
    return PlatformPost(
        slack_key(workspace, channel, ts), slack_conversation(workspace, channel), speaker, text, said, version
    )


def telegram_export(path: Path) -> list[PlatformPost]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ExportError(f"{path}: not a Telegram Desktop JSON export ({exc})") from exc
    if not isinstance(data, dict) or not isinstance(data.get("messages"), list) or "id" not in data:
        raise ExportError(f"{path}: not a one-chat Telegram export (result.json with id and messages)")
    chat = str(data["id"])
    if data.get("type") in _TELEGRAM_CHANNELS and not chat.startswith("-"):
        chat = f"-100{chat}"  # how the Bot API names the same chat
    return [post for m in data["messages"] if (post := _telegram_post(m, chat)) is not None]


def _telegram_post(message: Any, chat: str) -> PlatformPost | None:
    if not isinstance(message, dict) or message.get("type") != "message":
        return None
    text = "".join(_texts(message.get("text"))).strip()
    if not text:
        return None
    try:
        said = datetime.fromtimestamp(int(message["date_unixtime"]), tz=UTC)
        version = str(int(message["edited_unixtime"])) if message.get("edited_unixtime") else ""
    except (KeyError, ValueError) as exc:
        raise ExportError(f"message {message.get('id')}: no date_unixtime (an export of an old Telegram?)") from exc
    speaker = str(message.get("from") or message.get("author") or "someone")
    key = telegram_key(chat, str(message.get("id", "")))
    return PlatformPost(key, telegram_conversation(chat), speaker, text, said, version)


def _texts(value: Any) -> Iterator[str]:
    """Telegram's text: a string, or a list of strings and entities ({"type": "link", "text": ...})."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for part in value:
            yield part if isinstance(part, str) else str((part or {}).get("text", ""))
