"""Backend outages on the real stack: Dgraph, Weaviate or Ollama cut off from memstream for 60 s while messages
are ingested and questions asked.

memstream reaches each server through a ``Blackout`` forwarder, which refuses and drops connections while cut (the
server itself keeps running for the other tests). What must hold: processing pauses (the worker is alive, nothing
is dead-lettered, the gateway's reads answer 503 with Retry-After rather than hang), the backend's
``memstream_backend_up`` gauge reads 0, and once the server is back every message accepted before or during the
outage is memorized exactly once and every question is answered, without anyone replaying anything.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from blackout import Blackout  # tests/integration is on sys.path (rootdir conftest, prepend import mode)
from prometheus_client.parser import text_string_to_metric_families

from memstream.runtime import Stack
from schemas.events import ChatMessage
from services.adapters.remote import RemoteMemoryStore
from services.domain import Stats
from services.settings import Settings
from streams.gateway.client import GatewayClient

pytestmark = [pytest.mark.server, pytest.mark.slow]

OUTAGE_S = 60.0
PREFIX = "MemstreamOutage"  # 384-dimensional collections of their own
SCRIPTED = "services.llm.scripted:rule_based_llm"
TEXTS = [
    "I moved to Lisbon last spring.",
    "My sister Ana works as a nurse.",
    "I started learning the cello in March.",
    "We adopted a dog called Pico.",
    "I run every Sunday by the river.",
]


@dataclass
class Cut:
    """A running stack whose path to one backend goes through ``blackouts``."""

    stack: Stack
    blackouts: list[Blackout]
    backend: str  # the label of memstream_backend_up
    direct: Settings  # the same stores, reached without the blackouts (to look at memory during the outage)


def messages(user: str, start: int, count: int) -> list[ChatMessage]:
    day = datetime(2024, 5, 1, 9, 0, tzinfo=UTC)
    return [
        ChatMessage(
            event_id=f"{user}-{n}",
            user_id=user,
            event_time=day + timedelta(minutes=n),
            speaker="Rosa",
            text=f"{TEXTS[n % len(TEXTS)]} (note {n})",
        )
        for n in range(start, start + count)
    ]


def gauge(url: str, key: str, name: str, labels: dict[str, str]) -> float | None:
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return None


def wait_until(check: Callable[[], bool], timeout_s: float, what: str, stack: Stack) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        stack.check_children()  # a worker that died fails the test now, with its log
        assert time.monotonic() < deadline, f"not within {timeout_s:.0f}s: {what}"
        time.sleep(0.5)


async def _stats(settings: Settings, user: str) -> Stats:
    store = await RemoteMemoryStore.from_settings(settings, dim=384)
    try:
        return await store.stats(user)
    finally:
        await store.close()


async def _forget(settings: Settings, user: str) -> None:
    store = await RemoteMemoryStore.from_settings(settings, dim=384)
    try:
        await store.delete_user(user)
    finally:
        await store.close()


def stats(settings: Settings, user: str) -> Stats:
    return asyncio.run(_stats(settings, user))


def started(
    settings: Settings, exits: ExitStack, admin_key_env: Callable[[Settings], AbstractContextManager[str]]
) -> Stack:
    """A running stack on ``settings``, stopped when ``exits`` closes, with an admin key in the environment."""
    stack = Stack(settings, settings.host, settings.port, workers=1, startup_timeout_s=180)
    asyncio.run(stack.start())
    exits.callback(stack.stop)
    exits.enter_context(admin_key_env(settings))
    return stack


@pytest.fixture(params=["dgraph", "weaviate"])
def cut(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    settings_factory: Callable[..., Settings],
    real_stack: dict[str, str],
    admin_key_env: Callable[[Settings], AbstractContextManager[str]],
) -> Iterator[Cut]:
    backend: str = request.param
    run = uuid.uuid4().hex[:8]
    with ExitStack() as exits:
        dgraph = real_stack["MEMSTREAM_DGRAPH"]
        http, grpc = real_stack["MEMSTREAM_WEAVIATE_HTTP"], real_stack["MEMSTREAM_WEAVIATE_GRPC"]
        if backend == "dgraph":
            blackouts = [exits.enter_context(Blackout(dgraph))]
            dgraph = blackouts[0].address
        else:
            blackouts = [exits.enter_context(Blackout(http)), exits.enter_context(Blackout(grpc))]
            http, grpc = blackouts[0].address, blackouts[1].address
        common = {
            "store": "remote",
            "weaviate_prefix": PREFIX,
            "llm": "scripted",
            "scripted_llm": SCRIPTED,
            "qa_engine": "simple",
        }
        direct = settings_factory(
            tmp_path / "direct",
            dgraph=real_stack["MEMSTREAM_DGRAPH"],
            weaviate_http=real_stack["MEMSTREAM_WEAVIATE_HTTP"],
            weaviate_grpc=real_stack["MEMSTREAM_WEAVIATE_GRPC"],
            **common,
        )
        settings = settings_factory(
            tmp_path / "data",
            broker=real_stack["MEMSTREAM_BROKER"],
            topic_prefix=f"memstream-outage-{run}",
            consumer_group=f"memstream-outage-{run}",
            partitions=1,
            dgraph=dgraph,
            weaviate_http=http,
            weaviate_grpc=grpc,
            batch_wait_s=0.5,
            **common,
        )
        yield Cut(started(settings, exits, admin_key_env), blackouts, backend, direct)


def test_a_store_outage_pauses_ingest_and_questions_and_they_resume_with_nothing_lost(cut: Cut) -> None:
    stack = cut.stack
    key = os.environ["MEMSTREAM_API_KEY"]
    user = f"rosa-{uuid.uuid4().hex[:8]}"
    before, during = messages(user, 0, 4), messages(user, 4, 6)
    try:
        with GatewayClient(stack.url, timeout_s=60) as client:
            client.post_messages(before)
            wait_until(lambda: stats(cut.direct, user).events == 4, 120, "the first 4 messages memorized", stack)

            for blackout in cut.blackouts:
                blackout.cut()
            cut_at = time.monotonic()
            assert client.post_messages(during)["accepted"] == 6  # accepting needs the broker only
            query_id = client.ask(user, "Where did Rosa move?")

            # the worker finds the backend unreachable and says so
            wait_until(
                lambda: gauge(stack.url, key, "memstream_backend_up", {"backend": cut.backend}) == 0,
                OUTAGE_S,
                f"memstream_backend_up{{backend={cut.backend}}} reads 0",
                stack,
            )
            # a read at the gateway answers 503 with Retry-After, within seconds, instead of hanging
            started = time.monotonic()
            response = httpx.get(f"{stack.url}/v1/stats/{user}", headers={"Authorization": f"Bearer {key}"}, timeout=60)
            assert response.status_code == 503 and response.headers["retry-after"], response.text
            assert time.monotonic() - started < 30
            while time.monotonic() - cut_at < OUTAGE_S:
                stack.check_children()
                assert client.dead_letters(user_id=user)["total"] == 0  # paused, not given up
                time.sleep(2)
            assert client.answer(query_id) is None  # the question waits too
            for blackout in cut.blackouts:
                blackout.restore()

            answer = client.wait_answer(query_id, 180)
            assert answer["status"] in ("answered", "no_answer"), answer  # not "error"
            wait_until(lambda: stats(cut.direct, user).events == 10, 180, "all 10 messages memorized", stack)
            memory = stats(cut.direct, user)
            assert memory.vertices["episodic"] == 10  # each message exactly once
            assert client.dead_letters(user_id=user)["total"] == 0
            assert client.stats(user)["events"] == 10  # the gateway reads through again
            assert gauge(stack.url, key, "memstream_backend_up", {"backend": cut.backend}) == 1
            retried = gauge(stack.url, key, "memstream_backend_retries_total", {"backend": cut.backend})
            assert retried is not None and retried > 0
    finally:
        asyncio.run(_forget(cut.direct, user))


MODEL_TIMEOUT_S = 300.0  # the 0.5B model on two shared cores: a call takes one to three minutes


@pytest.fixture
def llm_cut(
    tmp_path: Path,
    settings_factory: Callable[..., Settings],
    real_stack: dict[str, str],
    admin_key_env: Callable[[Settings], AbstractContextManager[str]],
) -> Iterator[Cut]:
    run = uuid.uuid4().hex[:8]
    with ExitStack() as exits:
        blackout = exits.enter_context(Blackout(real_stack["MEMSTREAM_OLLAMA_HOST"]))
        settings = settings_factory(
            tmp_path / "data",
            broker=real_stack["MEMSTREAM_BROKER"],
            topic_prefix=f"memstream-outage-{run}",
            consumer_group=f"memstream-outage-{run}",
            partitions=1,
            llm="ollama",
            llm_model=real_stack["MEMSTREAM_OLLAMA_MODEL"],
            ollama_host=blackout.address,
            llm_timeout_s=MODEL_TIMEOUT_S,
            llm_context=4096,
            qa_engine="simple",
            batch_wait_s=1.0,
        )
        yield Cut(started(settings, exits, admin_key_env), [blackout], "llm", settings)


def test_a_model_server_outage_pauses_memorize_and_answers_and_they_resume(llm_cut: Cut) -> None:
    stack, key = llm_cut.stack, os.environ["MEMSTREAM_API_KEY"]
    user = f"rosa-{uuid.uuid4().hex[:8]}"
    said = messages(user, 0, 2)
    with GatewayClient(stack.url, timeout_s=60) as client:
        llm_cut.blackouts[0].cut()  # before the worker's first call
        cut_at = time.monotonic()
        assert client.post_messages(said)["accepted"] == 2
        query_id = client.ask(user, "Where did Rosa move?")
        wait_until(
            lambda: gauge(stack.url, key, "memstream_backend_up", {"backend": "llm"}) == 0,
            OUTAGE_S,
            "memstream_backend_up{backend=llm} reads 0",
            stack,
        )
        while time.monotonic() - cut_at < OUTAGE_S:
            stack.check_children()
            assert client.dead_letters(user_id=user)["total"] == 0  # paused, not given up
            time.sleep(2)
        assert client.stats(user)["events"] == 0  # nothing was written without the model
        llm_cut.blackouts[0].restore()

        wait_until(lambda: client.stats(user)["events"] == 2, 3 * MODEL_TIMEOUT_S, "both messages memorized", stack)
        answer = client.wait_answer(query_id, 2 * MODEL_TIMEOUT_S)
        assert answer["status"] in ("answered", "no_answer"), answer  # not "error"
        assert client.stats(user)["vertices"]["episodic"] == 2
        assert client.dead_letters(user_id=user)["total"] == 0
        assert gauge(stack.url, key, "memstream_backend_up", {"backend": "llm"}) == 1
