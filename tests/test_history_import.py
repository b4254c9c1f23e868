"""History import: a Slack workspace export (ZIP) and a Telegram Desktop export (result.json), read into the same
message names the live connectors use, sent with `memstream ingest` through /v1/imports: a message received live
and imported is memorized once, an export holding a newer edit replaces the live version."""

from __future__ import annotations

import contextlib
import json
import zipfile
from pathlib import Path
from typing import Any

import pytest

from memstream.broker import EmbeddedBroker
from schemas.events import ChatMessage, Forget
from services.ingest.exports import ExportError, slack_export, telegram_export
from services.settings import Settings
from streams.gateway.app import create_app
from tests.conftest import api_key, make_settings
from tests.test_connectors import (
    CHANNEL,
    SLACK_SECRET,
    TEAM,
    TELEGRAM_SECRET,
    body_of,
    chat_topic,
    slack_event,
    slack_message,
    slack_signed,
)
from tests.test_gateway_forget import run_cli, served

TS = "1714564800.000100"


def slack_zip(path: Path, messages: list[dict[str, Any]]) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("channels.json", json.dumps([{"id": CHANNEL, "name": "general"}, {"id": "C9", "name": "x"}]))
        archive.writestr("users.json", json.dumps([{"id": "U01", "real_name": "Ana Lima", "profile": {}}]))
        archive.writestr("general/2024-05-01.json", json.dumps(messages))
    return path


def exported(text: str, ts: str = TS, **extra: Any) -> dict[str, Any]:
    return {"type": "message", "user": "U01", "text": text, "ts": ts, "team": TEAM, **extra}


def test_a_slack_export_reads_as_the_live_connector_names_its_messages(tmp_path: Path) -> None:
    path = slack_zip(
        tmp_path / "export.zip",
        [
            exported("I moved to Lisbon."),
            exported("Now in Porto.", ts="1714564900.000200", edited={"user": "U01", "ts": "1714565000.000300"}),
            exported("joined", ts="1714564950.0", subtype="channel_join"),
            {"type": "message", "bot_id": "B1", "text": "beep", "ts": "1714564960.0", "team": TEAM},
        ],
    )
    first, edited = slack_export(path)
    assert first.event_id == f"slack:{TEAM}:{CHANNEL}:{TS}" and first.speaker == "Ana Lima"
    assert first.conversation_id == f"slack:{TEAM}:{CHANNEL}"
    assert edited.event_id == f"slack:{TEAM}:{CHANNEL}:1714564900.000200:v1714565000.000300"
    (tmp_path / "bad.zip").write_bytes(b"not a zip")
    with pytest.raises(ExportError, match="not a Slack export"):
        slack_export(tmp_path / "bad.zip")
    no_team = slack_zip(tmp_path / "no-team.zip", [{"type": "message", "user": "U01", "text": "hi", "ts": TS}])
    with pytest.raises(ExportError, match="--slack-team"):
        slack_export(no_team)
    assert slack_export(no_team, team="T7")[0].key == f"slack:T7:{CHANNEL}:{TS}"


def test_a_telegram_export_maps_a_supergroup_to_the_bot_api_chat_id(tmp_path: Path) -> None:
    path = tmp_path / "result.json"
    export = {
        "name": "Family",
        "type": "private_supergroup",
        "id": 200,
        "messages": [
            {"id": 7, "type": "message", "date_unixtime": "1714564800", "from": "Ana Lima", "text": "We got a dog."},
            {
                "id": 8,
                "type": "message",
                "date_unixtime": "1714564900",
                "edited_unixtime": "1714565000",
                "from": "Ana Lima",
                "text": ["See ", {"type": "link", "text": "rex.example"}, " for photos."],
            },
            {"id": 9, "type": "service", "action": "pin_message", "date_unixtime": "1714564950"},
        ],
    }
    path.write_text(json.dumps(export))
    first, second = telegram_export(path)
    assert first.event_id == "telegram:-100200:7" and first.conversation_id == "telegram:-100200"
    assert second.text == "See rex.example for photos." and second.event_id == "telegram:-100200:8:v1714565000"


@pytest.mark.server
def test_import_and_live_memorize_a_message_once_and_a_newer_edit_replaces_it(
    tmp_path: Path, broker: EmbeddedBroker
) -> None:
    settings: Settings = make_settings(
        tmp_path / "data",
        slack_signing_secret=SLACK_SECRET,
        slack_user="ana",
        telegram_secret_token=TELEGRAM_SECRET,
        telegram_user="ana",
    )
    key = api_key(settings, ["ana"], ["write"])
    export = slack_zip(
        tmp_path / "export.zip",
        [
            exported("I moved to Lisbon."),  # received live below too
            # live saw "I work at Siemens." under this ts; the export holds its later edit
            exported("I work at Bosch.", ts="1714564900.000200", edited={"user": "U01", "ts": "1714565000.000300"}),
        ],
    )
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(served(create_app(settings, broker.bootstrap)))
        import httpx

        http = stack.enter_context(httpx.Client(base_url=url, timeout=30))
        for n, (text, ts) in enumerate((("I moved to Lisbon.", TS), ("I work at Siemens.", "1714564900.000200"))):
            body = body_of(slack_event(slack_message(text, ts=ts), event_id=f"Ev{n}"))
            assert http.post("/v1/connectors/slack/events", content=body, headers=slack_signed(body)).status_code == 200
        done = run_cli("ingest", str(export), "--user", "ana", "--url", url, "--key", key)
        assert "1 new, 1 already in memory, 1 older versions replaced" in done.output
        again = run_cli("ingest", str(export), "--user", "ana", "--url", url, "--key", key)
        assert "0 new, 2 already in memory, 0 older versions replaced" in again.output
        other = api_key(settings, ["ben"], ["write"])
        refused = run_cli("ingest", str(export), "--user", "ana", "--url", url, "--key", other, code=1)
        assert "403" in refused.output
    events = chat_topic(broker, settings, 4)
    base = f"slack:{TEAM}:{CHANNEL}:1714564900.000200"
    assert [(type(e).__name__, getattr(e, "target", None) or e.event_id) for e in events] == [
        ("ChatMessage", f"slack:{TEAM}:{CHANNEL}:{TS}"),
        ("ChatMessage", base),
        ("Forget", base),
        ("ChatMessage", f"{base}:v1714565000.000300"),
    ]
    assert isinstance(events[2], Forget) and isinstance(events[3], ChatMessage)
