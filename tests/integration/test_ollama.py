"""The Ollama adapters on a real Ollama server serving the small real model (Qwen2.5-Coder 0.5B) and all-MiniLM.

Built as the services build them (``services.llm.factory``): JSON-schema ``format``, thinking off, the adapter's
timeout, bounded retries in the layers. A 0.5B model's wording is not checked; its structure and facts are.
"""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import REGISTRY
from pydantic import BaseModel

from services.adapters.minilm import MiniLMEmbedder
from services.adapters.ollama import OllamaLLM
from services.backends import BackendUnavailable
from services.llm.factory import build_embedder, build_llm
from services.llm.layers import RetryingLLM
from services.llm.task import LLMTask, run_task
from services.ports import LLMMessage, LLMRequest
from services.settings import Settings

pytestmark = [pytest.mark.server, pytest.mark.slow]


def settings(ollama: tuple[str, str, str], tmp_path: Path, **overrides: object) -> Settings:
    host, model, embed = ollama
    values: dict[str, object] = {
        "data_dir": tmp_path,
        "llm": "ollama",
        "llm_model": model,
        "ollama_host": host,
        "embedder": "ollama",
        "embed_model": embed,
        "llm_timeout_s": 240.0,
        "llm_retries": 1,
        "llm_context": 2048,
        **overrides,
    }
    return Settings(_env_file=None, **values)  # type: ignore[arg-type]


class Person(BaseModel):
    name: str
    age: int
    city: str


class PersonTask(LLMTask[Person, Person]):
    name = "person"
    output_model = Person
    max_tokens = 80

    def messages(self, inputs: Any) -> list[LLMMessage]:
        return [
            LLMMessage(role="system", content="Extract the person as JSON with name, age and city."),
            LLMMessage(role="user", content=str(inputs)),
        ]


def test_the_chat_model_has_a_chat_template(ollama: tuple[str, str, str]) -> None:
    host, model, _ = ollama
    shown = httpx.post(f"{host}/api/show", json={"model": model}, timeout=30).json()
    template = shown.get("template", "")
    # without one, Ollama sends the last message as raw text: the system prompt is lost and a chat model rambles
    assert template.strip() != "{{ .Prompt }}" and ".Messages" in template, (
        f"{model} has no chat template ({template!r}): create it with a TEMPLATE for its chat format (ChatML)"
    )


async def test_json_schema_output_through_the_layers(ollama: tuple[str, str, str], tmp_path: Path) -> None:
    llm = build_llm(settings(ollama, tmp_path))
    try:
        result = await run_task(llm, PersonTask(), "Maria Lopez, 34, lives in Valencia and works as a nurse.")
    finally:
        await llm.close()
    assert isinstance(result.value, Person)  # validated against the schema by the task
    assert result.value.age == 34 and "Maria" in result.value.name and "Valencia" in result.value.city
    assert result.tokens_out > 0


async def test_a_pattern_in_the_schema_does_not_crash_the_runner(ollama: tuple[str, str, str]) -> None:
    host, model, _ = ollama
    # Ollama 0.17.4 turns "\d" in a pattern into a grammar it cannot parse and its runner dies (SIGSEGV); the
    # adapter rewrites the pattern, so the request is answered and the constraint still holds
    schema = {
        "type": "object",
        "properties": {"refs": {"type": "array", "items": {"type": "string", "pattern": r"^K\d+$"}, "maxItems": 4}},
        "required": ["refs"],
    }
    request = LLMRequest(
        task="refs",
        messages=[LLMMessage(role="user", content="Return the references K1 and K22 as JSON.")],
        json_schema=schema,
        max_tokens=40,
    )
    llm = OllamaLLM(model, host=host, stall_timeout_s=240)
    try:
        response = await llm.complete(request)
    finally:
        await llm.close()
    refs = json.loads(response.text)["refs"]
    assert all(re.fullmatch(r"K\d+", ref) for ref in refs)
    assert "<think>" not in response.text and llm.think in (False, None)  # thinking stays off


async def test_timeouts_are_bounded_and_the_server_recovers(ollama: tuple[str, str, str], tmp_path: Path) -> None:
    host, model, _ = ollama
    essay = LLMRequest(
        task="essay", messages=[LLMMessage(role="user", content="Write a long essay about rivers.")], max_tokens=400
    )
    retries = REGISTRY.get_sample_value("memstream_llm_retries_total", {"model": model, "task": "essay"}) or 0.0
    slow = RetryingLLM(OllamaLLM(model, host=host, stall_timeout_s=240), attempts=2, timeout_s=0.5, backoff_s=0.1)
    started = time.monotonic()
    with pytest.raises(BackendUnavailable) as raised:  # the LLM call site's policy gave up
        await slow.complete(essay)
    assert isinstance(raised.value.__cause__, TimeoutError) and raised.value.attempts == 2
    assert time.monotonic() - started < 5  # two attempts of half a second, one short pause
    assert REGISTRY.get_sample_value("memstream_llm_retries_total", {"model": model, "task": "essay"}) == retries + 1
    await slow.close()

    # the abandoned generations do not wedge the server: the next request is answered
    llm = build_llm(settings(ollama, tmp_path))
    try:
        hello = LLMRequest(task="hello", messages=[LLMMessage(role="user", content="Say hello.")], max_tokens=8)
        assert (await llm.complete(hello)).text
    finally:
        await llm.close()


async def test_embeddings_match_the_in_process_minilm(ollama: tuple[str, str, str], tmp_path: Path) -> None:
    embedder = build_embedder(settings(ollama, tmp_path))
    texts = ["Anna works as a nurse at St. Mary's hospital.", "Ben trains for the Berlin marathon."]
    remote = await embedder.embed(texts)
    local = await MiniLMEmbedder().embed(texts)
    assert embedder.dim == 384 and all(len(v) == 384 for v in remote)
    assert all(math.isclose(sum(x * x for x in v), 1.0, abs_tol=1e-4) for v in remote)
    for a, b in zip(remote, local, strict=True):
        assert sum(x * y for x, y in zip(a, b, strict=True)) > 0.99  # same model, int8 here vs f32 there
    close = getattr(embedder, "close", None)
    if close is not None:
        await close()
