"""Questions asked in Slack and Telegram are answered back in their thread, the answer edited in as it streams.

The whole stack runs (embedded broker, a worker with the rule-based scripted LLM writing answers a few characters
at a time, the gateway); the platforms' APIs are local stand-ins that check each request the way the platform
documents it (method, token, required fields) and record it; no network is reached. Slack's stand-in answers the
first ``chat.update`` with a 429 and ``Retry-After``: the client waits and sends it again.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qs

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from memstream.runtime import Stack
from schemas.events import ChatMessage
from services.settings import Settings
from streams.gateway.client import GatewayClient
from tests.test_connectors import (
    CHANNEL,
    SLACK_SECRET,
    TEAM,
    TELEGRAM_SECRET,
    body_of,
    slack_event,
    slack_signed,
)
from tests.test_gateway_forget import served

pytestmark = [pytest.mark.server, pytest.mark.slow]

SLACK_BOT = "xoxb-test-token"
TELEGRAM_BOT = "123456:TEST-token"
CHAT = -100200


class StandIn:
    """Slack's and Telegram's Web APIs as far as answering back uses them; ``calls`` in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.lock = threading.Lock()
        self.limited = False
        self.app = FastAPI()
        self.app.post("/slack/api/{method}")(self.slack)
        self.app.get("/slack/api/{method}")(self.slack)  # slack_sdk reads (users.info) with GET
        self.app.post("/telegram/bot{token}/{method}")(self.telegram)

    async def _fields(self, request: Request) -> dict[str, Any]:
        if request.method == "GET":
            return dict(request.query_params)
        raw = await request.body()
        if request.headers.get("content-type", "").startswith("application/json"):
            data: dict[str, Any] = json.loads(raw or b"{}")
            return data
        return {k: v[0] for k, v in parse_qs(raw.decode()).items()}

    async def slack(self, method: str, request: Request) -> Any:
        if request.headers.get("authorization") != f"Bearer {SLACK_BOT}":
            return JSONResponse({"ok": False, "error": "invalid_auth"})
        fields = await self._fields(request)
        if method == "users.info":  # documented: the user id in ``user``; the answer's user has real_name
            with self.lock:
                self.calls.append((f"slack:{method}", fields))
            if fields.get("user") != "U0ANNA":
                return JSONResponse({"ok": False, "error": "user_not_found"})
            return {
                "ok": True,
                "user": {"id": "U0ANNA", "real_name": "Anna Lima", "profile": {"real_name": "Anna Lima"}},
            }
        needed = {"chat.postMessage": {"channel", "text"}, "chat.update": {"channel", "ts", "text"}}.get(method)
        if needed is None or not needed <= set(fields):
            return JSONResponse({"ok": False, "error": "invalid_arguments"})
        if method == "chat.update" and not self.limited:
            self.limited = True  # Slack's rate limit: 429 with Retry-After, documented for Tier 3 methods
            return JSONResponse({"ok": False, "error": "ratelimited"}, status_code=429, headers={"Retry-After": "1"})
        with self.lock:
            self.calls.append((f"slack:{method}", fields))
        return {"ok": True, "channel": fields["channel"], "ts": fields.get("ts", "1714570000.000100")}

    async def telegram(self, token: str, method: str, request: Request) -> Any:
        if token != TELEGRAM_BOT:
            return JSONResponse({"ok": False, "error_code": 401, "description": "Unauthorized"}, status_code=401)
        fields = await self._fields(request)
        if method == "getMe":
            return {"ok": True, "result": {"id": 123456, "is_bot": True, "first_name": "Mem", "username": "mem_bot"}}
        needed = {"sendMessage": {"chat_id", "text"}, "editMessageText": {"chat_id", "message_id", "text"}}.get(method)
        if needed is None or not needed <= set(fields):
            return JSONResponse({"ok": False, "error_code": 400, "description": "Bad Request"}, status_code=400)
        with self.lock:
            self.calls.append((f"telegram:{method}", fields))
        message = {
            "message_id": int(fields.get("message_id", 99)),
            "date": int(time.time()),
            "chat": {"id": int(fields["chat_id"]), "type": "supergroup", "title": "Family"},
            "text": fields["text"],
        }
        return {"ok": True, "result": message}

    def of(self, prefix: str) -> list[tuple[str, dict[str, Any]]]:
        with self.lock:
            return [(m, f) for m, f in self.calls if m.startswith(prefix)]


@pytest.fixture(scope="module")
def world(
    tmp_path_factory: pytest.TempPathFactory,
    settings_factory: Callable[..., Settings],
    admin_key_env: Callable[[Settings], AbstractContextManager[str]],
) -> Iterator[tuple[Stack, StandIn]]:
    stand_in = StandIn()
    with served(stand_in.app) as api:
        settings = settings_factory(
            tmp_path_factory.mktemp("replies"),
            scripted_llm="tests.test_answer_stream_stack:streaming_llm",
            slack_signing_secret=SLACK_SECRET,
            slack_user="ana",
            slack_bot_token=SLACK_BOT,
            slack_api_url=f"{api}/slack/api/",
            telegram_secret_token=TELEGRAM_SECRET,
            telegram_user="ana",
            telegram_bot_token=TELEGRAM_BOT,
            telegram_api_url=f"{api}/telegram/bot",
        )
        stack = Stack(settings, settings.host, settings.port, workers=1, startup_timeout_s=60)
        asyncio.run(stack.start())
        try:
            with admin_key_env(settings), GatewayClient(stack.url) as client:
                text = "I just started my new job as a nurse at St. Mary's hospital."
                said = ChatMessage(
                    event_id="r-1", user_id="ana", event_time=datetime.now(UTC), speaker="Anna", text=text
                )
                client.post_messages([said])
                wait_until(lambda: client.stats("ana")["events"] >= 1, "memorized", stack)
            yield stack, stand_in
        finally:
            stack.stop()


def wait_until(condition: Callable[[], bool], what: str, stack: Stack, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        stack.check_children()
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s}s"
        time.sleep(0.1)  # poll interval of a deadline wait


def test_a_slack_mention_is_answered_in_its_thread_and_edited_as_it_streams(world: tuple[Stack, StandIn]) -> None:
    stack, stand_in = world
    ts = f"{time.time():.6f}"  # asked now: the question reads memory as it holds at the time it was asked
    mention = {
        "type": "app_mention",
        "user": "U01",
        "text": "<@U0BOT> Where does Anna work now?",
        "ts": ts,
        "channel": CHANNEL,
        "event_ts": ts,
    }
    body = body_of(slack_event(mention, event_id="EvQ1"))
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        answered = http.post("/v1/connectors/slack/events", content=body, headers=slack_signed(body))
        assert answered.status_code == 200 and answered.json()["asked"] == 1
        retried = http.post(
            "/v1/connectors/slack/events", content=body, headers={**slack_signed(body), "X-Slack-Retry-Num": "1"}
        )
        assert retried.json().get("duplicate")  # Slack's retry asks nothing twice

    def finished() -> bool:
        updates = stand_in.of("slack:chat.update")
        return bool(updates) and "St. Mary's hospital" in updates[-1][1]["text"]

    wait_until(finished, "the answer edited into the thread", stack)
    calls = stand_in.of("slack:")
    posted = calls[0]
    assert posted[0] == "slack:chat.postMessage"
    assert posted[1]["channel"] == CHANNEL and posted[1]["thread_ts"] == ts
    assert all(m == "slack:chat.update" and f["ts"] == "1714570000.000100" for m, f in calls[1:])
    assert stand_in.limited  # the 429 was met and waited out
    assert TEAM  # the workspace the mention came from maps to ana


def test_a_telegram_ask_command_is_answered_as_a_reply(world: tuple[Stack, StandIn]) -> None:
    stack, stand_in = world
    update = {
        "update_id": 501,
        "message": {
            "message_id": 42,
            "from": {"id": 111, "is_bot": False, "first_name": "Ana"},
            "chat": {"id": CHAT, "title": "Family", "type": "supergroup"},
            "date": int(time.time()),
            "text": "/ask@mem_bot Where does Anna work these days?",
        },
    }
    headers = {"X-Telegram-Bot-Api-Secret-Token": TELEGRAM_SECRET}
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        asked = http.post("/v1/connectors/telegram", json=update, headers=headers)
        assert asked.status_code == 200 and asked.json()["asked"] == 1 and asked.json()["messages"] == 0

    def finished() -> bool:
        edits = stand_in.of("telegram:editMessageText")
        return bool(edits) and "St. Mary's hospital" in edits[-1][1]["text"]

    wait_until(finished, "the answer edited into the reply", stack)
    sent = stand_in.of("telegram:sendMessage")[0][1]
    assert int(sent["chat_id"]) == CHAT and json.loads(sent["reply_parameters"])["message_id"] == 42


def test_a_slack_message_without_a_profile_is_memorized_under_its_authors_name(world: tuple[Stack, StandIn]) -> None:
    from services.adapters.minilm import MiniLMEmbedder
    from services.adapters.sqlite import SqliteMemoryStore

    stack, stand_in = world
    ts = f"{time.time():.6f}"
    said = {"type": "message", "channel": CHANNEL, "user": "U0ANNA", "text": "I adopted a cat called Miso.", "ts": ts}
    body = body_of(slack_event(said, event_id="EvName"))
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        assert http.post("/v1/connectors/slack/events", content=body, headers=slack_signed(body)).status_code == 200

    def theses() -> list[str]:
        async def read() -> list[str]:
            async with await SqliteMemoryStore.open(stack.settings.store_path, dim=MiniLMEmbedder.dim) as store:
                return [v.name for v in await store.stores().graph.valid_theses("ana", limit=100)]

        return asyncio.run(read())

    wait_until(lambda: any("Miso" in t for t in theses()), "the message memorized", stack)
    assert any("Anna Lima" in t and "Miso" in t for t in theses()), theses()
    assert ("slack:users.info", {"user": "U0ANNA"}) in [(m, {"user": f.get("user")}) for m, f in stand_in.calls]
