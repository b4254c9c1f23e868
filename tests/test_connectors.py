"""Messaging connectors: payloads in the shapes Slack, Telegram and the generic webhook document, signed with test
secrets. Unit tests verify and map; the gateway tests post them to the real gateway over the embedded broker and
read what lands on the chat topic; the stack test runs a worker and reads memory after an edit and a deletion."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from memstream.broker import EmbeddedBroker
from memstream.runtime import Stack
from schemas.events import ChatMessage, Forget
from services.adapters.minilm import MiniLMEmbedder
from services.adapters.sqlite import SqliteMemoryStore
from services.settings import Settings
from streams.gateway.app import create_app
from streams.gateway.connectors.base import CONNECTOR_REQUESTS, Mapped, Post, Refused, VersionBook, operations
from streams.gateway.connectors.slack import SlackConnector
from streams.gateway.connectors.telegram import TelegramConnector
from streams.gateway.connectors.webhook import WebhookConnector, sign
from streams.topics import TopicNames
from tests.conftest import make_settings

SLACK_SECRET = "8f742231b10e8888abcd99yyyzzz85a5"
TELEGRAM_SECRET = "tg-secret-token_123"
WEBHOOK_SECRET = "webhook-key"
TEAM, CHANNEL = "T0001", "C0001"


# -- payloads as the platforms send them ----------------------------------------------------------------------------


def slack_signed(body: bytes, ts: int | None = None, secret: str = SLACK_SECRET) -> dict[str, str]:
    stamp = str(int(time.time()) if ts is None else ts)
    mac = hmac.new(secret.encode(), f"v0:{stamp}:".encode() + body, hashlib.sha256).hexdigest()
    return {"X-Slack-Request-Timestamp": stamp, "X-Slack-Signature": f"v0={mac}", "Content-Type": "application/json"}


def slack_event(event: dict[str, Any], event_id: str = "Ev01", team: str = TEAM) -> dict[str, Any]:
    return {
        "token": "unused",
        "team_id": team,
        "api_app_id": "A01",
        "event": event,
        "type": "event_callback",
        "event_id": event_id,
        "event_time": 1714564800,
    }


def slack_message(text: str, ts: str = "1714564800.000100", user: str = "U01", **extra: Any) -> dict[str, Any]:
    return {"type": "message", "channel": CHANNEL, "user": user, "text": text, "ts": ts, "event_ts": ts, **extra}


def slack_changed(text: str, ts: str, edited_ts: str, previous: str) -> dict[str, Any]:
    return {
        "type": "message",
        "subtype": "message_changed",
        "channel": CHANNEL,
        "hidden": True,
        "ts": edited_ts,
        "event_ts": edited_ts,
        "message": {
            "type": "message",
            "user": "U01",
            "text": text,
            "ts": ts,
            "edited": {"user": "U01", "ts": edited_ts},
        },
        "previous_message": {"type": "message", "user": "U01", "text": previous, "ts": ts},
    }


def slack_deleted(ts: str, deleted_at: str) -> dict[str, Any]:
    return {
        "type": "message",
        "subtype": "message_deleted",
        "channel": CHANNEL,
        "hidden": True,
        "ts": deleted_at,
        "deleted_ts": ts,
        "event_ts": deleted_at,
        "previous_message": {"type": "message", "user": "U01", "text": "gone", "ts": ts},
    }


def telegram_update(update_id: int, text: str, message_id: int = 7, edit_date: int | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {
        "message_id": message_id,
        "from": {"id": 111, "is_bot": False, "first_name": "Ana", "last_name": "Lima", "username": "ana"},
        "chat": {"id": -100200, "title": "Family", "type": "supergroup"},
        "date": 1714564800,
        "text": text,
    }
    if edit_date is not None:
        message["edit_date"] = edit_date
    return {"update_id": update_id, ("edited_message" if edit_date else "message"): message}


def body_of(payload: Any) -> bytes:
    return json.dumps(payload).encode()


# -- verification and mapping -----------------------------------------------------------------------------------------


def slack() -> SlackConnector:
    return SlackConnector(SLACK_SECRET, "ana", {"T0002": "ben"})


def test_slack_verifies_its_v0_signature_within_the_replay_window() -> None:
    body = body_of(slack_event(slack_message("hi")))
    now = time.time()
    slack().verify({k.lower(): v for k, v in slack_signed(body).items()}, body, now)
    for headers, reason in (
        (slack_signed(body, secret="wrong"), "bad_signature"),
        (slack_signed(body, ts=int(now) - 301), "stale"),
        (slack_signed(body, ts=int(now) + 301), "stale"),
        ({}, "unsigned"),
    ):
        with pytest.raises(Refused) as refused:
            slack().verify({k.lower(): v for k, v in headers.items()}, body, now)
        assert (refused.value.status, refused.value.reason) == (401, reason)
    tampered = body.replace(b"hi", b"ho")
    with pytest.raises(Refused, match="signature"):
        slack().verify({k.lower(): v for k, v in slack_signed(body).items()}, tampered, now)


def test_slack_maps_messages_edits_deletions_and_skips_bots_and_notices() -> None:
    mapped = slack().map(slack_event(slack_message("I moved to Lisbon.", user_profile={"real_name": "Ana Lima"})))
    (post,) = mapped.posts
    assert post.event_id == f"slack:{TEAM}:{CHANNEL}:1714564800.000100" and post.user_id == "ana"
    assert post.speaker == "Ana Lima" and post.conversation_id == f"slack:{TEAM}:{CHANNEL}"
    assert post.when == datetime(2024, 5, 1, 12, 0, 0, 100, tzinfo=UTC) and mapped.delivery_id == "Ev01"
    edit = slack().map(slack_event(slack_changed("I moved to Porto.", "1714564800.000100", "1714565000.000200", "x")))
    assert edit.posts[0].event_id == f"slack:{TEAM}:{CHANNEL}:1714564800.000100:v1714565000.000200"
    gone = slack().map(slack_event(slack_deleted("1714564800.000100", "1714566000.000300")))
    assert gone.deletes[0].key == f"slack:{TEAM}:{CHANNEL}:1714564800.000100"
    assert slack().map(slack_event(slack_message("beep", bot_id="B01"))).posts == []
    assert slack().map(slack_event(slack_message("joined", subtype="channel_join"))).ignored == "subtype channel_join"
    assert slack().map(slack_event(slack_message("hi"), team="T0002")).posts[0].user_id == "ben"
    assert slack().map({"type": "url_verification", "challenge": "abc"}).response == {"challenge": "abc"}
    with pytest.raises(Refused) as unmapped:
        SlackConnector(SLACK_SECRET, None, {}).map(slack_event(slack_message("hi")))
    assert (unmapped.value.status, unmapped.value.reason) == (403, "unmapped")


def test_telegram_checks_its_secret_token_and_maps_messages_and_edits() -> None:
    connector = TelegramConnector(TELEGRAM_SECRET, "ana", {})
    connector.verify({"x-telegram-bot-api-secret-token": TELEGRAM_SECRET}, b"{}", time.time())
    for headers, reason in (({}, "unsigned"), ({"x-telegram-bot-api-secret-token": "nope"}, "bad_signature")):
        with pytest.raises(Refused) as refused:
            connector.verify(headers, b"{}", time.time())
        assert refused.value.reason == reason
    (post,) = connector.map(telegram_update(1, "We adopted a dog.")).posts
    assert post.event_id == "telegram:-100200:7" and post.speaker == "Ana Lima" and post.version == ""
    (edited,) = connector.map(telegram_update(2, "We adopted two dogs.", edit_date=1714565000)).posts
    assert edited.event_id == "telegram:-100200:7:v1714565000"
    bot = telegram_update(3, "I am a bot")
    bot["message"]["from"]["is_bot"] = True
    assert connector.map(bot).posts == []
    with pytest.raises(Refused) as unmapped:
        TelegramConnector(TELEGRAM_SECRET, None, {"-1": "x"}).map(telegram_update(4, "hi"))
    assert unmapped.value.status == 403


def test_the_webhook_checks_its_hmac_and_replay_window() -> None:
    connector = WebhookConnector(WEBHOOK_SECRET, "ana")
    body = body_of({"messages": []})
    now = int(time.time())
    good = {"x-memstream-timestamp": str(now), "x-memstream-signature": sign(WEBHOOK_SECRET, str(now), body)}
    connector.verify(good, body, now)
    stale = {
        "x-memstream-timestamp": str(now - 600),
        "x-memstream-signature": sign(WEBHOOK_SECRET, str(now - 600), body),
    }
    for headers, reason in (
        (stale, "stale"),
        ({**good, "x-memstream-signature": sign("other", str(now), body)}, "bad_signature"),
        ({}, "unsigned"),
    ):
        with pytest.raises(Refused) as refused:
            connector.verify(headers, body, now)
        assert refused.value.reason == reason
    with pytest.raises(Refused, match=r"messages\.0\.text"):
        connector.map({"messages": [{"id": "1", "speaker": "Ana", "time": "2024-05-01T12:00:00Z"}]})


async def test_an_edit_forgets_the_version_memory_holds_and_a_repeat_changes_nothing(tmp_path: Path) -> None:
    versions = VersionBook(tmp_path / "v.sqlite3")
    when = datetime(2024, 5, 1, tzinfo=UTC)
    first = Post("slack:T:C:1", "slack:T:C", "Ana", "I live in Berln.", when, user_id="ana")
    ops = await operations("slack", Mapped(posts=[first]), versions)
    assert [type(e).__name__ for e in ops.events] == ["ChatMessage"]
    await versions.set(first.key, first.event_id)
    assert (await operations("slack", Mapped(posts=[first]), versions)).events == []  # a retry, an import
    edit = Post("slack:T:C:1", "slack:T:C", "Ana", "I live in Berlin.", when, version="9", user_id="ana")
    ops = await operations("slack", Mapped(posts=[edit]), versions)
    forget, message = ops.events
    assert isinstance(forget, Forget) and forget.target == "slack:T:C:1" and forget.scope == "message"
    assert isinstance(message, ChatMessage) and message.event_id == "slack:T:C:1:v9" and message.platform == "slack"
    again = await operations("slack", Mapped(posts=[edit]), versions)
    assert again.events[0].event_id == forget.event_id  # the same edit redelivered: the same forget id
    versions.close()


# -- through the gateway, onto the topic ----------------------------------------------------------------------------


@pytest.fixture
def connected(tmp_path: Path, broker: EmbeddedBroker) -> Iterator[tuple[TestClient, Settings]]:
    settings = make_settings(
        tmp_path,
        slack_signing_secret=SLACK_SECRET,
        slack_user="ana",
        telegram_secret_token=TELEGRAM_SECRET,
        telegram_user="ana",
        webhook_secret=WEBHOOK_SECRET,
        webhook_user="ana",
        max_body_bytes=64 * 1024,
    )
    with TestClient(create_app(settings, broker.bootstrap)) as client:
        yield client, settings


def chat_topic(broker: EmbeddedBroker, settings: Settings, count: int) -> list[ChatMessage | Forget]:
    from tests.test_gateway import read_topic

    records = asyncio.run(read_topic(broker.bootstrap, TopicNames.from_settings(settings).chat, count))
    events: list[ChatMessage | Forget] = []
    for key, value in records:
        assert key == b"ana"
        data = json.loads(value)
        events.append(Forget.model_validate(data) if data["kind"] == "forget" else ChatMessage.model_validate(data))
    return events


@pytest.mark.server
def test_slack_through_the_gateway(connected: tuple[TestClient, Settings], broker: EmbeddedBroker) -> None:
    client, settings = connected

    def post(payload: Any, **headers: str) -> Any:
        body = body_of(payload)
        return client.post("/v1/connectors/slack/events", content=body, headers={**slack_signed(body), **headers})

    challenge = post({"type": "url_verification", "challenge": "3eZbrw1aB"})
    assert challenge.status_code == 200 and challenge.json() == {"challenge": "3eZbrw1aB"}
    said = slack_event(slack_message("I work at Siemens."), event_id="Ev1")
    assert post(said).json() == {"ok": True, "messages": 1, "forgotten": 0, "asked": 0}
    assert post(said, **{"X-Slack-Retry-Num": "1", "X-Slack-Retry-Reason": "http_timeout"}).json()["duplicate"]
    edit = slack_event(slack_changed("I work at Bosch.", "1714564800.000100", "1714565000.000200", "x"), "Ev2")
    assert post(edit).json() == {"ok": True, "messages": 1, "forgotten": 1, "asked": 0}
    assert post(slack_event(slack_deleted("1714564800.000100", "1714566000.000300"), "Ev3")).json()["forgotten"] == 1
    base = f"slack:{TEAM}:{CHANNEL}:1714564800.000100"
    events = chat_topic(broker, settings, 4)
    assert [(type(e).__name__, getattr(e, "target", None) or e.event_id) for e in events] == [
        ("ChatMessage", base),
        ("Forget", base),
        ("ChatMessage", f"{base}:v1714565000.000200"),
        ("Forget", f"{base}:v1714565000.000200"),
    ]
    # refused: nothing stored, each counted
    counted = {
        why: CONNECTOR_REQUESTS.labels("slack", why)._value.get() for why in ("bad_signature", "stale", "unsigned")
    }
    body = body_of(slack_event(slack_message("not me"), event_id="Ev9"))
    bad = client.post("/v1/connectors/slack/events", content=body, headers=slack_signed(body, secret="x"))
    stale = client.post("/v1/connectors/slack/events", content=body, headers=slack_signed(body, ts=1))
    unsigned = client.post("/v1/connectors/slack/events", content=body)
    assert [bad.status_code, stale.status_code, unsigned.status_code] == [401, 401, 401]
    assert all(CONNECTOR_REQUESTS.labels("slack", why)._value.get() == n + 1 for why, n in counted.items())
    other = body_of(slack_event(slack_message("hi"), team="T-unknown"))
    settings_no_default = client.post("/v1/connectors/slack/events", content=other, headers=slack_signed(other))
    assert settings_no_default.status_code == 200  # the one-workspace setting takes every team it is sent
    malformed = b'{"type": "event_callback", '
    assert (
        client.post("/v1/connectors/slack/events", content=malformed, headers=slack_signed(malformed)).status_code
        == 400
    )
    huge = body_of(slack_event(slack_message("x" * 70_000)))
    assert client.post("/v1/connectors/slack/events", content=huge, headers=slack_signed(huge)).status_code == 413


@pytest.mark.server
def test_telegram_and_the_webhook_through_the_gateway(
    connected: tuple[TestClient, Settings], broker: EmbeddedBroker
) -> None:
    client, settings = connected
    secret = {"X-Telegram-Bot-Api-Secret-Token": TELEGRAM_SECRET}
    first = telegram_update(10, "We adopted a dog called Rex.")
    assert client.post("/v1/connectors/telegram", json=first, headers=secret).json()["messages"] == 1
    assert client.post("/v1/connectors/telegram", json=first, headers=secret).json()["duplicate"]  # redelivered
    edited = telegram_update(11, "We adopted a dog called Max.", edit_date=1714565000)
    assert client.post("/v1/connectors/telegram", json=edited, headers=secret).json()["forgotten"] == 1
    assert client.post("/v1/connectors/telegram", json=first, headers={}).status_code == 401
    assert (
        client.post("/v1/connectors/telegram", json=first, headers={"X-Telegram-Bot-Api-Secret-Token": "x"}).status_code
        == 401
    )

    now = str(int(time.time()))
    payload = {
        "source": "crm",
        "messages": [{"id": "42", "speaker": "Ben", "text": "Ben runs.", "time": "2024-05-01T12:00:00Z"}],
    }
    body = body_of(payload)
    headers = {"X-Memstream-Timestamp": now, "X-Memstream-Signature": sign(WEBHOOK_SECRET, now, body)}
    assert client.post("/v1/connectors/webhook", content=body, headers=headers).json()["messages"] == 1
    assert (
        client.post(
            "/v1/connectors/webhook", content=body, headers={**headers, "X-Memstream-Timestamp": "1"}
        ).status_code
        == 401
    )
    events = chat_topic(broker, settings, 4)
    assert [getattr(e, "target", None) or e.event_id for e in events] == [
        "telegram:-100200:7",
        "telegram:-100200:7",
        "telegram:-100200:7:v1714565000",
        "webhook:crm:42",
    ]


@pytest.mark.server
def test_an_unconfigured_connector_has_no_route(tmp_path: Path, broker: EmbeddedBroker) -> None:
    with TestClient(create_app(make_settings(tmp_path), broker.bootstrap)) as client:
        assert client.post("/v1/connectors/slack/events", json={}).status_code == 404


# -- memory after an edit and a deletion -----------------------------------------------------------------------------


@pytest.mark.server
@pytest.mark.slow
def test_memory_after_an_edit_holds_the_new_text_only_and_after_a_deletion_nothing(
    tmp_path: Path,
    settings_factory: Callable[..., Settings],
    admin_key_env: Callable[[Settings], AbstractContextManager[str]],
) -> None:
    settings = settings_factory(tmp_path, slack_signing_secret=SLACK_SECRET, slack_user="ana")
    stack = Stack(settings, settings.host, settings.port, workers=1, startup_timeout_s=60)
    asyncio.run(stack.start())
    try:
        import httpx

        with admin_key_env(settings) as key, httpx.Client(base_url=stack.url, timeout=30) as http:
            admin = {"authorization": f"Bearer {key}"}

            def post(event: dict[str, Any], event_id: str) -> None:
                body = body_of(slack_event(event, event_id))
                response = http.post("/v1/connectors/slack/events", content=body, headers=slack_signed(body))
                assert response.status_code == 200, response.text

            def theses() -> list[str]:
                async def read() -> list[str]:
                    async with await SqliteMemoryStore.open(settings.store_path, dim=MiniLMEmbedder.dim) as store:
                        return sorted(v.text for v in await store.stores().graph.valid_theses("ana", limit=100))

                return asyncio.run(read())

            def settle(condition: Callable[[], bool], what: str) -> None:
                deadline = time.monotonic() + 60
                while not condition():
                    stack.check_children()
                    assert time.monotonic() < deadline, what
                    time.sleep(0.2)  # poll interval of a deadline wait

            post(slack_message("I just started my new job as a nurse at St. Mary's hospital."), "Ev1")
            settle(lambda: any("St. Mary" in t for t in theses()), "the message memorized")
            edit = slack_changed(
                "I just started my new job as a nurse at Mercy hospital.",
                "1714564800.000100",
                "1714565000.000200",
                "I just started my new job as a nurse at St. Mary's hospital.",
            )
            post(edit, "Ev2")
            settle(lambda: any("Mercy" in t for t in theses()), "the edit memorized")
            assert not any("St. Mary" in t for t in theses())  # no second copy, no old version
            assert http.get("/v1/stats/ana", headers=admin).json()["events"] == 1
            post(slack_deleted("1714564800.000100", "1714566000.000300"), "Ev3")
            settle(lambda: theses() == [], "the deletion applied")
            assert http.get("/v1/stats/ana", headers=admin).json()["events"] == 0
    finally:
        stack.stop()


def test_questions_to_the_bot_are_questions_not_conversation() -> None:
    mention = {"type": "app_mention", "user": "U01", "text": "<@U0BOT|mem> Where does Ana work?", "channel": CHANNEL}
    mention |= {"ts": "1714564800.000100", "thread_ts": "1714564000.000001"}
    (question,) = slack().map(slack_event(mention)).questions
    assert (question.text, question.channel, question.thread) == ("Where does Ana work?", CHANNEL, "1714564000.000001")
    assert question.query().query_id == question.query().query_id  # a retry asks the same query
    telegram = TelegramConnector(TELEGRAM_SECRET, "ana", {})
    asked = telegram.map(telegram_update(20, "/ask@mem_bot where do we live?", message_id=30))
    assert asked.posts == [] and asked.questions[0].text == "where do we live?" and asked.questions[0].thread == "30"
    reply = telegram_update(21, "and the dog's name?", message_id=31)
    reply["message"]["reply_to_message"] = {"message_id": 30, "from": {"id": 1, "is_bot": True, "first_name": "Mem"}}
    assert telegram.map(reply).questions[0].text == "and the dog's name?"
    assert telegram.map(telegram_update(22, "/start", message_id=32)).questions == []  # other commands: said


@pytest.mark.server
def test_more_workspaces_map_to_users_through_the_key_file(tmp_path: Path, broker: EmbeddedBroker) -> None:
    """No one-workspace user: a team maps to a user only once an admin says so, beside the API keys."""
    from tests.conftest import api_key

    settings = make_settings(tmp_path, slack_signing_secret=SLACK_SECRET)
    admin = {"authorization": f"Bearer {api_key(settings)}"}
    writer = {"authorization": f"Bearer {api_key(settings, ['ben'], ['write'])}"}
    body = body_of(slack_event(slack_message("I moved to Lisbon."), team="T0777"))
    with TestClient(create_app(settings, broker.bootstrap)) as client:
        assert client.post("/v1/connectors/slack/events", content=body, headers=slack_signed(body)).status_code == 403
        assert (
            client.put("/v1/connector-places/slack/T0777", json={"user_id": "ben"}, headers=writer).status_code == 403
        )
        mapped = client.put("/v1/connector-places/slack/T0777", json={"user_id": "ben"}, headers=admin)
        assert mapped.status_code == 200
        assert client.get("/v1/connector-places", headers=admin).json() == {"places": {"slack:T0777": "ben"}}
        taken = client.post("/v1/connectors/slack/events", content=body, headers=slack_signed(body))
        assert taken.status_code == 200 and taken.json()["messages"] == 1
        assert client.delete("/v1/connector-places/slack/T0777", headers=admin).status_code == 200
        other = body_of(slack_event(slack_message("again", ts="1714564999.000100"), team="T0777", event_id="Ev8"))
        assert client.post("/v1/connectors/slack/events", content=other, headers=slack_signed(other)).status_code == 403
