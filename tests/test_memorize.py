"""Memorize over the real embedded store and embedder, with a scripted extractor (the LLM is the only double)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from schemas.events import ChatMessage, Document
from services import ids
from services.adapters.minilm import MiniLMEmbedder
from services.adapters.sqlite import SqliteMemoryStore
from services.domain import ChangeSet, Vertex, VertexKind
from services.llm.scripted import ScriptedLLM, rule_extract
from services.memorize.service import MemorizeService
from services.settings import Settings

T0 = datetime(2023, 5, 1, 9, 0, tzinfo=UTC)
INGEST = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


@pytest.fixture(scope="module")
def embedder() -> MiniLMEmbedder:
    return MiniLMEmbedder()


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqliteMemoryStore]:
    s = SqliteMemoryStore(tmp_path / "m.sqlite3", dim=384)
    yield s
    await s.close()


def msg(n: int, text: str, user: str = "u1", speaker: str = "Anna", at: datetime | None = None) -> ChatMessage:
    return ChatMessage(
        event_id=f"m{n}",
        user_id=user,
        speaker=speaker,
        text=text,
        event_time=at or T0 + timedelta(minutes=n),
        ingest_time=INGEST + timedelta(seconds=n),
    )


def reply(*messages: dict) -> dict:
    return {"messages": list(messages)}


def thesis(text: str, *entities: str, replaces: list[str] | None = None, temporal: str = "DYNAMIC") -> dict:
    return {"text": text, "entities": list(entities), "kind": "FACT", "temporal": temporal, "replaces": replaces or []}


def service(
    store: SqliteMemoryStore, llm: ScriptedLLM, embedder: MiniLMEmbedder, **overrides: object
) -> MemorizeService:
    settings = Settings(data_dir=Path("unused"), **overrides)  # type: ignore[arg-type]
    return MemorizeService(store, llm, embedder, settings)


async def test_builds_all_vertex_and_edge_kinds_with_timestamps(store, embedder) -> None:
    llm = ScriptedLLM()
    llm.queue(
        "extract",
        reply(
            {
                "message": 1,
                "theses": [thesis("Anna lives in Paris.", "Anna", "Paris")],
                "triples": [{"subject": "Anna", "relation": "Lives In", "object": "Paris"}],
            }
        ),
    )
    outcome = await service(store, llm, embedder).memorize([msg(1, "I live in Paris.")])
    assert not outcome.dead_letters and len(outcome.updates) == 1
    stats = await store.stats("u1")
    assert stats.vertices == {"episodic": 1, "thesis": 1, "object": 2}
    assert stats.edges == {"relation": 1, "thesis": 2, "episodic": 3}
    t = (await store.get_vertices("u1", [ids.thesis_id("u1", "Anna lives in Paris.")]))[
        ids.thesis_id("u1", "Anna lives in Paris.")
    ]
    assert t.t_valid == T0 + timedelta(minutes=1) and t.t_created == INGEST + timedelta(seconds=1)
    assert t.t_invalid is None and t.episode_label == "FACT" and t.temporal_label == "DYNAMIC"
    update = outcome.updates[0]
    assert update.source_event_ids == ["m1"] and update.theses_added == 1 and update.llm_calls == 1


async def test_replay_changes_nothing_and_costs_no_llm_call(store, embedder) -> None:
    llm = ScriptedLLM({"extract": rule_extract})
    events = [msg(i, f"I met Bob at the Louvre on day {i}.") for i in range(1, 6)]
    svc = service(store, llm, embedder)
    await svc.memorize(events)
    before = await store.dump()
    calls = len(llm.calls)
    again = await svc.memorize(events)  # the whole batch redelivered (at-least-once)
    assert again.skipped == sorted(e.event_id for e in events) and not again.updates
    assert len(llm.calls) == calls
    assert await store.dump() == before


async def test_replay_of_a_change_set_after_crash_is_byte_identical(store, embedder) -> None:
    """Same events re-extracted from scratch (e.g. the write was lost) produce the same rows."""
    llm = ScriptedLLM({"extract": rule_extract})
    events = [msg(i, f"Carl joined Greenpeace in Oslo, note {i}.") for i in range(1, 4)]
    await service(store, llm, embedder).memorize(events)
    first = await store.dump()
    other = SqliteMemoryStore(store.path.parent / "other.sqlite3", dim=384)  # type: ignore[attr-defined]
    try:
        await service(other, ScriptedLLM({"extract": rule_extract}), embedder).memorize(events)
        await service(other, ScriptedLLM({"extract": rule_extract}), embedder).memorize(events)
        assert await other.dump() == first
    finally:
        await other.close()


async def test_contradiction_invalidates_without_deleting(store, embedder) -> None:
    llm = ScriptedLLM()
    llm.queue("extract", reply({"message": 1, "theses": [thesis("Anna lives in Paris.", "Anna", "Paris")]}))
    svc = service(store, llm, embedder)
    await svc.memorize([msg(1, "I live in Paris.")])

    def moved(request):  # the known thesis must be offered to the extractor as K1
        assert "K1: [2023-05-01] Anna lives in Paris." in request.messages[-1].content
        return reply({"message": 1, "theses": [thesis("Anna lives in Berlin.", "Anna", "Berlin", replaces=["K1"])]})

    llm.responders["extract"] = moved
    later = msg(2, "I moved to Berlin!", at=T0 + timedelta(days=30))
    outcome = await svc.memorize([later])
    assert outcome.updates[0].theses_invalidated == 1
    old_id, new_id = ids.thesis_id("u1", "Anna lives in Paris."), ids.thesis_id("u1", "Anna lives in Berlin.")
    found = await store.get_vertices("u1", [old_id, new_id])
    old = found[old_id]
    assert old.t_invalid == later.event_time and old.invalidated_by == new_id
    assert old.t_expired == later.ingest_time
    assert found[new_id].t_invalid is None
    assert old.valid_at(T0 + timedelta(days=1)) and not old.valid_at(None)
    stats = await store.stats("u1")
    assert (stats.theses_valid, stats.theses_invalidated) == (1, 1)
    assert [v.id for v in await store.valid_theses("u1")] == [new_id]


async def test_late_event_about_the_past_is_the_one_invalidated(store, embedder) -> None:
    llm = ScriptedLLM()
    llm.queue("extract", reply({"message": 1, "theses": [thesis("Anna lives in Berlin.", "Anna", "Berlin")]}))
    svc = service(store, llm, embedder)
    await svc.memorize([msg(1, "I live in Berlin.", at=T0 + timedelta(days=30))])
    llm.queue(
        "extract",
        reply({"message": 1, "theses": [thesis("Anna lives in Paris.", "Anna", "Paris", replaces=["K1"])]}),
    )
    await svc.memorize([msg(2, "I live in Paris.", at=T0)])  # said earlier, arrived later
    berlin, paris = ids.thesis_id("u1", "Anna lives in Berlin."), ids.thesis_id("u1", "Anna lives in Paris.")
    found = await store.get_vertices("u1", [berlin, paris])
    assert found[berlin].t_invalid is None
    assert found[paris].t_invalid == T0 + timedelta(days=30) and found[paris].invalidated_by == berlin


async def test_micro_batching_cuts_llm_calls_per_message(store, embedder) -> None:
    events = [msg(i, f"Message number {i} about Rome.") for i in range(1, 17)]
    batched = ScriptedLLM({"extract": rule_extract})
    await service(store, batched, embedder, batch_max_messages=8).memorize(events)
    assert len(batched.calls) == 2
    single = ScriptedLLM({"extract": rule_extract})
    events2 = [msg(100 + i, f"Message number {i} about Rome.", user="u2") for i in range(1, 17)]
    await service(store, single, embedder, batch_max_messages=1).memorize(events2)
    assert len(single.calls) == 16


async def test_token_budget_bounds_a_batch(store, embedder) -> None:
    llm = ScriptedLLM({"extract": rule_extract})
    events = [msg(i, "Long story about Venice. " * 40) for i in range(1, 5)]  # ~250 tokens each
    await service(store, llm, embedder, batch_max_messages=8, batch_token_budget=600).memorize(events)
    assert len(llm.calls) == 2


async def test_poison_message_is_dead_lettered_and_neighbours_survive(store, embedder) -> None:
    def extract(request):
        if any("POISON" in m.content for m in request.messages):
            return "{broken"
        return rule_extract(request)

    llm = ScriptedLLM({"extract": extract})
    events = [msg(1, "Hello from Madrid."), msg(2, "POISON pill"), msg(3, "Greetings from Lisbon.")]
    outcome = await service(store, llm, embedder, extraction_attempts=2).memorize(events, source_topic="chat")
    assert [d.failed_event_ids for d in outcome.dead_letters] == [["m2"]]
    dead = outcome.dead_letters[0]
    assert dead.reason == "extraction_failed" and "not valid JSON" in dead.error and dead.source_topic == "chat"
    assert ChatMessage.model_validate_json(dead.payload).text == "POISON pill"
    assert sorted(e for u in outcome.updates for e in u.source_event_ids) == ["m1", "m3"]
    assert await store.seen_events("u1", ["m1", "m2", "m3"]) == {"m1", "m3"}


async def test_documents_are_chunked_into_episodes(store, embedder) -> None:
    llm = ScriptedLLM({"extract": rule_extract})
    doc = Document(
        event_id="d1",
        user_id="u1",
        document_id="guide",
        title="Guide",
        text="\n\n".join(f"Paragraph {i} mentions Napoli and Sicily at length." * 4 for i in range(6)),
        event_time=T0,
    )
    outcome = await service(store, llm, embedder, document_chunk_chars=400).memorize([doc])
    stats = await store.stats("u1")
    assert stats.vertices["episodic"] >= 3 and outcome.updates[0].source_event_ids == ["d1"]


async def test_users_never_share_memory(store, embedder) -> None:
    llm = ScriptedLLM({"extract": rule_extract})
    svc = service(store, llm, embedder)
    await svc.memorize([msg(1, "My secret is in Zurich.", user="alice")])
    llm.responders["extract"] = lambda request: (
        reply({"message": 1, "theses": []})
        if "secret" not in request.messages[-1].content
        else pytest.fail("alice's thesis was shown to bob's extraction")
    )
    await svc.memorize([msg(2, "What about Zurich?", user="bob")])
    assert (await store.stats("bob")).vertices.get("thesis", 0) == 0
    assert ids.object_id("alice", "Zurich") != ids.object_id("bob", "Zurich")


async def test_vertices_in_the_graph_without_vectors_get_indexed(store, embedder) -> None:
    """A remote store may hold a crashed write's graph rows without their vectors: the next write indexes them."""
    paris = ids.object_id("u1", "Paris")
    orphan = Vertex(id=paris, user_id="u1", kind=VertexKind.OBJECT, name="Paris")
    await store.apply(ChangeSet(id="c-orphan", user_id="u1", event_ids=["crashed"], vertices=[orphan]), [])
    assert await store.get_vectors("u1", [paris]) == {}
    llm = ScriptedLLM()
    llm.queue("extract", reply({"message": 1, "theses": [thesis("Anna lives in Paris.", "Anna", "Paris")]}))
    await service(store, llm, embedder).memorize([msg(1, "I live in Paris.")])
    assert paris in await store.get_vectors("u1", [paris])
