"""A forgotten message leaves no copy of its text on disk: not in the memory store, not in the gateway's outbox,
not in their WAL files, not in the full-text index, not in the logs, while everything is still running (SQLite
folds the WAL in when the last connection closes, which would hide a leftover)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import UTC, datetime
from pathlib import Path

import pytest

from memstream.runtime import Stack
from schemas.events import ChatMessage
from services.settings import Settings
from streams.gateway.client import GatewayClient

pytestmark = [pytest.mark.server, pytest.mark.slow]

SECRET_WORD = "Quuxenbergstrasse"
KEPT_WORD = "Lindenhof"


def files_holding(root: Path, needle: str) -> list[str]:
    """Every file under ``root`` whose bytes hold ``needle`` (any case: the index keeps terms folded)."""
    wanted = {needle.encode(), needle.lower().encode()}
    found = []
    for path in root.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            if any(w in data for w in wanted):
                found.append(str(path.relative_to(root)))
    return sorted(found)


def test_a_forgotten_message_is_in_no_file_of_the_data_directory(
    tmp_path: Path,
    settings_factory: Callable[..., Settings],
    admin_key_env: Callable[[Settings], AbstractContextManager[str]],
) -> None:
    settings = settings_factory(tmp_path / "data")
    stack = Stack(settings, settings.host, settings.port, workers=1, startup_timeout_s=60)
    asyncio.run(stack.start())
    try:
        with admin_key_env(settings), GatewayClient(stack.url) as client:
            now = datetime.now(UTC)
            secret = ChatMessage(
                event_id="m-secret", user_id="ana", event_time=now, speaker="Ana",
                text=f"I moved to the {SECRET_WORD} in Vienna with my sister.",
            )  # fmt: skip
            kept = ChatMessage(
                event_id="m-kept", user_id="ana", event_time=now, speaker="Ana",
                text=f"I work at the {KEPT_WORD} bakery.",
            )  # fmt: skip
            client.post_messages([secret, kept])
            deadline = time.monotonic() + 60
            while client.stats("ana")["events"] < 2:
                stack.check_children()
                assert time.monotonic() < deadline, "not memorized"
                time.sleep(0.2)  # poll interval of a deadline wait
            assert "memory.sqlite3" in "".join(files_holding(settings.data_dir, SECRET_WORD))  # it was there
            forget = client.forget("ana", "message", "m-secret")
            assert client.wait_forgotten(forget["forget_id"], 60)["status"] == "done"
            # the gateway purges its outbox when it reads the erasure: give it its deadline
            deadline = time.monotonic() + 30
            while (left := files_holding(settings.data_dir, SECRET_WORD)) and time.monotonic() < deadline:
                time.sleep(0.2)  # poll interval of a deadline wait
            assert left == []
            assert files_holding(settings.data_dir, KEPT_WORD)  # what was not forgotten is still there
    finally:
        stack.stop()
