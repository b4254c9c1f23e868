"""One retry policy for every call to a backend: the graph store, the vector store, the LLM, the embedder.

Each call site retries its own call, and nothing retries around it (no retries nested in retries):

* a backend that is **unreachable** (connection refused or reset, gRPC UNAVAILABLE, no answer within the call's
  deadline) is waited out for up to ``outage_s``, with jittered exponential backoff capped at ``max_s``: the work
  that needed it pauses (a worker acknowledges nothing it has not written) and resumes by itself when it is back;
* a **transient refusal** of a reachable backend (a lost write conflict, an overloaded model, a timeout of a model
  that is busy) is tried ``attempts`` times in all.

Then the last error is raised as ``BackendUnavailable`` (a ``ConnectionError``), so the caller dead-letters the
work with a reason that a replay can undo. While a backend is failing its ``memstream_backend_up`` gauge is 0;
every retry is counted by backend and call site.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from prometheus_client import Counter, Gauge
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, wait_random_exponential

from services.logging import get_logger

log = get_logger(__name__)
T = TypeVar("T")

BACKEND_UP = Gauge(
    "memstream_backend_up",
    "1 while the backend's last call succeeded, 0 while calls to it fail and are being retried",
    ["backend"],
    multiprocess_mode="livemin",  # under `memstream up`: 0 if any process finds it down,
)
BACKEND_RETRIES = Counter(
    "memstream_backend_retries_total", "Calls to a backend retried, by call site and why", ["backend", "site", "kind"]
)
BACKEND_GAVE_UP = Counter(
    "memstream_backend_gave_up_total",
    "Calls to a backend that failed after the whole retry policy",
    ["backend", "site"],
)

Classifier = Callable[[BaseException], bool]


class BackendUnavailable(ConnectionError):
    """The backend stayed unreachable (or kept refusing) through the call site's whole retry policy."""

    def __init__(self, backend: str, site: str, attempts: int, waited_s: float, cause: BaseException) -> None:
        super().__init__(f"{backend} {site}: gave up after {attempts} attempt(s) over {waited_s:.0f}s: {cause!r}")
        self.backend = backend
        self.site = site
        self.attempts = attempts
        self.waited_s = waited_s


def never(_: BaseException) -> bool:
    return False


def refused(error: BaseException) -> bool:
    """A server that refused or dropped the connection (for adapters that raise ``ConnectionError`` for it)."""
    return isinstance(error, ConnectionError) and not isinstance(error, TimeoutError)


def timed_out(error: BaseException) -> bool:
    """A server that took too long: reachable but slow (a model on busy cores), so tried a bounded number of times."""
    return isinstance(error, TimeoutError)


@dataclass(frozen=True)
class RetryPolicy:
    """How the calls to one backend are retried; ``run`` makes one call under it."""

    backend: str
    unreachable: Classifier
    transient: Classifier = never
    attempts: int = 5
    outage_s: float = 600.0
    first_s: float = 0.2
    max_s: float = 10.0

    def _stop(self, state: RetryCallState) -> bool:
        error = state.outcome.exception() if state.outcome else None
        if error is not None and self.unreachable(error):
            return (state.seconds_since_start or 0.0) >= self.outage_s
        return state.attempt_number >= max(1, self.attempts)

    def _retryable(self, error: BaseException) -> bool:
        return self.unreachable(error) or self.transient(error)

    async def run(self, site: str, call: Callable[[], Awaitable[T]]) -> T:
        def before_sleep(state: RetryCallState) -> None:
            error = state.outcome.exception() if state.outcome else None
            kind = "unreachable" if error is not None and self.unreachable(error) else "transient"
            BACKEND_RETRIES.labels(self.backend, site, kind).inc()
            if kind == "unreachable":
                BACKEND_UP.labels(self.backend).set(0)
            log.warning(
                "backend_retry",
                backend=self.backend,
                site=site,
                kind=kind,
                attempt=state.attempt_number,
                waited_s=round(state.seconds_since_start or 0.0, 1),
                wait_s=round(state.upcoming_sleep, 2),
                error=repr(error)[:300],
            )

        retrying = AsyncRetrying(
            stop=self._stop,
            wait=wait_random_exponential(multiplier=self.first_s, max=self.max_s),  # full jitter: restarts spread out
            retry=retry_if_exception(self._retryable),
            before_sleep=before_sleep,
            reraise=True,
        )
        state: RetryCallState | None = None
        try:
            async for attempt in retrying:
                state = attempt.retry_state
                with attempt:
                    result = await call()
                    BACKEND_UP.labels(self.backend).set(1)
                    return result
        except Exception as exc:
            if state is None or not self._retryable(exc):
                raise  # the backend answered: a bad request is the caller's to handle, not an outage
            BACKEND_GAVE_UP.labels(self.backend, site).inc()
            raise BackendUnavailable(
                self.backend, site, state.attempt_number, state.seconds_since_start or 0.0, exc
            ) from exc
        raise AssertionError("unreachable: tenacity re-raises the last error")
