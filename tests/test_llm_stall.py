"""The local model's watchdog: a call is ended when it stops making progress, never because it is slow."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from services.adapters.llamacpp import llm as llamacpp
from services.adapters.llamacpp.llm import Completion, LlamaCppLLM, Progress


@pytest.fixture(autouse=True)
def fast_watch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llamacpp, "_WATCH_INTERVAL_S", 0.01)


async def test_a_slow_call_that_keeps_producing_is_never_cut() -> None:
    model = LlamaCppLLM(Path("unused.gguf"), stall_timeout_s=0.2)
    progress = Progress()
    tokens = 0

    async def generate() -> Completion:
        nonlocal tokens
        progress.started = progress.last = time.monotonic()
        # longer than the stall limit in total, but a token well within it each time
        while tokens < 40:
            await asyncio.sleep(0.01)  # simulated token latency
            tokens += 1
            progress.last, progress.produced = time.monotonic(), True
        return Completion(text="done", finish_reason="stop")

    done = await model._watch(asyncio.ensure_future(generate()), progress)
    assert done.text == "done" and tokens == 40


async def test_a_stalled_call_times_out() -> None:
    model = LlamaCppLLM(Path("unused.gguf"), stall_timeout_s=0.05)
    progress = Progress(started=time.monotonic(), last=time.monotonic())
    never = asyncio.get_running_loop().create_future()
    with pytest.raises(TimeoutError, match="no progress"):
        await model._watch(never, progress)
    never.cancel()


async def test_a_call_still_queued_is_not_stalled() -> None:
    model = LlamaCppLLM(Path("unused.gguf"), stall_timeout_s=0.01)
    progress = Progress()  # never started: waiting for an engine slot
    job = asyncio.get_running_loop().create_future()
    watcher = asyncio.ensure_future(model._watch(job, progress))
    # an absence can only be checked over a window: twenty times the stall limit, many watchdog rounds
    done, _ = await asyncio.wait({watcher}, timeout=0.2)
    assert not done
    job.set_result(Completion(text="late", finish_reason="stop"))
    assert (await watcher).text == "late"


async def test_the_first_token_may_take_the_prompt_allowance_then_the_stall_limit_holds() -> None:
    model = LlamaCppLLM(Path("unused.gguf"), stall_timeout_s=0.05)
    progress = Progress(prompt_allowance_s=0.3)
    first_token_after = 0.2  # four stall limits: reading a long prompt on a slow machine

    async def generate() -> Completion:
        progress.started = progress.last = time.monotonic()
        await asyncio.sleep(first_token_after)  # simulated prompt processing
        progress.last, progress.produced = time.monotonic(), True
        return Completion(text="read it", finish_reason="stop")

    assert (await model._watch(asyncio.ensure_future(generate()), progress)).text == "read it"

    # after the first token, silence is judged by the stall limit alone
    stalled = Progress(started=time.monotonic(), last=time.monotonic(), produced=True, prompt_allowance_s=60.0)
    never = asyncio.get_running_loop().create_future()
    with pytest.raises(TimeoutError, match="no progress"):
        await model._watch(never, stalled)
    never.cancel()


async def test_the_prompt_allowance_grows_with_the_prompt(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.ports import LLMMessage, LLMRequest

    seen: list[float] = []

    class Engine:
        def chat(
            self, payload: object, cancel: object, progress: Progress, on_text: object = None, stop_when: object = None
        ) -> Completion:
            seen.append(progress.prompt_allowance_s)
            return Completion(text="ok", finish_reason="stop")

    model = LlamaCppLLM(Path("unused.gguf"))

    async def load() -> Engine:
        return Engine()

    monkeypatch.setattr(model, "load", load)
    for chars in (400, 4000):
        await model.complete(LLMRequest(task="t", messages=[LLMMessage(role="user", content="x" * chars)]))
    # about 4 characters a token, read at no less than MIN_PROMPT_TOKENS_PER_S
    assert seen == [pytest.approx(c / 4 / llamacpp.MIN_PROMPT_TOKENS_PER_S) for c in (400, 4000)]
