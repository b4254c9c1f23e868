"""Composable LLM layers: each wraps an ``LLM`` and is one itself, adding one concern.

``build_llm`` stacks them as Metered(Cached(Limited(Retrying(adapter)))): every call is metered, a cache hit
answers without taking a concurrency slot, and retries (with their timeouts) happen inside the slot.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import Counter
from pydantic import ValidationError

from services.backends import RetryPolicy, refused, timed_out
from services.llm.gate import RankedGate
from services.llm.scope import current_hold, current_scope, is_ahead, is_background
from services.logging import get_logger
from services.metrics import LLM_CACHE, LLM_CALLS, LLM_IN_FLIGHT, LLM_LATENCY, LLM_TOKENS
from services.ports import LLM, CacheScope, KeyValueCache, LLMRequest, LLMResponse

log = get_logger(__name__)

LLM_RETRIES = Counter("memstream_llm_retries_total", "LLM calls retried after a transport error", ["model", "task"])

#: Failures worth another attempt: the model was unreachable or slow, not wrong.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (ConnectionError, TimeoutError)


def attempts_made(exc: BaseException) -> int:
    """How many times the call was tried before it failed with ``exc``: a ``BackendUnavailable`` says, else 1."""
    return int(getattr(exc, "attempts", 1))


class LLMLayer(LLM):
    """A layer that delegates to ``inner``; subclasses override ``complete``."""

    def __init__(self, inner: LLM) -> None:
        self.inner = inner
        self.model = inner.model

    async def complete(self, request: LLMRequest) -> LLMResponse:
        return await self.inner.complete(request)

    async def accept(self, request: LLMRequest, response: LLMResponse) -> None:
        await self.inner.accept(request, response)

    async def close(self) -> None:
        await self.inner.close()


def cache_key(model: str, request: LLMRequest, user_id: str | None = None) -> str:
    """What determines the answer: model, messages, schema, token limit, temperature, the rule that may stop it
    early (not task or metadata), and the user it is for: two users' equal prompts never share an entry."""
    payload = {
        "user": user_id,
        "model": model,
        "messages": [[m.role, m.content] for m in request.messages],
        "json_schema": request.json_schema,
        "grammar": request.grammar,
        "max_tokens": request.max_tokens,
        "temperature": request.temperature,
        "seed": request.seed,
        "stop": request.stop_when.key if request.stop_when is not None else None,
    }
    encoded = json.dumps(payload, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return "llm:" + hashlib.sha256(encoded.encode()).hexdigest()


class CachedLLM(LLMLayer):
    """Answers repeated requests from a ``KeyValueCache``; hits come back with ``cached=True``.

    A ``validated`` request is stored only when its caller accepts the answer: a rejected output is never served
    again (not to the retry, not to a replayed dead letter)."""

    def __init__(self, inner: LLM, cache: KeyValueCache) -> None:
        super().__init__(inner)
        self.cache = cache

    async def complete(self, request: LLMRequest) -> LLMResponse:
        scope = current_scope()
        key = cache_key(self.inner.model, request, scope.user_id if scope else None)
        stored = await self.cache.get(key)
        if stored is not None:
            try:
                hit = LLMResponse.model_validate_json(stored)
            except ValidationError:
                log.warning("llm_cache_corrupt", task=request.task, key=key)
            else:
                LLM_CACHE.labels(request.task, "hit").inc()
                if request.on_text is not None:
                    request.on_text(hit.text)  # a listener sees a cached answer too, all at once
                return hit.model_copy(update={"cached": True})
        LLM_CACHE.labels(request.task, "miss").inc()
        response = await self.inner.complete(request)
        if not request.validated:
            await self._store(key, response, scope)
        return response

    async def accept(self, request: LLMRequest, response: LLMResponse) -> None:
        scope = current_scope()
        await self._store(cache_key(self.inner.model, request, scope.user_id if scope else None), response, scope)
        await self.inner.accept(request, response)

    async def _store(self, key: str, response: LLMResponse, scope: CacheScope | None) -> None:
        if response.finish_reason == "cancelled" or not response.text.strip():
            return  # an empty or cut-short answer is a failure, never a result to replay
        await self.cache.put(key, response.model_copy(update={"cached": False}).model_dump_json(), scope)


class RetryingLLM(LLMLayer):
    """The LLM call site's retry policy (``services.backends``): a model server that is unreachable is waited
    out for up to ``outage_s``; a timeout or an overloaded server is tried ``attempts`` times in all, each attempt
    within ``timeout_s``.

    Bad output is not retried here: ``services.llm.task.run_task`` does that, telling the model what was wrong.
    """

    def __init__(
        self,
        inner: LLM,
        attempts: int = 3,
        timeout_s: float | None = None,
        *,
        outage_s: float = 600.0,
        backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
    ) -> None:
        super().__init__(inner)
        self.attempts = max(1, attempts)
        self.timeout_s = timeout_s
        self.policy = RetryPolicy(
            "llm",
            refused,  # a timeout is a slow model, not a missing one: tried ``attempts`` times only
            timed_out,
            attempts=self.attempts,
            outage_s=outage_s,
            first_s=backoff_s,
            max_s=max_backoff_s,
        )

    async def complete(self, request: LLMRequest) -> LLMResponse:
        made = 0

        async def attempt() -> LLMResponse:
            nonlocal made
            made += 1
            if made > 1:
                LLM_RETRIES.labels(self.model, request.task).inc()
            async with asyncio.timeout(self.timeout_s):
                return await self.inner.complete(request)

        return await self.policy.run(request.task, attempt)  # gives up as BackendUnavailable, attempts in it


class LimitedLLM(LLMLayer):
    """At most ``max_concurrency`` calls in flight; the others wait their turn. Background calls (memorize, see
    ``background_calls``) hold at most all slots but one: a memorize backlog fills the engine's slots with
    extraction calls of a minute or more each on a small CPU, and a question must not wait behind them. Among
    waiting background calls, those whose result is needed now (a group's checks, on which its write and every
    later group's wait) go before those sent ahead (``sent_ahead``: the later groups' extraction); otherwise a
    group's checks queued behind every extraction of the step, and nothing was written until all of those had
    started (first change set after 603 s instead of 132 s on 192 LoCoMo turns; the same throughput, since the
    engine's slots were full either way: docs/benchmarks.md, "profiled")."""

    def __init__(self, inner: LLM, max_concurrency: int) -> None:
        super().__init__(inner)
        self.max_concurrency = max(1, max_concurrency)
        self._slots = asyncio.Semaphore(self.max_concurrency)
        self.background = RankedGate(self.max_concurrency - 1)
        self.in_flight = 0
        self.max_in_flight = 0

    async def complete(self, request: LLMRequest) -> LLMResponse:
        hold = current_hold()
        if hold is not None and hold.owner is self:
            return await self._run(request)  # the block's earlier call took the slot: it is still this one's
        release = await self._enter()
        if hold is not None:
            hold.owner, hold.release = self, release  # given back when the block ends, not after this call
            return await self._run(request)
        try:
            return await self._run(request)
        finally:
            release()

    async def _enter(self) -> Callable[[], None]:
        """Take a slot (a background call also its place among the background ones); returns how to give it back."""
        background = is_background()
        if background:
            await self.background.acquire(rank=1 if is_ahead() else 0)
        try:
            await self._slots.acquire()
        except BaseException:
            if background:
                self.background.release()
            raise

        def release() -> None:
            self._slots.release()
            if background:
                self.background.release()

        return release

    async def _run(self, request: LLMRequest) -> LLMResponse:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        gauge = LLM_IN_FLIGHT.labels(self.model)
        gauge.inc()
        try:
            return await self.inner.complete(request)
        finally:
            self.in_flight -= 1
            gauge.dec()


@dataclass
class Usage:
    """Running totals; tokens and seconds count model work only, so cache hits add nothing to them."""

    calls: int = 0  # completed calls, cached ones included
    cached: int = 0
    errors: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    prompt_reused: int = 0  # of tokens_in, served from the model's KV cache (not evaluated)
    seconds: float = 0.0
    # what the cache hits cost when the model made them: a variant that shares another's cache is priced as if
    # it ran alone (the evaluation's cost per question), without counting as model work here
    tokens_cached: int = 0

    def add(self, response: LLMResponse, seconds: float) -> None:
        self.calls += 1
        if response.cached:
            self.cached += 1
            self.tokens_cached += response.tokens_in + response.tokens_out
            return
        self.tokens_in += response.tokens_in
        self.tokens_out += response.tokens_out
        self.prompt_reused += response.prompt_reused
        self.seconds += seconds

    @property
    def tokens(self) -> int:
        return self.tokens_in + self.tokens_out


class MeteredLLM(LLMLayer):
    """Prometheus metrics and one structlog line per call, plus running totals (``usage``, ``by_task``)."""

    def __init__(self, inner: LLM) -> None:
        super().__init__(inner)
        self.usage = Usage()
        self.by_task: defaultdict[str, Usage] = defaultdict(Usage)

    @property
    def calls(self) -> int:
        return self.usage.calls

    @property
    def tokens(self) -> int:
        return self.usage.tokens

    def reset(self) -> None:
        self.usage = Usage()
        self.by_task.clear()

    async def complete(self, request: LLMRequest) -> LLMResponse:
        task = request.task
        started = time.perf_counter()
        try:
            response = await self.inner.complete(request)
        except BaseException as exc:
            elapsed = time.perf_counter() - started
            outcome = "cancelled" if isinstance(exc, asyncio.CancelledError) else "error"
            LLM_CALLS.labels(self.model, task, outcome).inc()
            self.usage.errors += 1
            self.by_task[task].errors += 1
            log.warning("llm_call_failed", task=task, model=self.model, ms=round(elapsed * 1000), error=repr(exc))
            raise
        elapsed = time.perf_counter() - started
        model = response.model or self.model
        self.usage.add(response, elapsed)
        self.by_task[task].add(response, elapsed)
        if response.cached:
            LLM_CALLS.labels(model, task, "cached").inc()
        else:
            LLM_CALLS.labels(model, task, "ok").inc()
            LLM_TOKENS.labels(model, task, "in").inc(response.tokens_in)
            LLM_TOKENS.labels(model, task, "out").inc(response.tokens_out)
            LLM_TOKENS.labels(model, task, "in_reused").inc(response.prompt_reused)
            LLM_LATENCY.labels(model, task).observe(elapsed)
        log.info(
            "llm_call",
            task=task,
            model=model,
            tokens_in=response.tokens_in,
            tokens_out=response.tokens_out,
            prompt_reused=response.prompt_reused,
            ms=round(elapsed * 1000),
            cached=response.cached,
            finish_reason=response.finish_reason,
        )
        return response


__all__ = [
    "LLM_RETRIES",
    "TRANSIENT_ERRORS",
    "CachedLLM",
    "LLMLayer",
    "LimitedLLM",
    "MeteredLLM",
    "RetryingLLM",
    "Usage",
    "attempts_made",
    "cache_key",
]
