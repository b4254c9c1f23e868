"""The local LLM: llama.cpp's server engine in-process (``xllamacpp``), with JSON-schema constrained output.

One engine (loaded model) per model file per process, shared by every ``LlamaCppLLM`` that names that file.
Calls run in worker threads (xllamacpp releases the GIL while it generates) and stream internally, so a cancelled
caller, e.g. a timeout, stops the generation at the next token instead of leaving the model busy.
"""

from __future__ import annotations

import asyncio
import functools
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import xllamacpp

from services.adapters.llamacpp.build import cpu_flags, unused_units
from services.adapters.llamacpp.threads import CoreWatch, choose_threads
from services.logging import get_logger
from services.ports import LLM, LLMRequest, LLMResponse, StopRule

log = get_logger(__name__)

_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
_THINK_OPEN = re.compile(r"<think>.*\Z", re.DOTALL | re.IGNORECASE)


class LlamaCppError(RuntimeError):
    """The engine rejected the request (bad schema, prompt longer than the context) or failed to load."""


#: Speculative decoding kinds (llama.cpp's): a drafter proposes tokens, the model checks them all in one pass, so an
#: accepted run of k tokens costs about one decoding step. Greedy output is the same with or without it.
#: "ngram": n-gram lookup in the prompt and output so far (extraction and answers copy names and phrases from
#: their prompt, JSON repeats its keys); "draft": a smaller model with the same tokenizer (``draft_path``).
SPECULATIVE_KINDS = ("none", "ngram", "ngram-mod", "draft")


@dataclass(frozen=True)
class EngineConfig:
    model_path: Path
    n_ctx: int = 8192  # context per parallel slot
    n_parallel: int = 1  # requests decoded together; more queue inside the engine
    n_threads: int | None = None  # None: llama.cpp's default
    speculative: str = "none"  # one of SPECULATIVE_KINDS
    draft_path: Path | None = None  # the draft model for speculative="draft"
    draft_max: int = 16  # most tokens proposed at once


@dataclass
class Completion:
    text: str = ""
    finish_reason: str | None = None
    tokens_in: int = 0
    tokens_out: int = 0
    error: str | None = None
    chunks: int = 0
    pieces: int = 0  # content deltas: one a generated token, the count when a stop leaves no usage figures
    cancelled: bool = False
    stopped: bool = False  # by the request's stop rule
    #: llama.cpp's own figures: prompt_n (prompt tokens evaluated), cache_n (served from the KV cache),
    #: predicted_n, prompt_ms, predicted_ms, draft_n / draft_n_accepted (speculative decoding)
    timings: dict[str, float] = field(default_factory=dict)


#: The slowest prompt processing that still counts as progress. A model produces no token before it has read
#: the whole prompt, so the first token may take this long per prompt token on top of the stall limit (on 2 busy
#: cores the 1.5B model reads 5-20 tokens a second: a 1,000-token extraction prompt took over the 300 s limit).
MIN_PROMPT_TOKENS_PER_S = 2.0


@dataclass
class Progress:
    """When a generation started (None: still queued) and when it last produced something (monotonic clock);
    ``prompt_allowance_s``: extra time the first token may take, for reading the prompt."""

    started: float | None = None
    last: float | None = None
    produced: bool = False
    prompt_allowance_s: float = 0.0


def strip_think(text: str) -> str:
    """Drop reasoning blocks, including one cut off by the token limit, so only the answer remains."""
    return _THINK_OPEN.sub("", _THINK_BLOCK.sub("", text)).strip()


def default_threads() -> int:
    """Half the cores, at least one: the model shares the machine with the rest of the pipeline, and one thread
    fewer than the cores is far faster than all of them once anything else runs (see ``Engine``)."""
    return max(1, (os.cpu_count() or 2) // 2)


class Engine:
    """One loaded model. Thread-safe: the embedded server queues requests from any number of threads."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        params = xllamacpp.CommonParams()
        params.model.path = str(config.model_path)
        # The server splits n_ctx over its slots; give every slot the full context asked for.
        params.n_ctx = config.n_ctx * config.n_parallel
        params.n_parallel = config.n_parallel
        threads = config.n_threads or default_threads()
        for cpu in (params.cpuparams, params.cpuparams_batch):
            cpu.n_threads = threads
            # llama.cpp's threads spin between steps by default; with the broker, workers, embedder and other work
            # on the same cores a spinning pool waits on descheduled peers every token (measured on 2 busy cores:
            # 2.1 s a token spinning, 1.1 s not, 0.14 s with one thread; docs/benchmarks.md "Local model threads")
            cpu.poll = 0
        params.verbosity = -1  # llama.cpp logs to stderr on its own; our structlog lines say what matters
        _speculate(params, config, threads)
        started = time.perf_counter()
        try:
            self.server = xllamacpp.Server(params)
        except Exception as exc:
            raise LlamaCppError(f"cannot load {config.model_path}: {exc}") from exc
        self.load_s = time.perf_counter() - started
        self.completed = 0
        self.cancelled = 0  # generations stopped early because their caller went away
        self._count_lock = threading.Lock()
        log.info("llm_loaded", path=str(config.model_path), load_s=round(self.load_s, 2), slots=config.n_parallel)
        _say_if_generic_build()

    def chat(
        self,
        payload: dict[str, Any],
        cancel: threading.Event | None = None,
        progress: Progress | None = None,
        on_text: Callable[[str], None] | None = None,
        stop_when: StopRule | None = None,
    ) -> Completion:
        """Run one chat completion (blocking). Streams internally so ``cancel`` can stop it between tokens;
        ``progress`` is stamped when the engine starts on it and at every chunk, for a stall watchdog; ``on_text``
        gets the text so far at every new piece, on the engine's thread; ``stop_when`` ends it where it says."""
        result = Completion()
        if progress is not None:
            progress.started = progress.last = time.monotonic()
        pieces: list[str] = []

        def on_chunk(chunk: Any) -> bool:
            # Called from inside the engine: never raise here, record and ask it to stop instead.
            try:
                result.chunks += 1
                if progress is not None:
                    progress.last = time.monotonic()
                    progress.produced = True
                if not isinstance(chunk, dict):
                    result.error = f"unexpected chunk {type(chunk).__name__}"
                    return True
                if "error" in chunk:
                    error = chunk["error"]
                    result.error = error.get("message", str(error)) if isinstance(error, dict) else str(error)
                    return True
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    # reasoning_content (a parsed think block) is deliberately ignored: only the answer counts
                    if delta.get("content"):
                        pieces.append(delta["content"])
                        result.pieces += 1
                        text = "".join(pieces)
                        if on_text is not None:
                            on_text(text)
                        if stop_when is not None and stop_when(text):
                            result.stopped = True
                            return True
                    if choice.get("finish_reason"):
                        result.finish_reason = choice["finish_reason"]
                if chunk.get("timings"):
                    result.timings = dict(chunk["timings"])
                usage = chunk.get("usage")
                if usage:
                    result.tokens_in = int(usage.get("prompt_tokens", 0))
                    result.tokens_out = int(usage.get("completion_tokens", 0))
                if cancel is not None and cancel.is_set():
                    result.cancelled = True
                    return True
                return False
            except Exception as exc:
                result.error = f"bad chunk: {exc!r}"
                return True

        request = {**payload, "stream": True, "stream_options": {"include_usage": True}}
        try:
            returned = self.server.handle_chat_completions(request, on_chunk)
        except Exception as exc:  # xllamacpp raises ValueError for requests it cannot serve
            raise LlamaCppError(str(exc)) from exc
        if isinstance(returned, dict) and "error" in returned:
            on_chunk(returned)
        if result.error is not None:
            raise LlamaCppError(result.error)
        result.text = strip_think("".join(pieces))
        if result.cancelled:
            result.finish_reason = "cancelled"
        elif result.stopped:
            # no usage chunk comes after a stop: the figures are the last chunk's timings (``timings_per_token``)
            result.finish_reason = "stop_rule"
            prompt = result.timings.get("prompt_n", 0) + result.timings.get("cache_n", 0)
            result.tokens_in = result.tokens_in or int(prompt)
            result.tokens_out = result.tokens_out or int(result.timings.get("predicted_n", result.pieces))
        with self._count_lock:
            self.completed += 1
            self.cancelled += int(result.cancelled)
        return result


@functools.cache
def _say_if_generic_build() -> None:
    """Once a process: a line when the engine leaves this CPU's vector units unused (see ``build``)."""
    unused = unused_units(xllamacpp.get_system_info(), cpu_flags())
    if unused:
        log.info(
            "llm_engine_generic_build",
            unused=unused,
            hint="scripts/native-engine builds the engine for this CPU: prompts read about 1.5x faster where measured",
        )


def _speculate(params: Any, config: EngineConfig, threads: int) -> None:
    """Set llama.cpp's speculative decoding as ``config`` asks (see ``SPECULATIVE_KINDS``)."""
    kinds = xllamacpp.common_speculative_type
    spec = params.speculative
    if config.speculative == "none":
        return
    if config.speculative == "ngram":
        spec.types = [kinds.COMMON_SPECULATIVE_TYPE_NGRAM_SIMPLE]
    elif config.speculative == "ngram-mod":
        spec.types = [kinds.COMMON_SPECULATIVE_TYPE_NGRAM_MOD]
    elif config.speculative == "draft":
        if config.draft_path is None:
            raise LlamaCppError("speculative decoding with a draft model needs its path")
        spec.types = [kinds.COMMON_SPECULATIVE_TYPE_DRAFT_SIMPLE]
        spec.draft.mparams.path = str(config.draft_path)
        spec.draft.n_max = config.draft_max
        for cpu in (spec.draft.cpuparams, spec.draft.cpuparams_batch):
            cpu.n_threads = threads
            cpu.poll = 0
    else:
        raise LlamaCppError(f"unknown speculative decoding {config.speculative!r}; known: {SPECULATIVE_KINDS}")


_engines: dict[tuple[Path, int | None], Engine] = {}
_engines_lock = threading.Lock()


def get_engine(config: EngineConfig) -> Engine:
    """The process-wide engine for this model file and thread count, loading it on first use (blocking)."""
    path = config.model_path.resolve()
    key = (path, config.n_threads)
    with _engines_lock:
        engine = _engines.get(key)
        if engine is None:
            engine = Engine(replace(config, model_path=path))
            _engines[key] = engine
        elif replace(engine.config, model_path=path) != replace(config, model_path=path):
            log.warning("llm_engine_reused", path=str(path), loaded=str(engine.config), asked=str(config))
        return engine


def unload_all() -> None:
    """Drop every loaded engine (the models are freed once no call still uses them)."""
    with _engines_lock:
        _engines.clear()


class LlamaCppLLM(LLM):
    """The ``LLM`` port on a local GGUF model. Greedy by default (temperature 0, fixed seed)."""

    def __init__(
        self,
        model_path: Path,
        *,
        model: str | None = None,
        n_ctx: int = 8192,
        n_parallel: int = 1,
        n_threads: int | None = None,
        seed: int = 0,
        stall_timeout_s: float | None = 300.0,
        speculative: str = "none",
        draft_path: Path | None = None,
    ) -> None:
        self.config = EngineConfig(
            Path(model_path), n_ctx, max(1, n_parallel), n_threads, speculative=speculative, draft_path=draft_path
        )
        self.model = model or Path(model_path).stem
        self.seed = seed
        self.stall_timeout_s = stall_timeout_s
        #: n_threads unset: every core while other processes leave them free, half while they do, chosen per call
        self.cores = CoreWatch() if n_threads is None else None

    async def load(self) -> Engine:
        """The engine for this call (loading it without blocking the event loop): the configured thread count,
        or the one ``choose_threads`` picks from what else the cores are doing now."""
        threads = self.config.n_threads
        if self.cores is not None:
            others = await asyncio.to_thread(self.cores.others_busy)
            threads = choose_threads(os.cpu_count() or 2, others)
        return await asyncio.to_thread(get_engine, replace(self.config, n_threads=threads))

    def payload(self, request: LLMRequest) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "messages": [{"role": m.role, "content": m.content} for m in request.messages],
            "max_tokens": request.max_tokens,
            "temperature": request.temperature,
            "seed": self.seed if request.seed is None else request.seed,
            # Qwen3-style templates think unless told not to; others ignore the flag.
            "chat_template_kwargs": {"enable_thinking": False},
        }
        if request.stop_when is not None:
            payload["timings_per_token"] = True  # a stopped generation gets no usage chunk: its counts come so
        if request.grammar is not None:
            payload["grammar"] = request.grammar
        elif request.json_schema is not None:
            payload["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": request.json_schema, "strict": True},
            }
        return payload

    async def complete(self, request: LLMRequest) -> LLMResponse:
        engine = await self.load()
        cancel = threading.Event()
        prompt_tokens = sum(len(m.content) for m in request.messages) / 4  # about 4 characters a token
        progress = Progress(prompt_allowance_s=prompt_tokens / MIN_PROMPT_TOKENS_PER_S)
        listener = _on_loop(request.on_text)
        sent = time.monotonic()
        job = asyncio.ensure_future(
            asyncio.to_thread(engine.chat, self.payload(request), cancel, progress, listener, request.stop_when)
        )
        try:
            done = await self._watch(job, progress)
        finally:
            # If this coroutine was cancelled (timeout, shutdown), the thread is still generating: stop it.
            cancel.set()
        # where a call's time went, for profiling a run (which calls overlapped, what each read and wrote)
        log.debug(
            "llm_engine_call",
            task=request.task,
            started_s=round((progress.started or sent) - sent, 3),
            ended_s=round(time.monotonic() - sent, 3),
            **{k: done.timings[k] for k in _TIMINGS if k in done.timings},
        )
        return LLMResponse(
            text=done.text,
            model=self.model,
            tokens_in=done.tokens_in,
            tokens_out=done.tokens_out,
            prompt_reused=int(done.timings.get("cache_n", 0)),
            finish_reason=done.finish_reason,
        )

    async def _watch(self, job: asyncio.Future[Completion], progress: Progress) -> Completion:
        """Wait for ``job`` while it makes progress. A call waiting in the engine's queue is not stalled; one that
        produced nothing for ``stall_timeout_s`` since its last token is (TimeoutError), and so is one whose first
        token took that plus its prompt allowance. A slow machine makes calls slow, not failed: there is no cap
        on the whole call."""
        while True:
            done, _ = await asyncio.wait({job}, timeout=_WATCH_INTERVAL_S)
            if done:
                return job.result()
            if self.stall_timeout_s is None or progress.last is None:
                continue
            limit = self.stall_timeout_s + (0.0 if progress.produced else progress.prompt_allowance_s)
            idle = time.monotonic() - progress.last
            if idle > limit:
                job.add_done_callback(lambda f: f.exception())  # the thread stops at its next token; reap it
                raise TimeoutError(f"local model made no progress for {idle:.0f} s (stall limit {limit:.0f} s)")


def _on_loop(on_text: Callable[[str], None] | None) -> Callable[[str], None] | None:
    """``on_text`` called on this event loop from the engine's thread: listeners are loop code (they start tasks)."""
    if on_text is None:
        return None
    loop = asyncio.get_running_loop()

    def relay(text: str) -> None:
        loop.call_soon_threadsafe(on_text, text)

    return relay


#: llama.cpp's per-call figures logged with ``llm_engine_call``
_TIMINGS = ("prompt_n", "cache_n", "predicted_n", "prompt_ms", "predicted_ms")
_WATCH_INTERVAL_S = 1.0  # how often a running call is checked for progress
