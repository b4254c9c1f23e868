"""Event contracts: validation at the edge, and the checked-in JSON Schemas match the models."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from pydantic import ValidationError

from schemas.events import CONTRACTS, ChatMessage, DeadLetter, Query
from schemas.export import JSON_DIR, render


def test_checked_in_json_schemas_match_the_models() -> None:
    rendered = render()
    on_disk = {p.name: p.read_text() for p in JSON_DIR.glob("*.schema.json")}
    assert set(on_disk) == set(rendered), "run: python -m schemas.export"
    for name, text in rendered.items():
        assert on_disk[name] == text, f"{name} drifted from the model: run python -m schemas.export"


def test_every_contract_has_version_and_ids() -> None:
    for name, model in CONTRACTS.items():
        fields = model.model_fields
        assert "schema_version" in fields and "event_id" in fields, name
        assert "user_id" in fields and "ingest_time" in fields, name


def test_chat_message_validation() -> None:
    now = datetime(2024, 1, 1, tzinfo=UTC)
    ok = ChatMessage(event_id="e1", user_id="u1", speaker="A", text="hi", event_time=now)
    assert ok.ingest_time.tzinfo is not None and ok.schema_version == 1
    with pytest.raises(ValidationError):
        ChatMessage(event_id="e1", user_id="u1", speaker="A", text="", event_time=now)
    with pytest.raises(ValidationError):  # naive datetimes are ambiguous
        ChatMessage(event_id="e1", user_id="u1", speaker="A", text="hi", event_time=datetime(2024, 1, 1))
    with pytest.raises(ValidationError):  # a tenant id cannot smuggle query syntax
        ChatMessage(event_id="e1", user_id='u1" OR 1=1', speaker="A", text="hi", event_time=now)
    with pytest.raises(ValidationError):
        ChatMessage.model_validate_json(ok.model_dump_json().replace('"schema_version":1', '"schema_version":2'))
    with pytest.raises(ValidationError):
        ChatMessage.model_validate({**ok.model_dump(), "surprise": 1})


def test_query_options_bounds() -> None:
    now = datetime(2024, 1, 1, tzinfo=UTC)
    with pytest.raises(ValidationError):
        Query.model_validate(
            {"event_id": "q", "user_id": "u", "event_time": now, "question": "?", "options": {"max_clue_queries": 9}}
        )


def test_dead_letter_keeps_payload() -> None:
    dl = DeadLetter(event_id="x", source_topic="t", reason="invalid_event", error="bad", payload="\x00garbage")
    assert DeadLetter.model_validate_json(dl.model_dump_json()).payload == "\x00garbage"
