"""Forgetting on both stores: memory after a forget equals that of a run that never saw what was forgotten.

The real stores (embedded SQLite; Dgraph + Weaviate), embedder and memorize code; the LLM is a rule-based double
(extraction of one fact per message, a contradiction judge for "works at"), so two runs over the same messages
write the same memory and the comparison is exact: on SQLite the content hash of vertices, edges, applied events
and index entries; on the remote store a snapshot read through the ports (every vertex reachable from an episode,
every edge of those, which ids are indexed) plus the per-kind counts, which would show anything left behind.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from schemas.events import ChatMessage, Document, Forget, ForgetScope, MemoryForgotten
from services import ids
from services.adapters.minilm import MiniLMEmbedder
from services.adapters.sqlite import SqliteMemoryStore
from services.domain import EdgeKind
from services.llm.layers import CachedLLM
from services.llm.scripted import ScriptedLLM, rule_extract, rule_resolve_check
from services.memorize.forget import ForgetService
from services.memorize.service import MemorizeService
from services.ports import LLMRequest
from services.settings import Settings
from streams.codec import encode
from streams.handlers import MemorizeHandler, Record
from streams.topics import TopicNames
from tests.contract.conftest import remote_addresses

T0 = datetime(2024, 3, 1, 9, 0, tzinfo=UTC)
INGEST = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
_WORKS = re.compile(r"^\[(\d+)\] ([^,]{1,80}), [A-Za-z]+ \d{1,2} [A-Za-z]+ \d{4}: I work at ([A-Z][\w' .-]+)\.$")
_PAIR = re.compile(r"^\[(\d+)\] NEW \([^)]*\): (.*)\n\s+KNOWN \([^)]*\): (.*)$", re.MULTILINE)


def extract(request: LLMRequest) -> dict[str, Any]:
    """``rule_extract``, except that "I work at X." becomes the relation fact "works at X"."""
    reply = rule_extract(request)
    content = next(m.content for m in reversed(request.messages) if m.role == "user" and "[1] " in m.content)
    for line in content.splitlines():
        match = _WORKS.match(line)
        if match:
            n, speaker, place = match.groups()
            for entry in reply["messages"]:
                if entry["m"] == int(n):
                    fact = entry["facts"][0]
                    fact.update(subject=speaker, relation="works at", object=place, fact=f"{speaker} works at {place}.")
    return reply


def resolve(request: LLMRequest) -> dict[str, Any]:
    """A newer "works at" replaces an older one."""
    pairs = [
        {"p": int(n), "verdict": "updates" if "works at" in new and "works at" in known else "compatible"}
        for n, new, known in _PAIR.findall(request.messages[-1].content)
    ]
    return {"pairs": pairs}


@pytest.fixture(scope="module")
def embedder() -> MiniLMEmbedder:
    return MiniLMEmbedder()


def chat(n: int, text: str, user: str = "ada", conversation: str = "c1") -> ChatMessage:
    return ChatMessage(
        event_id=f"{user}-m{n}",
        user_id=user,
        conversation_id=conversation,
        speaker=user.title(),
        text=text,
        event_time=T0 + timedelta(minutes=n),
        ingest_time=INGEST + timedelta(seconds=n),
    )


def doc(n: int, text: str, user: str = "ada") -> Document:
    return Document(
        event_id=f"{user}-d{n}",
        user_id=user,
        document_id=f"doc{n}",
        title=f"Notes {n}",
        text=text,
        event_time=T0 + timedelta(minutes=n),
        ingest_time=INGEST + timedelta(seconds=n),
    )


def tombstone(scope: ForgetScope, target: str | None, user: str = "ada", n: int = 1) -> Forget:
    return Forget(event_id=f"f{n}", user_id=user, scope=scope, target=target, event_time=INGEST)


USERS = ("ada", "ben")


async def snapshot(store: Any, user: str) -> Any:
    """The user's memory, as equal as two runs over the same messages make it (no ingest-time clocks)."""
    if isinstance(store, SqliteMemoryStore):
        return (await store.content_hashes()).get(user)
    episodes = await store.episodes(user, None)
    links = await store.neighbors(user, [e.id for e in episodes], [EdgeKind.EPISODIC])
    vertices = {v.id: v for v in episodes} | {t.start.id: t.start for t in links}
    edges = {t.edge.id: t.edge for t in await store.neighbors(user, sorted(vertices))}
    relations = [e for e in edges.values() if e.kind is EdgeKind.RELATION]
    indexed = await store.get_vectors(user, sorted(vertices) + [e.id for e in relations])
    stats = await store.stats(user)
    return (
        sorted(v.model_dump_json(exclude={"t_created", "t_expired"}) for v in vertices.values()),
        sorted(e.model_dump_json(exclude={"t_expired"}) for e in edges.values()),
        sorted(indexed),
        stats.model_dump_json(),
    )


@dataclass
class Memory:
    store: Any
    llm: ScriptedLLM
    memorize: MemorizeService
    forget: ForgetService

    async def said(self, events: Sequence[ChatMessage | Document]) -> None:
        for event in events:  # one at a time: change sets never depend on how the events were batched
            outcome = await self.memorize.memorize([event])
            assert not outcome.dead_letters

    async def snapshot(self, user: str = "ada") -> Any:
        return await snapshot(self.store, user)


@pytest.fixture(params=["sqlite", pytest.param("remote", marks=pytest.mark.server)])
async def open_memory(request: pytest.FixtureRequest, tmp_path: Path, embedder: MiniLMEmbedder) -> AsyncIterator[Any]:
    """``make(name)``: a fresh memory. SQLite: a file each; remote: the one store, the test users erased first
    (so take a snapshot of one memory before making the next)."""
    stores: list[Any] = []

    async def make(name: str) -> Memory:
        if request.param == "sqlite":
            store: Any = await SqliteMemoryStore.open(tmp_path / f"{name}.sqlite3", dim=embedder.dim)
            stores.append(store)
        else:
            from services.adapters.remote import RemoteMemoryStore

            if not stores:
                dgraph, http, grpc = remote_addresses()
                stores.append(await RemoteMemoryStore.open(dgraph, http, grpc, embedder.dim, prefix="MemstreamForget"))
            store = stores[0]
            for user in USERS:
                await store.delete_user(user)
                await store.forget(user, None)
        llm = ScriptedLLM(
            {"extract": extract, "resolve": resolve, "resolve_check": rule_resolve_check}, model="scripted-rules"
        )
        cached = CachedLLM(llm, store)
        settings = Settings(_env_file=None, data_dir=tmp_path)  # type: ignore[call-arg]
        return Memory(
            store,
            llm,
            MemorizeService(store.stores(), cached, embedder, settings),
            ForgetService(store, store, store, embedder),
        )

    yield make
    for store in stores:
        await store.close()


CHATS = [
    chat(1, "I walked with Maria in Lisbon."),
    chat(2, "I love the Alfama quarter."),
    chat(3, "Maria has a dog called Bolt."),  # shares Maria with the first, alone with Bolt
    chat(4, "I love the Alfama quarter."),  # the same fact as the second: two sources
    chat(5, "My locker code is 4711 at Zephyrgym."),
]


async def test_forgetting_a_message_leaves_memory_as_if_never_said(open_memory: Any) -> None:
    full = await open_memory("full")
    await full.said([*CHATS, chat(1, "Ben met Olga in Riga.", user="ben")])
    ben_before = await full.snapshot("ben")
    outcome = await full.forget.forget(tombstone(ForgetScope.MESSAGE, "ada-m5"), "chat")
    assert outcome.source_event_ids == ["ada-m5"] and outcome.vertices_removed >= 3 and outcome.edges_removed >= 3
    assert await full.snapshot("ben") == ben_before  # another user's memory is untouched
    # nothing of it is found any more, by words or by meaning
    assert await full.store.search("ada", [], None, "locker Zephyrgym 4711", k=10) == []
    vector = (await full.memorize.embedder.embed(["my locker code"]))[0]
    hits = await full.store.search("ada", [], vector, None, k=50)
    found = await full.store.get_vertices("ada", [h.id for h in hits])
    assert hits and not any("4711" in v.name or "Zephyrgym" in v.name for v in found.values())
    assert (await full.store.stats("ada")).events == len(CHATS) - 1
    after = await full.snapshot()

    never = await open_memory("never")
    await never.said([c for c in CHATS if c.event_id != "ada-m5"])
    assert after == await never.snapshot()


async def test_what_another_source_supports_stays_with_its_times(open_memory: Any) -> None:
    """Maria (also in message 3) and "I love the Alfama quarter" (also message 4) outlive forgetting 1 and 2."""
    full = await open_memory("full")
    await full.said(CHATS)
    await full.forget.forget(tombstone(ForgetScope.MESSAGE, "ada-m1"), "chat")
    await full.forget.forget(tombstone(ForgetScope.MESSAGE, "ada-m2", n=2), "chat")
    maria = await full.store.find_objects("ada", ["maria"])
    assert maria["maria"].t_valid == CHATS[2].event_time  # first said in message 3 now
    after = await full.snapshot()
    never = await open_memory("never")
    await never.said(CHATS[2:])
    assert after == await never.snapshot()


async def test_an_entity_takes_its_remaining_sources_time_when_both_came_in_one_request(open_memory: Any) -> None:
    """Two messages received at the same instant (one request), said at different times: forgetting the first
    gives Maria the second's time, as if the first had never been said (a tie on receipt time once kept the
    forgotten message's)."""
    received = INGEST + timedelta(seconds=1)
    both = [c.model_copy(update={"ingest_time": received}) for c in (CHATS[0], CHATS[2])]
    full = await open_memory("full")
    await full.said(both)
    await full.forget.forget(tombstone(ForgetScope.MESSAGE, "ada-m1"), "chat")
    maria = await full.store.find_objects("ada", ["maria"])
    assert maria["maria"].t_valid == CHATS[2].event_time
    after = await full.snapshot()
    never = await open_memory("never")
    await never.said(both[1:])
    assert after == await never.snapshot()


async def test_a_near_duplicate_keeps_its_own_words_when_the_first_wording_is_forgotten(open_memory: Any) -> None:
    """The second message says the first's fact again in other words (cosine >= duplicate_min_similarity): memorize
    made it a source of the first's thesis. Forgetting the first writes the second's own fact, as if alone."""
    first, second = chat(1, "I met Maria at qz0k0w."), chat(2, "I met Maria at qz0k1w.")
    full = await open_memory("full")
    await full.said([first, second])
    assert len(await full.store.valid_theses("ada")) == 1  # one thesis, two sources
    outcome = await full.forget.forget(tombstone(ForgetScope.MESSAGE, first.event_id), "chat")
    assert outcome.theses_rewritten == 1
    [thesis] = await full.store.valid_theses("ada")
    assert "qz0k1w" in thesis.name and "qz0k0w" not in thesis.name
    assert await full.store.search("ada", [], None, "qz0k0w", k=10) == []
    after = await full.snapshot()
    never = await open_memory("never")
    await never.said([second])
    assert after == await never.snapshot()


async def test_forgetting_the_update_makes_the_old_state_true_again(open_memory: Any) -> None:
    full = await open_memory("full")
    await full.said([chat(1, "I work at Siemens."), chat(2, "I work at St. Mary's.")])
    assert len(await full.store.valid_theses("ada")) == 1
    siemens = ids.edge_id("ada", "relation", ids.object_id("ada", "Ada"), "works at", ids.object_id("ada", "Siemens"))
    assert (await full.store.get_triplets("ada", [siemens]))[siemens].edge.t_invalid is not None
    outcome = await full.forget.forget(tombstone(ForgetScope.MESSAGE, "ada-m2"), "chat")
    assert outcome.theses_restored == 1
    [valid] = await full.store.valid_theses("ada")
    assert "Siemens" in valid.name and valid.t_invalid is None and valid.invalidated_by is None
    edge = (await full.store.get_triplets("ada", [siemens]))[siemens].edge  # the edge it states holds again
    assert edge.t_invalid is None and edge.invalidated_by is None and edge.t_expired is None
    after = await full.snapshot()
    never = await open_memory("never")
    await never.said([chat(1, "I work at Siemens.")])
    assert after == await never.snapshot()


async def test_forgetting_a_conversation_and_a_document(open_memory: Any) -> None:
    other = [chat(10, "Maria moved to Porto.", conversation="c2"), chat(11, "I cook with Rosa.", conversation="c2")]
    docs = [doc(20, "Zephyrgym opens at six. The sauna is on level two."), doc(21, "Porto has a bridge by Eiffel.")]
    full = await open_memory("full")
    await full.said([*CHATS, *other, *docs])
    conversation = await full.forget.forget(tombstone(ForgetScope.CONVERSATION, "c1"), "chat")
    assert conversation.source_event_ids == sorted(c.event_id for c in CHATS)
    document = await full.forget.forget(tombstone(ForgetScope.DOCUMENT, "doc20", n=2), "documents")
    assert document.source_event_ids == ["ada-d20"]
    after = await full.snapshot()
    never = await open_memory("never")
    await never.said([*other, docs[1]])
    assert after == await never.snapshot()


async def test_a_forgotten_event_is_not_memorized_again_and_the_tombstone_replays_its_outcome(
    open_memory: Any,
) -> None:
    full = await open_memory("full")
    await full.said(CHATS)
    first = await full.forget.forget(tombstone(ForgetScope.MESSAGE, "ada-m5"), "chat")
    redelivered = await full.memorize.memorize([CHATS[4]])
    assert redelivered.skipped == ["ada-m5"] and not redelivered.updates
    again = await full.forget.forget(tombstone(ForgetScope.MESSAGE, "ada-m5"), "chat")
    assert again == first  # the same announcement, removed ids included
    # a message never memorized can be forgotten ahead: it is then never memorized
    ahead = await full.forget.forget(tombstone(ForgetScope.MESSAGE, "ada-m9", n=3), "chat")
    assert ahead.source_event_ids == ["ada-m9"] and ahead.vertices_removed == 0
    late = await full.memorize.memorize([chat(9, "I sing with Ines.")])
    assert late.skipped == ["ada-m9"]


async def test_forgetting_a_user_erases_everything_and_later_messages_are_new_memory(open_memory: Any) -> None:
    full = await open_memory("full")
    await full.said([*CHATS, doc(20, "Zephyrgym opens at six."), chat(1, "Ben met Olga in Riga.", user="ben")])
    ben_before = await full.snapshot("ben")
    outcome = await full.forget.forget(tombstone(ForgetScope.USER, None), "chat")
    assert outcome.removed_all and outcome.cache_entries_removed > 0
    stats = await full.store.stats("ada")
    assert sum(stats.vertices.values()) == sum(stats.edges.values()) == 0
    assert await full.store.search("ada", [], None, "Zephyrgym Maria Alfama", k=10) == []
    if isinstance(full.store, SqliteMemoryStore):
        dump = await full.store.dump("ada")
        assert dump["vertices"] == dump["edges"] == dump["items"] == dump["vectors"] == dump["kv_sources"] == []
        assert stats.events == 0
    assert await full.snapshot("ben") == ben_before
    assert (await full.memorize.memorize([CHATS[0]])).skipped == ["ada-m1"]  # a redelivery stays forgotten
    await full.said([chat(30, "I started rowing with Ugo.")])
    assert len(await full.store.valid_theses("ada")) == 1


async def test_cached_extractions_of_forgotten_messages_go_and_are_never_shared_between_users(
    open_memory: Any,
) -> None:
    full = await open_memory("full")
    same = "I walked with Maria in Lisbon."
    await full.said([chat(1, same), chat(1, same, user="ben"), chat(2, "I love the Alfama quarter.")])
    extract_calls = len(full.llm.calls_for("extract"))
    assert extract_calls == 3  # ben's equal prompt was not served from ada's cache entry
    outcome = await full.forget.forget(tombstone(ForgetScope.MESSAGE, "ada-m1"), "chat")
    assert outcome.cache_entries_removed >= 1
    if isinstance(full.store, SqliteMemoryStore):
        sources = (await full.store.dump())["kv_sources"]
        assert ("ada", "ada-m1") not in {(user, event) for _, user, event in sources}
        assert ("ben", "ben-m1") in {(user, event) for _, user, event in sources}
    # ada's message memorized again (a new event id) asks the model again: nothing of the old one was kept; ben's
    # is still cached
    await full.said([ChatMessage(**{**chat(1, same).model_dump(), "event_id": "ada-m1b"})])
    await full.said([ChatMessage(**{**chat(1, same, user="ben").model_dump(), "event_id": "ben-m1b"})])
    assert len(full.llm.calls_for("extract")) == extract_calls + 1


class Published:
    def __init__(self) -> None:
        self.records: list[tuple[str, bytes | None, bytes]] = []

    async def publish(self, topic: str, key: bytes | None, value: bytes) -> None:
        self.records.append((topic, key, value))


async def test_the_worker_applies_a_tombstone_in_order_with_the_users_events(open_memory: Any, tmp_path: Path) -> None:
    full = await open_memory("full")
    topics = TopicNames.from_settings(Settings(_env_file=None, data_dir=tmp_path))  # type: ignore[call-arg]
    published = Published()
    handler = MemorizeHandler(full.memorize, published, topics, full.forget)

    def record(event: ChatMessage | Forget) -> Record:
        return Record(topics.chat, event.user_id.encode(), encode(event))

    forget = tombstone(ForgetScope.CONVERSATION, "c1")
    later = chat(40, "I bought a kayak from Piet.")
    # one batch: two messages, the tombstone, one of them redelivered, then a new one in the same conversation
    await handler.handle([record(CHATS[0]), record(CHATS[4]), record(forget), record(CHATS[0]), record(later)])
    forgotten = [
        MemoryForgotten.model_validate_json(v)
        for t, _, v in published.records
        if t == topics.memory_updates and b"memory_forgotten" in v
    ]
    assert [f.forget_id for f in forgotten] == ["f1"] and forgotten[0].source_event_ids == ["ada-m1", "ada-m5"]
    after = await full.snapshot()
    never = await open_memory("never")
    await never.said([later])
    assert after == await never.snapshot()
