"""LLM layers and the factory's stack, on the scripted LLM and an in-memory cache."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY
from pydantic import BaseModel

from services.backends import BackendUnavailable
from services.llm.factory import build_adapter, build_embedder, build_llm
from services.llm.gate import RankedGate
from services.llm.layers import CachedLLM, LimitedLLM, MeteredLLM, RetryingLLM, attempts_made, cache_key
from services.llm.scope import background_calls, held_slot, sent_ahead
from services.llm.scripted import ScriptedLLM
from services.llm.task import LLMTask, TaskFailed, run_task
from services.ports import LLM, CacheScope, KeyValueCache, LLMMessage, LLMRequest, LLMResponse
from services.settings import Settings


class DictCache(KeyValueCache):
    def __init__(self) -> None:
        self.data: dict[str, str] = {}

    async def get(self, key: str) -> str | None:
        return self.data.get(key)

    async def put(self, key: str, value: str, scope: CacheScope | None = None) -> None:
        self.data[key] = value

    async def forget(self, user_id: str, event_ids: Sequence[str] | None) -> int:
        raise AssertionError("no test here forgets")


class FlakyLLM(LLM):
    """Raises ``error`` for the first ``failures`` calls, then answers through ``inner``."""

    def __init__(self, inner: LLM, failures: int, error: BaseException) -> None:
        self.inner = inner
        self.model = inner.model
        self.failures = failures
        self.error = error
        self.attempts = 0

    async def complete(self, request: LLMRequest) -> LLMResponse:
        self.attempts += 1
        if self.attempts <= self.failures:
            raise self.error
        return await self.inner.complete(request)


class GatedLLM(LLM):
    """Holds every call until ``gate`` is set, so a test can fill all concurrency slots."""

    model = "gated"

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.started = 0

    async def complete(self, request: LLMRequest) -> LLMResponse:
        self.started += 1
        await self.gate.wait()
        return LLMResponse(text='{"ok": true}', model=self.model, tokens_in=3, tokens_out=2)


def ask(content: str = "hello", task: str = "t", **kw: Any) -> LLMRequest:
    return LLMRequest(task=task, messages=[LLMMessage(role="user", content=content)], **kw)


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 2.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met before the deadline")
        await asyncio.sleep(0)


async def test_cache_hit_and_miss() -> None:
    inner = ScriptedLLM({"t": lambda r: {"echo": r.messages[0].content}}, model="m1")
    cache = DictCache()
    llm = CachedLLM(inner, cache)
    hits, misses = (
        sample("memstream_llm_cache_total", task="t", result="hit"),
        sample("memstream_llm_cache_total", task="t", result="miss"),
    )

    first = await llm.complete(ask("a", metadata={"attempt": "1"}))
    again = await llm.complete(ask("a", metadata={"attempt": "2"}))  # metadata is not part of the key
    other = await llm.complete(ask("a", max_tokens=7))

    assert first.cached is False and again.cached is True and other.cached is False
    assert again.text == first.text and again.tokens_out == first.tokens_out
    assert len(inner.calls) == 2
    assert len(cache.data) == 2
    assert sample("memstream_llm_cache_total", task="t", result="hit") == hits + 1
    assert sample("memstream_llm_cache_total", task="t", result="miss") == misses + 2


def test_cache_key_covers_what_changes_the_answer() -> None:
    base = ask("a")
    assert cache_key("m", base) == cache_key("m", ask("a", task="other", metadata={"x": "y"}))
    assert cache_key("m", base) != cache_key("m2", base)
    assert cache_key("m", base) != cache_key("m", ask("b"))
    assert cache_key("m", base) != cache_key("m", ask("a", json_schema={"type": "object"}))
    assert cache_key("m", base) != cache_key("m", ask("a", grammar='root ::= "x"'))
    assert cache_key("m", base) != cache_key("m", ask("a", temperature=0.5))
    assert cache_key("m", base) != cache_key("m", ask("a", max_tokens=5))


async def test_corrupt_cache_entry_is_a_miss() -> None:
    inner = ScriptedLLM({"t": lambda r: "fresh"}, model="m1")
    cache = DictCache()
    cache.data[cache_key("m1", ask())] = "not json"
    response = await CachedLLM(inner, cache).complete(ask())
    assert response.text == "fresh" and response.cached is False
    assert len(inner.calls) == 1


async def test_retries_connection_errors() -> None:
    flaky = FlakyLLM(ScriptedLLM({"t": lambda r: "ok"}), failures=2, error=ConnectionError("refused"))
    before = sample("memstream_llm_retries_total", model="scripted", task="t")
    response = await RetryingLLM(flaky, attempts=3, backoff_s=0.001).complete(ask())
    assert response.text == "ok"
    assert flaky.attempts == 3
    assert sample("memstream_llm_retries_total", model="scripted", task="t") == before + 2


async def test_an_unreachable_server_is_waited_out_beyond_the_attempts() -> None:
    flaky = FlakyLLM(ScriptedLLM({"t": lambda r: "ok"}), failures=5, error=ConnectionError("refused"))
    response = await RetryingLLM(flaky, attempts=2, outage_s=30.0, backoff_s=0.001, max_backoff_s=0.01).complete(ask())
    assert response.text == "ok"
    assert flaky.attempts == 6


async def test_gives_up_when_the_outage_outlasts_its_window() -> None:
    flaky = FlakyLLM(ScriptedLLM({"t": lambda r: "ok"}), failures=10_000, error=ConnectionError("refused"))
    with pytest.raises(BackendUnavailable) as raised:
        await RetryingLLM(flaky, attempts=2, outage_s=0.05, backoff_s=0.001, max_backoff_s=0.01).complete(ask())
    assert raised.value.backend == "llm" and raised.value.attempts == flaky.attempts >= 2
    assert attempts_made(raised.value) == flaky.attempts


async def test_does_not_retry_other_errors() -> None:
    flaky = FlakyLLM(ScriptedLLM({"t": lambda r: "ok"}), failures=1, error=ValueError("bad request"))
    with pytest.raises(ValueError):
        await RetryingLLM(flaky, attempts=3, backoff_s=0.001).complete(ask())
    assert flaky.attempts == 1


async def test_timeout_is_retried_then_raised() -> None:
    slow = ScriptedLLM({"t": lambda r: "late"}, delay_s=5.0)
    with pytest.raises(BackendUnavailable) as raised:
        await RetryingLLM(slow, attempts=2, timeout_s=0.05, backoff_s=0.001).complete(ask())
    assert isinstance(raised.value.__cause__, TimeoutError)
    assert len(slow.calls) == 2
    assert slow.in_flight == 0


class Out(BaseModel):
    answer: str


class Answer(LLMTask[Out, Out]):
    name = "answer"
    output_model = Out

    def messages(self, inputs: object) -> list[LLMMessage]:
        return [LLMMessage(role="user", content=str(inputs))]


async def test_bad_output_is_not_retried_by_the_layer() -> None:
    scripted = ScriptedLLM({"answer": lambda r: "this is not json"})
    llm = RetryingLLM(scripted, attempts=3, backoff_s=0.001)
    response = await llm.complete(ask(task="answer"))
    assert response.text == "this is not json"
    assert len(scripted.calls) == 1
    # run_task owns output retries: exactly its own number of attempts reach the model
    with pytest.raises(TaskFailed):
        await run_task(llm, Answer(), "q", attempts=2)
    assert len(scripted.calls) == 3


async def test_a_rejected_output_is_never_cached_and_a_retry_samples_anew() -> None:
    replies = iter(["not json", '{"answer": "Paris"}'])
    scripted = ScriptedLLM({"answer": lambda r: next(replies)})
    cache = DictCache()
    llm = CachedLLM(scripted, cache)
    before = sample("memstream_llm_rejected_outputs_total", task="answer", reason="not valid JSON")
    result = await run_task(llm, Answer(), "capital of France?", attempts=2)
    assert result.value.answer == "Paris" and result.calls == 2
    first, second = scripted.calls
    assert first.temperature == 0.0 and first.seed is None
    assert second.temperature > 0 and second.seed is not None  # greedy decoding would repeat the mistake
    assert "rejected" in second.messages[-1].content
    # only the accepted answer is in the cache, under the request that produced it
    assert list(cache.data) == [cache_key(scripted.model, second)]
    assert sample("memstream_llm_rejected_outputs_total", task="answer", reason="not valid JSON") == before + 1


async def test_a_dead_lettered_request_can_succeed_when_replayed() -> None:
    """Nothing of a failed run is served from the cache to its replay: the model is asked again."""
    outputs = ["not json", "still not json"]
    scripted = ScriptedLLM({"answer": lambda r: outputs.pop(0) if outputs else '{"answer": "Paris"}'})
    llm = CachedLLM(scripted, DictCache())
    with pytest.raises(TaskFailed):
        await run_task(llm, Answer(), "capital of France?", attempts=2)
    replay = await run_task(llm, Answer(), "capital of France?", attempts=2)
    assert replay.value.answer == "Paris" and replay.cached_calls == 0


async def test_empty_answers_are_not_cached() -> None:
    cache = DictCache()
    await CachedLLM(ScriptedLLM({"t": lambda r: "  "}), cache).complete(ask())
    assert cache.data == {}


async def test_concurrency_bound_is_respected() -> None:
    scripted = ScriptedLLM({"t": lambda r: "ok"}, delay_s=0.01)
    llm = LimitedLLM(scripted, max_concurrency=2)
    results = await asyncio.gather(*(llm.complete(ask(str(i))) for i in range(8)))
    assert len(results) == 8
    assert scripted.max_in_flight == 2
    assert llm.max_in_flight == 2 and llm.in_flight == 0


class Held(ScriptedLLM):
    """Every call waits until released, so what reached the model, in which order, is exact."""

    def __init__(self) -> None:
        super().__init__({"t": lambda r: "ok"})
        self.release = asyncio.Event()
        self.arrived: list[str] = []
        self.changed = asyncio.Condition()

    async def complete(self, request):
        async with self.changed:
            self.arrived.append(request.messages[-1].content)
            self.changed.notify_all()
        await self.release.wait()
        return await super().complete(request)

    async def wait_arrived(self, n: int) -> None:
        async with self.changed:
            await asyncio.wait_for(self.changed.wait_for(lambda: len(self.arrived) >= n), timeout=5)


async def test_background_calls_leave_a_slot_for_a_question() -> None:
    held = Held()
    llm = LimitedLLM(held, max_concurrency=3)

    async def memorize_backlog() -> list[LLMResponse]:
        with background_calls():
            return await asyncio.gather(*(llm.complete(ask(f"b{i}")) for i in range(6)))

    backlog = asyncio.create_task(memorize_backlog())
    await held.wait_arrived(2)
    question = asyncio.create_task(llm.complete(ask("q")))
    await held.wait_arrived(3)
    # the third slot went to the question, asked after six background calls were waiting
    assert held.arrived == ["b0", "b1", "q"] and llm.in_flight == 3
    held.release.set()
    assert len(await backlog) == 6 and (await question).text == "ok"
    assert llm.max_in_flight == 3


async def test_a_background_call_needed_now_goes_before_calls_sent_ahead() -> None:
    held = Held()
    llm = LimitedLLM(held, max_concurrency=2)  # one background slot

    async def ahead(name: str) -> LLMResponse:
        with sent_ahead():
            return await llm.complete(ask(name))

    with background_calls():
        first = asyncio.create_task(ahead("extract 1"))
        await held.wait_arrived(1)
        later = [asyncio.create_task(ahead(f"extract {n}")) for n in (2, 3)]
        await wait_until(lambda: llm.background.waiting == 2)
        check = asyncio.create_task(llm.complete(ask("check 1")))
    await wait_until(lambda: llm.background.waiting == 3)
    assert held.arrived == ["extract 1"]
    held.release.set()
    await asyncio.gather(first, check, *later)
    # the check, queued last, went first; those sent ahead kept their order
    assert held.arrived == ["extract 1", "check 1", "extract 2", "extract 3"]


async def test_calls_in_a_held_slot_run_back_to_back_before_a_waiting_call() -> None:
    """An extraction stopped at a repeat is continued by a second call with the same prompt: it must get the slot
    straight back (the engine slot holding its prompt), not after a call that was waiting for one."""
    scripted = ScriptedLLM({"t": lambda r: "ok"})
    order: list[str] = []
    turn = asyncio.Event()

    class Recording(LLM):
        model = "recording"

        async def complete(self, request: LLMRequest) -> LLMResponse:
            order.append(request.messages[-1].content)
            if request.messages[-1].content == "part 1":
                await turn.wait()
            return await scripted.complete(request)

    llm = LimitedLLM(Recording(), max_concurrency=1)

    async def continued() -> None:
        with held_slot():
            await llm.complete(ask("part 1"))
            await llm.complete(ask("part 2"))

    first = asyncio.create_task(continued())
    await wait_until(lambda: order == ["part 1"])
    other = asyncio.create_task(llm.complete(ask("other")))
    await wait_until(lambda: llm._slots.locked() and len(llm._slots._waiters or ()) == 1)
    turn.set()
    await asyncio.gather(first, other)
    assert order == ["part 1", "part 2", "other"]
    assert not llm._slots.locked()  # given back when the block ended
    # without the hold, the waiting call goes between the two parts
    order.clear()
    turn.clear()

    async def apart() -> None:
        await llm.complete(ask("part 1"))
        await llm.complete(ask("part 2"))

    first = asyncio.create_task(apart())
    await wait_until(lambda: order == ["part 1"])
    other = asyncio.create_task(llm.complete(ask("other")))
    await wait_until(lambda: len(llm._slots._waiters or ()) == 1)
    turn.set()
    await asyncio.gather(first, other)
    assert order == ["part 1", "other", "part 2"]


async def test_ranked_gate_lets_in_by_rank_then_arrival_and_skips_the_cancelled() -> None:
    gate = RankedGate(1)
    await gate.acquire()
    entered: list[str] = []

    async def enter(name: str, rank: int) -> None:
        await gate.acquire(rank)
        entered.append(name)

    waiters = {n: asyncio.create_task(enter(n, r)) for n, r in [("late a", 1), ("late b", 1), ("now", 0), ("gone", 0)]}
    await asyncio.sleep(0)
    waiters["gone"].cancel()
    await asyncio.gather(waiters["gone"], return_exceptions=True)
    for expected in (["now"], ["now", "late a"], ["now", "late a", "late b"]):
        gate.release()
        await wait_until(lambda: len(entered) == len(expected))  # noqa: B023 (awaited in this iteration)
        assert entered == expected
    assert gate.free == 0
    gate.release()
    assert gate.free == 1


async def test_metrics_and_running_counters() -> None:
    scripted = ScriptedLLM({"meter": lambda r: "x" * 40}, model="metered-model")
    llm = MeteredLLM(CachedLLM(scripted, DictCache()))
    labels = {"model": "metered-model", "task": "meter"}
    ok_before = sample("memstream_llm_calls_total", outcome="ok", **labels)
    cached_before = sample("memstream_llm_calls_total", outcome="cached", **labels)
    out_before = sample("memstream_llm_tokens_total", direction="out", **labels)
    latency_before = sample("memstream_llm_latency_seconds_count", **labels)

    await llm.complete(ask("q", task="meter"))
    await llm.complete(ask("q", task="meter"))

    assert sample("memstream_llm_calls_total", outcome="ok", **labels) == ok_before + 1
    assert sample("memstream_llm_calls_total", outcome="cached", **labels) == cached_before + 1
    assert sample("memstream_llm_tokens_total", direction="out", **labels) == out_before + 10
    assert sample("memstream_llm_latency_seconds_count", **labels) == latency_before + 1
    assert (llm.calls, llm.usage.cached, llm.usage.tokens_out) == (2, 1, 10)
    assert llm.by_task["meter"].calls == 2


async def test_metered_counts_errors() -> None:
    failing = FlakyLLM(ScriptedLLM(model="broken"), failures=1, error=ConnectionError("down"))
    llm = MeteredLLM(failing)
    before = sample("memstream_llm_calls_total", model="broken", task="t", outcome="error")
    with pytest.raises(ConnectionError):
        await llm.complete(ask())
    assert sample("memstream_llm_calls_total", model="broken", task="t", outcome="error") == before + 1
    assert llm.usage.errors == 1 and llm.calls == 0


async def test_factory_stack_cache_hit_needs_no_slot(tmp_path: Path) -> None:
    settings = Settings(llm="scripted", llm_max_concurrency=1, llm_retries=0, data_dir=tmp_path)
    gated = GatedLLM()
    cache = DictCache()
    llm = build_llm(settings, cache, inner=gated)
    assert isinstance(llm, MeteredLLM) and llm.model == "gated"

    gated.gate.set()
    await llm.complete(ask("cached"))  # fills the cache
    gated.gate.clear()

    busy = asyncio.create_task(llm.complete(ask("slow")))
    await wait_until(lambda: gated.started == 2)  # the only slot is now held
    hit = await asyncio.wait_for(llm.complete(ask("cached")), timeout=2.0)
    assert hit.cached is True
    assert not busy.done()
    gated.gate.set()
    assert (await busy).cached is False
    assert llm.usage.calls == 3 and llm.usage.cached == 1


async def test_factory_builds_scripted_stack(tmp_path: Path) -> None:
    bare = build_llm(Settings(llm="scripted", data_dir=tmp_path), None)
    assert isinstance(bare, MeteredLLM) and bare.model == "scripted"
    rules = Settings(llm="scripted", scripted_llm="services.llm.scripted:rule_based_llm", data_dir=tmp_path)
    llm = build_llm(rules, DictCache())
    assert isinstance(llm.inner, CachedLLM)
    assert isinstance(llm.inner.inner, LimitedLLM) and isinstance(llm.inner.inner.inner, RetryingLLM)


def test_factory_picks_the_configured_adapters(tmp_path: Path) -> None:
    from services.adapters.llamacpp import LlamaCppLLM
    from services.adapters.minilm import MiniLMEmbedder
    from services.adapters.ollama import OllamaEmbedder, OllamaLLM

    local = build_adapter(Settings(llm="local", llm_model_path=tmp_path / "my-model.gguf", data_dir=tmp_path))
    assert isinstance(local, LlamaCppLLM) and local.model == "my-model"  # loads on first call, not here
    ollama = build_adapter(Settings(llm="ollama", llm_model="qwen2.5-coder:1.5b", data_dir=tmp_path))
    assert isinstance(ollama, OllamaLLM) and ollama.model == "qwen2.5-coder:1.5b"

    assert isinstance(build_embedder(Settings(embedder="minilm")), MiniLMEmbedder)
    remote = build_embedder(Settings(embedder="ollama", embed_model="nomic-embed-text:latest"))
    assert isinstance(remote, OllamaEmbedder) and remote.dim == 768
    with pytest.raises(ValueError, match="unknown size"):
        build_embedder(Settings(embedder="ollama", embed_model="mystery-embedder"))


async def test_ollama_refuses_a_grammar_it_cannot_take() -> None:
    """A GBNF grammar is llama.cpp's: Ollama says so at once (no request sent, nothing answered unconstrained)."""
    from services.adapters.ollama import OllamaLLM
    from services.adapters.ollama.errors import OllamaError

    llm = OllamaLLM("any", host="http://127.0.0.1:9")  # nothing listens there: a request would fail otherwise
    with pytest.raises(OllamaError, match="no GBNF grammar"):
        await llm.complete(ask("a", grammar='root ::= "x"'))
