"""Shared fixtures: a tmp data dir, test settings, and a real embedded broker (the Tansu binary, ~50 ms to start)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path

import pytest

from memstream.broker import EmbeddedBroker, free_port, free_port_block
from services.settings import Settings
from streams.gateway.keys import create_key

SCRIPTED_LLM = "services.llm.scripted:rule_based_llm"


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    path = tmp_path / "data"
    path.mkdir()
    return path


def make_settings(data_dir: Path, **overrides: object) -> Settings:
    """Settings for tests: no .env file, nothing from a developer's MEMSTREAM_BROKER, free ports, fast groups."""
    values: dict[str, object] = {
        "data_dir": data_dir,
        "broker": None,
        "llm": "scripted",
        "qa_engine": "simple",  # the rule-based scripted LLM answers only the extract and answer tasks
        "scripted_llm": SCRIPTED_LLM,
        "partitions": 2,
        "broker_session_timeout_s": 6.0,
        "batch_wait_s": 0.1,
        "port": free_port(),
        "worker_web_port": free_port_block(4),  # workers use it and the ports after it
        "log_json": True,
        **overrides,
    }
    values.setdefault("kafka_idempotence", values["broker"] is not None)  # the embedded Tansu has no idempotence
    values.setdefault("lag_probe_ends", values["broker"] is None)  # nor end offsets past a batch's first record
    return Settings(_env_file=None, **values)  # type: ignore[arg-type]


@pytest.fixture
def settings(data_dir: Path) -> Settings:
    return make_settings(data_dir)


@pytest.fixture(scope="session")
def settings_factory() -> Callable[..., Settings]:
    """``make_settings(data_dir, **overrides)`` for fixtures of a wider scope than one test."""
    return make_settings


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[EmbeddedBroker]:
    """A fresh embedded broker per test (memory storage, loopback, free port)."""
    instance = EmbeddedBroker(tmp_path / "broker")
    asyncio.run(instance.start())
    try:
        yield instance
    finally:
        instance.stop()


def api_key(settings: Settings, users: Sequence[str] = ("*",), scopes: Sequence[str] = ("admin",)) -> str:
    """A new API key in the settings' key file (default: an admin key for every user)."""
    return create_key(settings, users, scopes, label="test")


@pytest.fixture(scope="session")
def key_factory() -> Callable[..., str]:
    """``api_key(settings, users=("*",), scopes=("admin",))``: a new API key in the settings' key file."""
    return api_key


@contextlib.contextmanager
def _admin_key_in_env(settings: Settings) -> Iterator[str]:
    with pytest.MonkeyPatch.context() as patch:
        key = api_key(settings)
        patch.setenv("MEMSTREAM_API_KEY", key)
        yield key


@pytest.fixture(scope="session")
def admin_key_env() -> Callable[[Settings], AbstractContextManager[str]]:
    """``with admin_key_env(settings) as key:`` an admin key for a test stack, in ``MEMSTREAM_API_KEY`` while the
    block runs: the CLI and ``GatewayClient`` send it, as they would for a user who exported it."""
    return _admin_key_in_env
