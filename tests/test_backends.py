"""The one retry policy of every backend call site (``services.backends``), on a call that fails as scripted."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from services.backends import BackendUnavailable, RetryPolicy, refused, timed_out


class Failing:
    """An async call that raises ``errors`` in turn, then returns "ok"."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "ok"


def policy(backend: str, **overrides: float) -> RetryPolicy:
    values = {"attempts": 3, "outage_s": 30.0, "first_s": 0.001, "max_s": 0.01} | overrides
    return RetryPolicy(backend, refused, timed_out, **values)  # type: ignore[arg-type]


def up(backend: str) -> float | None:
    return REGISTRY.get_sample_value("memstream_backend_up", {"backend": backend})


def retries(backend: str, site: str, kind: str) -> float:
    value = REGISTRY.get_sample_value(
        "memstream_backend_retries_total", {"backend": backend, "site": site, "kind": kind}
    )
    return value or 0.0


async def test_an_unreachable_backend_is_waited_out_however_many_attempts_it_takes() -> None:
    call = Failing(*[ConnectionRefusedError("down")] * 7)
    assert await policy("b1").run("read", call) == "ok"
    assert call.calls == 8  # beyond the 3 attempts: an outage is waited for by time, not by count
    assert retries("b1", "read", "unreachable") == 7
    assert up("b1") == 1


async def test_a_slow_backend_is_tried_the_attempts_only() -> None:
    call = Failing(*[TimeoutError("slow")] * 5)
    with pytest.raises(BackendUnavailable) as raised:
        await policy("b2").run("write", call)
    assert call.calls == 3 and raised.value.attempts == 3
    assert isinstance(raised.value.__cause__, TimeoutError)
    assert retries("b2", "write", "transient") == 2


async def test_an_outage_longer_than_the_window_surfaces_as_unavailable() -> None:
    call = Failing(*[ConnectionResetError("reset")] * 10_000)
    with pytest.raises(BackendUnavailable) as raised:
        await policy("b3", outage_s=0.05).run("read", call)
    assert isinstance(raised.value, ConnectionError)  # callers that handle ConnectionError keep working
    assert raised.value.backend == "b3" and raised.value.site == "read" and raised.value.attempts == call.calls > 1
    assert up("b3") == 0  # while it cannot be reached, the gauge says so


async def test_an_answer_of_the_backend_is_never_retried() -> None:
    call = Failing(ValueError("bad request"))
    with pytest.raises(ValueError):
        await policy("b4").run("read", call)
    assert call.calls == 1
