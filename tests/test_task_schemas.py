"""Every LLM task's output schema is one the local grammar takes whole: no construct it ignores or rejects.

llama.cpp's converter logged "pattern ... is not supported" for the old extraction schema on every call, so
decoding never enforced it. These tests walk each schema the tasks send (per-call schemas included), reject the
keywords the converters do not enforce, and convert each with the in-process runtime's own converter.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest

from services.llm.task import LLMTask
from services.memorize.entity_task import NamePair, SameEntityTask
from services.memorize.extraction import ExtractionInput, ExtractTask, Item
from services.memorize.resolve import Pair, ResolveTask
from services.memorize.resolve_check import CheckTask
from services.qa.simple import AnswerTask

T = datetime(2023, 6, 2, tzinfo=UTC)
#: Keywords a grammar converter may skip (llama.cpp: "not supported") or Ollama's copy may crash on.
UNENFORCED = {"pattern", "patternProperties", "format", "not", "if", "then", "else", "dependentSchemas"}


def _qa_tasks() -> list[tuple[LLMTask[Any, Any], Any]]:
    from tests.test_qa_tasks import TASKS, _sample_inputs

    return [(task, _sample_inputs(name)) for name, (task, _) in TASKS.items()]


def _cases() -> list[tuple[str, dict[str, Any]]]:
    items = [Item("Anna", 'I said "hi" \\ to Ben.', T), Item("Doc", "Text.", T, document=True)]
    extraction = ExtractionInput(items=items)
    cases: list[tuple[str, dict[str, Any]]] = [
        ("extract", ExtractTask().json_schema(extraction)),
        ("extract-static", ExtractTask().json_schema()),
        ("resolve", ResolveTask().json_schema([Pair("a", T, "b", T)])),
        ("resolve_check", CheckTask().json_schema([Pair("a", T, "b", T), Pair("c", T, "d", T)])),
        ("same_entity", SameEntityTask().json_schema([NamePair("Mel", "Mel ran.", "Melanie", "Melanie ran.")])),
        ("answer", AnswerTask().json_schema()),
    ]
    cases += [(task.name, task.json_schema(inputs)) for task, inputs in _qa_tasks()]
    return cases


def _keywords(node: Any) -> set[str]:
    found: set[str] = set()
    if isinstance(node, dict):
        for key, value in node.items():
            if key != "properties":
                found.add(key)
            found |= _keywords(value)
    elif isinstance(node, list):
        for value in node:
            found |= _keywords(value)
    return found


@pytest.mark.parametrize(("name", "schema"), _cases(), ids=[n for n, _ in _cases()])
def test_schema_uses_only_enforced_keywords(name: str, schema: dict[str, Any]) -> None:
    assert not (_keywords(schema) & UNENFORCED), f"{name} uses {_keywords(schema) & UNENFORCED}"


@pytest.mark.parametrize(("name", "schema"), _cases(), ids=[n for n, _ in _cases()])
def test_schema_converts_with_the_local_runtime(name: str, schema: dict[str, Any]) -> None:
    xllamacpp = pytest.importorskip("xllamacpp")
    grammar = xllamacpp.json_schema_to_grammar(json.dumps(schema))
    assert grammar and "not supported" not in grammar
