"""Conversation loaders: LoCoMo JSON (the real dev file) and the JSONL chat format."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from services.ingest import LoaderError, load_conversation
from services.ingest.jsonl import jsonl_messages
from services.ingest.loaders import detect_format
from services.ingest.locomo import LocomoError, locomo_messages, parse_session_time

LOCOMO = Path(__file__).resolve().parents[2] / "shared" / "data" / "locomo" / "locomo_dev7.json"
NOW = datetime(2026, 1, 1, tzinfo=UTC)

needs_locomo = pytest.mark.skipif(not LOCOMO.is_file(), reason="LoCoMo dev file not present")


def test_parse_session_time() -> None:
    assert parse_session_time("1:56 pm on 8 May, 2023") == datetime(2023, 5, 8, 13, 56, tzinfo=UTC)
    assert parse_session_time("12:09 am on 13 September, 2023") == datetime(2023, 9, 13, 0, 9, tzinfo=UTC)
    with pytest.raises(LocomoError, match="unrecognised"):
        parse_session_time("yesterday")


@needs_locomo
def test_locomo_file_sessions_become_timed_messages_in_order() -> None:
    data = json.loads(LOCOMO.read_text())
    messages = load_conversation(LOCOMO, "alice")
    turns = sum(
        len(turns) for sample in data for key, turns in sample["conversation"].items() if isinstance(turns, list)
    )
    assert len(messages) == turns
    assert len({m.event_id for m in messages}) == len(messages)
    assert all(m.user_id == "alice" for m in messages)

    first = messages[0]
    conversation = data[0]["conversation"]
    assert first.conversation_id == data[0]["sample_id"]
    assert first.speaker == conversation["session_1"][0]["speaker"]
    assert first.text == conversation["session_1"][0]["text"]
    assert first.event_time == parse_session_time(conversation["session_1_date_time"])
    # every turn of session 2 carries session 2's time
    session_2 = [m for m in messages if m.conversation_id == first.conversation_id and ":D2:" in m.event_id]
    assert len(session_2) == len(conversation["session_2"])
    assert {m.event_time for m in session_2} == {parse_session_time(conversation["session_2_date_time"])}


@needs_locomo
def test_locomo_sample_filter_and_photo_captions() -> None:
    data = json.loads(LOCOMO.read_text())
    sample_id = data[1]["sample_id"]
    messages = load_conversation(LOCOMO, "bob", samples={sample_id})
    assert messages and {m.conversation_id for m in messages} == {sample_id}
    shared = [t for t in data[1]["conversation"]["session_1"] if t.get("blip_caption")]
    if shared:
        by_id = {m.event_id: m for m in messages}
        turn = shared[0]
        assert by_id[f"locomo:{sample_id}:{turn['dia_id']}"].text.endswith(f"[shares a photo: {turn['blip_caption']}]")


def test_locomo_single_sample_object_and_errors() -> None:
    sample = {
        "sample_id": "s1",
        "conversation": {
            "speaker_a": "A",
            "speaker_b": "B",
            "session_2_date_time": "9:00 am on 2 January, 2024",
            "session_2": [{"speaker": "B", "dia_id": "D2:1", "text": "later"}],
            "session_1_date_time": "8:00 am on 1 January, 2024",
            "session_1": [{"speaker": "A", "dia_id": "D1:1", "text": "first"}, {"speaker": "B", "text": " "}],
        },
    }
    messages = list(locomo_messages(sample, "u"))
    assert [m.text for m in messages] == ["first", "later"]  # sessions in number order, blank turns dropped
    with pytest.raises(LocomoError, match="no 'conversation'"):
        list(locomo_messages([{"qa": []}], "u"))


def test_jsonl_times_ids_and_conversations() -> None:
    lines = [
        json.dumps({"speaker": "Anna", "text": "no time yet"}),
        "",
        json.dumps({"speaker": "Anna", "text": "hello", "time": "2024-03-02T10:00:00Z"}),
        json.dumps({"speaker": "Ben", "text": "hi", "conversation_id": "other"}),
        json.dumps({"speaker": "Ben", "text": "naive time", "time": "2024-03-03T08:30:00"}),
    ]
    messages = list(jsonl_messages(lines, "alice", "chat", now=NOW))
    assert [m.event_time for m in messages] == [
        NOW,
        datetime(2024, 3, 2, 10, tzinfo=UTC),
        datetime(2024, 3, 2, 10, tzinfo=UTC),  # inherits the previous line's time
        datetime(2024, 3, 3, 8, 30, tzinfo=UTC),  # no zone: UTC
    ]
    assert [m.conversation_id for m in messages] == ["chat", "chat", "other", "chat"]
    again = list(jsonl_messages(lines, "alice", "chat"))
    assert [m.event_id for m in again] == [m.event_id for m in messages]  # ids do not depend on the ingest time
    assert len({m.event_id for m in messages}) == 4


@pytest.mark.parametrize(
    ("line", "error"),
    [
        ("{not json", "line-2: not valid JSON"),
        ('["a"]', "line-2: expected a JSON object"),
        ('{"speaker": "A"}', "line-2: text"),
        ('{"speaker": "A", "text": ""}', "line-2: text"),
        ('{"speaker": "A", "text": "x", "when": 1}', "unknown field"),
        ('{"speaker": "A", "text": "x", "time": "soon"}', "bad time"),
    ],
)
def test_jsonl_errors_name_the_line(line: str, error: str) -> None:
    lines = [json.dumps({"speaker": "A", "text": "ok"}), line]
    with pytest.raises(ValueError, match=error.replace("line-2", "f.jsonl:2")):
        list(jsonl_messages(lines, "u", source="f.jsonl"))


def test_load_conversation_detects_the_format(tmp_path: Path) -> None:
    chat = tmp_path / "chat.json"  # JSON lines in a .json file: detected by content
    chat.write_text(json.dumps({"speaker": "A", "text": "one"}) + "\n" + json.dumps({"speaker": "B", "text": "two"}))
    assert detect_format(chat) == "jsonl"
    assert [m.text for m in load_conversation(chat, "u")] == ["one", "two"]
    assert {m.conversation_id for m in load_conversation(chat, "u")} == {"chat"}

    pretty = tmp_path / "one.json"
    pretty.write_text(json.dumps({"sample_id": "x", "conversation": {}}, indent=2))
    assert detect_format(pretty) == "locomo"
    assert load_conversation(pretty, "u") == []

    with pytest.raises(LoaderError, match="no such file"):
        load_conversation(tmp_path / "missing.jsonl", "u")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"speaker": "A", "text": "ok"}\n{oops\n')
    with pytest.raises(LoaderError, match=r"broken.jsonl:2"):
        load_conversation(broken, "u")
    not_locomo = tmp_path / "list.json"
    not_locomo.write_text("[1, 2]")
    with pytest.raises(LoaderError, match="not a LoCoMo file"):
        load_conversation(not_locomo, "u")
