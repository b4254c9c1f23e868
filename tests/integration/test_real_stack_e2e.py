"""End to end on the real stack: Apache Kafka, a Faust worker process and the gateway (``memstream up``'s Stack),
the memory in Dgraph + Weaviate, the models on Ollama (Qwen2.5-Coder 0.5B for extraction and answers, all-MiniLM
for vectors). Nothing is scripted.

A 0.5B model's wording is not reliable, so the checks are on structure and provenance: the conversation is
memorized (events, episodes and theses in the stores), the question gets an answer whose evidence is memory that
the conversation produced, and another user's question finds nothing.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from datetime import UTC, datetime
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer

from memstream.runtime import Stack
from schemas.events import ChatMessage, MemoryUpdate
from services.adapters.remote import RemoteMemoryStore
from services.domain import Stats
from services.settings import Settings
from streams.gateway.client import GatewayClient
from streams.topics import TopicNames

pytestmark = [pytest.mark.server, pytest.mark.slow]

# the small model on two shared cores: an extraction call takes one to three minutes
MODEL_TIMEOUT_S = 300.0
PREFIX = "MemstreamE2e"  # 384-dimensional collections of their own
CONVERSATION = [
    ("Anna", "I just started my new job as a nurse at St. Mary's hospital."),
    ("Ben", "Congrats! I'm still in Munich, training for the Berlin marathon."),
    ("Anna", "I also adopted a cat called Miso last week."),
]


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory,
    settings_factory: Callable[..., Settings],
    real_stack: dict[str, str],
    admin_key_env: Callable[[Settings], AbstractContextManager[str]],
) -> Iterator[Stack]:
    run = uuid.uuid4().hex[:8]
    settings = settings_factory(
        tmp_path_factory.mktemp("real-stack"),
        broker=real_stack["MEMSTREAM_BROKER"],  # an external broker: the Stack starts no embedded one
        topic_prefix=f"memstream-it-{run}",  # topics and group of this run only, on a shared broker
        consumer_group=f"memstream-it-{run}",
        partitions=1,
        store="remote",
        dgraph=real_stack["MEMSTREAM_DGRAPH"],
        weaviate_http=real_stack["MEMSTREAM_WEAVIATE_HTTP"],
        weaviate_grpc=real_stack["MEMSTREAM_WEAVIATE_GRPC"],
        weaviate_prefix=PREFIX,
        llm="ollama",
        llm_model=real_stack["MEMSTREAM_OLLAMA_MODEL"],
        ollama_host=real_stack["MEMSTREAM_OLLAMA_HOST"],
        embedder="ollama",
        embed_model=real_stack["MEMSTREAM_EMBED_MODEL"],
        llm_timeout_s=MODEL_TIMEOUT_S,
        llm_retries=1,
        llm_context=4096,
        extraction_attempts=2,
        qa_engine="simple",  # one answer call; the 13-stage planner would take many minutes on this model
        batch_wait_s=1.0,  # the three messages arrive together and share one extraction call
    )
    running = Stack(settings, settings.host, settings.port, workers=1, startup_timeout_s=180)
    asyncio.run(running.start())
    try:
        with admin_key_env(settings):
            yield running
    finally:
        running.stop()


def memory_updates(stack: Stack, user: str, event_ids: set[str], timeout_s: float) -> list[MemoryUpdate]:
    """The user's memory updates, read from the topic until they cover ``event_ids`` (or fail at the deadline)."""
    topic = TopicNames.from_settings(stack.settings).memory_updates

    async def read() -> list[MemoryUpdate]:
        consumer = AIOKafkaConsumer(topic, bootstrap_servers=stack.bootstrap, auto_offset_reset="earliest")
        await consumer.start()
        found: list[MemoryUpdate] = []
        try:
            deadline = time.monotonic() + timeout_s
            while not event_ids <= {e for u in found for e in u.source_event_ids}:
                stack.check_children()  # a dead worker fails now, with its log
                assert time.monotonic() < deadline, f"{event_ids} not memorized within {timeout_s}s: {found}"
                for batch in (await consumer.getmany(timeout_ms=500)).values():
                    updates = (MemoryUpdate.model_validate_json(r.value or b"") for r in batch)
                    found.extend(u for u in updates if u.user_id == user)
        finally:
            await consumer.stop()
        return found

    return asyncio.run(read())


async def stored_texts(settings: Settings, user: str, ids: list[str]) -> dict[str, str]:
    """The texts the stores hold for these vertex or edge ids of this user (what evidence must quote)."""
    store = await RemoteMemoryStore.from_settings(settings, dim=384)
    try:
        texts = {vid: v.text for vid, v in (await store.get_vertices(user, ids)).items()}
        texts.update({eid: t.text for eid, t in (await store.get_triplets(user, ids)).items()})
        vectors = await store.get_vectors(user, list(texts))
        assert set(vectors) == set(texts), "every piece of evidence is indexed in Weaviate too"
        return texts
    finally:
        await store.close()


async def forget(settings: Settings, user: str) -> None:
    store = await RemoteMemoryStore.from_settings(settings, dim=384)
    try:
        await store.delete_user(user)
    finally:
        await store.close()


def test_a_conversation_is_memorized_and_a_question_is_answered_with_evidence(stack: Stack) -> None:
    user = f"anna-{uuid.uuid4().hex[:8]}"
    day = datetime(2024, 3, 2, 10, 0, tzinfo=UTC)
    messages = [
        ChatMessage(event_id=f"{user}-{n}", user_id=user, event_time=day, speaker=speaker, text=text)
        for n, (speaker, text) in enumerate(CONVERSATION)
    ]
    try:
        with GatewayClient(stack.url, timeout_s=60) as client:
            assert client.post_messages(messages)["accepted"] == len(messages)
            event_ids = {m.event_id for m in messages}
            updates = memory_updates(stack, user, event_ids, timeout_s=2 * MODEL_TIMEOUT_S + 60)
            # (llm_calls may be 0: the LLM cache lives in Dgraph, and a rerun on the same servers hits it)
            assert sum(u.theses_added for u in updates) >= 1

            stats = asyncio.run(remote_stats(stack.settings, user))
            assert stats.events == len(messages) and stats.vertices["episodic"] == len(messages)
            assert stats.theses_valid >= 1

            answer = client.wait_answer(client.ask(user, "Where does Anna work?"), MODEL_TIMEOUT_S + 60)
            assert answer["status"] == "answered" and answer["answer"].strip()
            evidence = answer["evidence"]
            assert evidence, answer
            stored = asyncio.run(stored_texts(stack.settings, user, [e["id"] for e in evidence]))
            # every piece of evidence is memory of this user, quoted as stored
            assert {e["id"]: e["text"] for e in evidence} == {e["id"]: stored[e["id"]] for e in evidence}
            assert any(word in e["text"] for e in evidence for word in ("nurse", "Mary", "hospital")), evidence

            # another user's memory is empty: nothing leaks across tenants
            other = client.wait_answer(client.ask(f"{user}-other", "Where does Anna work?"), MODEL_TIMEOUT_S + 60)
            assert other["status"] == "no_answer" and other["evidence"] == []
    finally:
        asyncio.run(forget(stack.settings, user))


async def remote_stats(settings: Settings, user: str) -> Stats:
    store = await RemoteMemoryStore.from_settings(settings, dim=384)
    try:
        return await store.stats(user)
    finally:
        await store.close()


def test_the_stack_uses_the_real_servers(stack: Stack) -> None:
    settings = stack.settings
    assert stack.broker is None and stack.bootstrap == settings.broker  # Apache Kafka, not the embedded broker
    assert settings.store == "remote" and settings.llm == "ollama" and settings.embedder == "ollama"
    assert not Path(settings.store_path).exists()  # the embedded store was never opened
