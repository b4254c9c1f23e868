"""The extraction task: prompt, schema and parser, against recorded good and malformed model outputs."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from services import ids
from services.llm.scripted import ScriptedLLM
from services.llm.task import TaskFailed, TaskOutputError, load_json_object, run_task
from services.memorize.chunking import chunk_text
from services.memorize.extraction import ExtractionInput, ExtractTask, Item, KnownThesis

T = datetime(2023, 6, 2, tzinfo=UTC)
INPUT = ExtractionInput(
    items=[Item("Anna", "I moved to Berlin.", T), Item("Ben", "Cool!", T)],
    known=[KnownThesis("K1", "Anna lives in Paris.", T)],
)
GOOD = {
    "messages": [
        {
            "message": 1,
            "theses": [
                {
                    "text": "Anna moved to Berlin.",
                    "entities": ["Anna", "Berlin"],
                    "kind": "FACT",
                    "temporal": "DYNAMIC",
                    "replaces": ["K1", "K9"],
                }
            ],
            "triples": [{"subject": "Anna", "relation": "moved to", "object": "Berlin"}],
        },
        {"message": 2, "theses": [], "triples": []},
    ]
}


def test_parses_valid_output_and_drops_unknown_refs() -> None:
    out = ExtractTask().parse(json.dumps(GOOD), INPUT)
    thesis = out.messages[0].theses[0]
    assert thesis.replaces == ["K1"]  # K9 was never shown to the model
    assert out.messages[0].triples[0].relation == "moved to"


@pytest.mark.parametrize(
    "text",
    [
        "```json\n" + json.dumps(GOOD) + "\n```",
        "<think>hmm</think>" + json.dumps(GOOD),
        "Sure! " + json.dumps(GOOD) + " Hope it helps.",
    ],
)
def test_tolerates_fences_think_tags_and_chatter(text: str) -> None:
    assert len(ExtractTask().parse(text, INPUT).messages) == 2


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('{"messages": [{"message": 1, "theses": [', "not valid JSON"),  # cut off by the token limit
        ('{"msgs": []}', "schema violation at messages"),
        ('{"messages": [{"message": 3}]}', "do not exist"),
        ('{"messages": [{"message": 1, "theses": [{"text": "x", "kind": "FACT"}]}]}', "schema violation"),
        ('{"messages": [{"message": 1, "theses": [{"text": "Anna is here", "kind": "RUMOUR"}]}]}', "schema"),
        ("[]", "schema violation"),
    ],
)
def test_rejects_malformed_output(text: str, reason: str) -> None:
    with pytest.raises(TaskOutputError, match=reason):
        ExtractTask().parse(text, INPUT)


def test_schema_constrains_labels() -> None:
    schema = json.dumps(ExtractTask().json_schema())
    for label in ("FACT", "OPINION", "PREDICTION", "STATIC", "DYNAMIC", "ATEMPORAL"):
        assert label in schema


async def test_retries_invalid_output_then_succeeds_with_feedback() -> None:
    llm = ScriptedLLM()
    llm.queue("extract", "{not json", GOOD)
    result = await run_task(llm, ExtractTask(), INPUT, attempts=3)
    assert result.calls == 2
    retry_prompt = llm.calls[1].messages[-1].content
    assert "rejected" in retry_prompt and "not valid JSON" in retry_prompt


async def test_gives_up_after_bounded_attempts() -> None:
    llm = ScriptedLLM()
    llm.queue("extract", "nope", "still nope", "never")
    with pytest.raises(TaskFailed) as info:
        await run_task(llm, ExtractTask(), INPUT, attempts=3)
    assert info.value.attempts == 3 and len(llm.calls) == 3


def test_load_json_object_reports_position() -> None:
    with pytest.raises(TaskOutputError, match="at char"):
        load_json_object('{"a": }')


def test_ids_are_deterministic_per_user_and_normalised() -> None:
    assert ids.object_id("u1", "The  Eiffel_Tower") == ids.object_id("u1", "eiffel tower")
    assert ids.object_id("u1", "Berlin") != ids.object_id("u2", "Berlin")
    assert ids.thesis_id("u1", "Anna moved to Berlin.") == ids.thesis_id("u1", "anna moved to  berlin")
    assert ids.edge_id("u1", "relation", "a", "Lives In", "b") == ids.edge_id("u1", "relation", "a", "lives in", "b")
    assert ids.change_set_id("u", ["b", "a"]) == ids.change_set_id("u", ["a", "b"])


def test_chunking_respects_limits_and_keeps_text() -> None:
    text = "First paragraph. " * 30 + "\n\n" + "Second one is short."
    chunks = chunk_text(text, 200)
    assert all(len(c) <= 200 for c in chunks)
    assert " ".join(chunks).split() == text.split()
