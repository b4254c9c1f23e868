"""Entity resolution beyond exact names, through MemorizeService on both stores: nicknames, spelling variants and
possessive references merge into the known object of the same user (confirmed by one batched model call, or
none when the names are equal after a light normalisation); a pair the model rejects stays apart; the merge is
recorded with its evidence, found by the alias, undone by ``unmerge`` and dropped with the events it came from.

Real stores and embedder; the LLM is a scripted double: extraction from a table of message texts, and a
``same_entity`` judge that accepts the name pairs a test lists (and records every pair it is asked about).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from schemas.events import ChatMessage, Forget, ForgetScope
from services import ids
from services.adapters.minilm import MiniLMEmbedder
from services.adapters.sqlite import SqliteMemoryStore
from services.domain import EdgeKind, VertexKind
from services.llm.scripted import MEMORIZE_RULES, ScriptedLLM
from services.memorize.entities import _possessive_of
from services.memorize.forget import ForgetService
from services.memorize.service import MemorizeService
from services.memorize.unmerge import NotAnAlias, unmerge
from services.ports import LLMRequest
from services.qa.matching import EntityMatcher
from services.settings import Settings
from tests.contract.conftest import remote_addresses
from tests.test_forget_memory import snapshot

T0 = datetime(2024, 5, 1, 9, 0, tzinfo=UTC)
INGEST = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
ADA, BEN = "entities-ada", "entities-ben"
_ITEM = re.compile(r"^\[(\d+)\] ([^,]{1,80}), [A-Za-z]+ \d{1,2} [A-Za-z]+ \d{4}: (.*)$")
_NAMES = re.compile(r'^\[(\d+)\] A: "(.*)" \(.*\)\n\s+B: "(.*)" \(.*\)$', re.MULTILINE)

#: message text -> (subject, relation, object) of its one fact; the fact's text is the message's
FACTS = {
    "Melanie paints landscapes.": ("Melanie", "paints", "landscapes"),
    "Mel went camping at Lake Tahoe.": ("Mel", "went camping at", "Lake Tahoe"),
    "Mel bought a kayak.": ("Mel", "bought", "kayak"),
    "Rosalind teaches violin.": ("Rosalind", "teaches", "violin"),
    "Rosalin moved to Lyon.": ("Rosalin", "moved to", "Lyon"),
    "Dana's mother grows tomatoes.": ("Dana's mother", "grows", "tomatoes"),
    "Dana's mom retired last spring.": ("Dana's mom", "retired", ""),
    "My mother grows tomatoes.": ("my mother", "grows", "tomatoes"),
    "My mom retired last spring.": ("my mom", "retired", ""),
    "My mom bakes bread.": ("my mom", "bakes", "bread"),
    "Maria owns a bakery.": ("Maria", "owns", "bakery"),
    "Mario fixes motorbikes.": ("Mario", "fixes", "motorbikes"),
    "Dana volunteers at St. Mary's.": ("Dana", "volunteers at", "St. Mary's"),
    "Dana met Theo at St Marys.": ("Dana", "met Theo at", "St Marys"),
}
ACCEPT = {frozenset(p) for p in [("Mel", "Melanie"), ("Rosalin", "Rosalind"), ("Dana's mom", "Dana's mother")]}


def extract(request: LLMRequest) -> dict[str, Any]:
    content = next(m.content for m in reversed(request.messages) if m.role == "user" and "[1] " in m.content)
    messages = []
    for line in content.splitlines():
        match = _ITEM.match(line)
        if match:
            n, _, text = match.groups()
            subject, relation, obj = FACTS[text]
            fact = {"subject": subject, "fact": text, "relation": relation, "object": obj, "when": ""}
            messages.append({"m": int(n), "facts": [fact | {"kind": "FACT", "temporal": "DYNAMIC"}]})
    return {"messages": messages}


@dataclass
class Judge:
    """The ``same_entity`` double: a nickname for the accepted pairs, else another entity; ``broken``: an answer
    off the contract."""

    accept: set[frozenset[str]]
    broken: bool = False
    skip: bool = False  # answer no pair at all
    asked: list[list[tuple[str, str]]] = field(default_factory=list)

    def __call__(self, request: LLMRequest) -> dict[str, Any] | str:
        pairs = [(a, b) for _, a, b in _NAMES.findall(request.messages[-1].content)]
        self.asked.append(pairs)
        if self.broken:
            return "no idea"
        verdicts = ["nickname" if frozenset(p) in self.accept else "other" for p in pairs]
        if self.skip:
            return {"pairs": []}
        return {"pairs": [{"p": n, "verdict": v} for n, v in enumerate(verdicts, start=1)]}


@pytest.fixture(scope="module")
def embedder() -> MiniLMEmbedder:
    return MiniLMEmbedder()


def chat(n: int, text: str, user: str = ADA, speaker: str = "Dana") -> ChatMessage:
    return ChatMessage(
        event_id=f"{user}-m{n}",
        user_id=user,
        conversation_id="c1",
        speaker=speaker,
        text=text,
        event_time=T0 + timedelta(minutes=n),
        ingest_time=INGEST + timedelta(seconds=n),
    )


@dataclass
class Memory:
    store: Any
    judge: Judge
    memorize: MemorizeService
    forget: ForgetService

    async def said(self, *batches: Iterable[ChatMessage]) -> None:
        for batch in batches:  # each batch is one memorize call (one extraction, one resolution)
            outcome = await self.memorize.memorize(list(batch))
            assert not outcome.dead_letters

    async def theses_of(self, name: str, user: str = ADA) -> list[str]:
        vertex = (await self.store.find_objects(user, [ids.normalize_name(name)]))[ids.normalize_name(name)]
        around = await self.store.neighbors(user, [vertex.id], [EdgeKind.THESIS])
        return sorted(t.end.name for t in around if t.end.kind is VertexKind.THESIS)


@pytest.fixture(params=["sqlite", pytest.param("remote", marks=pytest.mark.server)])
async def open_memory(request: pytest.FixtureRequest, tmp_path: Path, embedder: MiniLMEmbedder) -> AsyncIterator[Any]:
    """``make(name, accept=..., **settings)``: a fresh memory (remote: the one store, this module's users erased)."""
    stores: list[Any] = []

    async def make(name: str, accept: set[frozenset[str]] = ACCEPT, **overrides: Any) -> Memory:
        if request.param == "sqlite":
            store: Any = await SqliteMemoryStore.open(tmp_path / f"{name}.sqlite3", dim=embedder.dim)
            stores.append(store)
        else:
            from services.adapters.remote import RemoteMemoryStore

            if not stores:
                dgraph, http, grpc = remote_addresses()
                stores.append(
                    await RemoteMemoryStore.open(dgraph, http, grpc, embedder.dim, prefix="MemstreamEntities")
                )
            store = stores[0]
            for user in (ADA, BEN):
                await store.delete_user(user)
                await store.forget(user, None)
        judge = Judge(set(accept))
        llm = ScriptedLLM(
            {"extract": extract, "resolve": MEMORIZE_RULES["resolve"], "same_entity": judge}, model="scripted-entities"
        )
        settings = Settings(_env_file=None, data_dir=tmp_path, **overrides)  # type: ignore[call-arg]
        memorize = MemorizeService(store.stores(), llm, embedder, settings)
        return Memory(store, judge, memorize, ForgetService(store, store, store, embedder))

    yield make
    for store in stores:
        await store.close()


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_a_nickname_joins_the_known_object_with_its_evidence(open_memory: Any) -> None:
    memory = await open_memory("nickname")
    await memory.said([chat(1, "Melanie paints landscapes.")], [chat(2, "Mel went camping at Lake Tahoe.")])
    assert memory.judge.asked == [[("Mel", "Melanie")]]  # one call for the batch, this pair only
    assert await memory.theses_of("Melanie") == ["Mel went camping at Lake Tahoe.", "Melanie paints landscapes."]
    record = (await memory.store.find_objects(ADA, ["mel"]))["mel"]
    melanie = ids.object_id(ADA, "Melanie")
    assert record.alias_of == melanie and record.name == "Mel"
    evidence = json.loads(record.props["alias_evidence"])
    assert evidence["method"] == "confirmed" and evidence["verdict"] == "same" and evidence["event_id"] == f"{ADA}-m2"
    assert evidence["name_score"] >= 80
    thesis = ids.thesis_id(ADA, "Mel went camping at Lake Tahoe.")
    stored = (await memory.store.get_vertices(ADA, [thesis]))[thesis]
    assert stored.props["subject"] == "Melanie" and stored.props["subject_alias"] == "Mel"
    relation = ids.edge_id(ADA, "relation", melanie, "went camping at", ids.object_id(ADA, "Lake Tahoe"))
    assert relation in await memory.store.get_triplets(ADA, [relation])
    # a question naming "Mel" reaches Melanie, exactly and by the alias's own index entry
    matcher = EntityMatcher(memory.store, memory.store, memory.memorize.embedder)
    matches = (await matcher.match(ADA, ["Mel"]))["Mel"]
    assert matches[0].vertex.id == melanie and matches[0].exact
    # the alias is known now: its next mention resolves without a call
    await memory.said([chat(3, "Mel bought a kayak.")])
    assert len(memory.judge.asked) == 1
    assert "Mel bought a kayak." in await memory.theses_of("Melanie")


async def test_spelling_variant_and_possessive_in_one_call(open_memory: Any) -> None:
    memory = await open_memory("variants")
    await memory.said(
        [chat(1, "Rosalind teaches violin."), chat(2, "Dana's mother grows tomatoes.")],
        [chat(3, "Rosalin moved to Lyon."), chat(4, "Dana's mom retired last spring.")],
    )
    assert len(memory.judge.asked) == 1  # both ambiguous pairs of the batch in ONE call
    assert {frozenset(p) for p in memory.judge.asked[0]} == {
        frozenset(("Rosalin", "Rosalind")),
        frozenset(("Dana's mom", "Dana's mother")),
    }
    assert await memory.theses_of("Rosalind") == ["Rosalin moved to Lyon.", "Rosalind teaches violin."]
    assert await memory.theses_of("Dana's mother") == [
        "Dana's mom retired last spring.",
        "Dana's mother grows tomatoes.",
    ]


async def test_my_mom_is_the_speakers_mother(open_memory: Any) -> None:
    """A possessive said in the first person names the speaker's relative: Dana's "my mom" joins Dana's mother
    (confirmed like any variant), Eli's "my mom" is another person."""
    memory = await open_memory("possessive")
    await memory.said(
        [chat(1, "My mother grows tomatoes.")],
        [chat(2, "My mom retired last spring."), chat(3, "My mom bakes bread.", speaker="Eli")],
    )
    assert await memory.theses_of("Dana's mother") == [
        "Dana's mom retired last spring.",
        "Dana's mother grows tomatoes.",
    ]
    assert await memory.theses_of("Eli's mom") == ["Eli's mom bakes bread."]
    assert "my mom" not in await memory.store.find_objects(ADA, ["my mom", "my mother"])
    assert len(memory.judge.asked) == 1


async def test_a_near_name_the_model_rejects_stays_apart(open_memory: Any) -> None:
    memory = await open_memory("rejected")
    await memory.said([chat(1, "Maria owns a bakery.")], [chat(2, "Mario fixes motorbikes.")])
    assert memory.judge.asked == [[("Mario", "Maria")]]
    assert await memory.theses_of("Maria") == ["Maria owns a bakery."]
    mario = (await memory.store.find_objects(ADA, ["mario"]))["mario"]
    assert mario.alias_of is None
    assert await memory.theses_of("Mario") == ["Mario fixes motorbikes."]


async def test_a_pair_the_model_skips_is_not_merged(open_memory: Any) -> None:
    memory = await open_memory("skipped")
    memory.judge.skip = True
    await memory.said([chat(1, "Melanie paints landscapes.")], [chat(2, "Mel went camping at Lake Tahoe.")])
    assert memory.judge.asked == [[("Mel", "Melanie")]]
    assert await memory.theses_of("Mel") == ["Mel went camping at Lake Tahoe."]
    assert (await memory.store.find_objects(ADA, ["mel"]))["mel"].alias_of is None


async def test_names_equal_after_light_normalisation_merge_without_a_call(open_memory: Any) -> None:
    memory = await open_memory("clear")
    await memory.said([chat(1, "Dana volunteers at St. Mary's.")], [chat(2, "Dana met Theo at St Marys.")])
    assert memory.judge.asked == []
    record = (await memory.store.find_objects(ADA, ["st marys"]))["st marys"]
    assert record.alias_of == ids.object_id(ADA, "St. Mary's")
    assert json.loads(record.props["alias_evidence"])["method"] == "normalized"


async def test_new_names_of_one_batch_resolve_against_each_other(open_memory: Any) -> None:
    memory = await open_memory("batch")
    await memory.said([chat(1, "Mel went camping at Lake Tahoe."), chat(2, "Melanie paints landscapes.")])
    assert memory.judge.asked == [[("Mel", "Melanie")]]
    # the fuller name is the object; the short one its alias
    assert await memory.theses_of("Melanie") == ["Mel went camping at Lake Tahoe.", "Melanie paints landscapes."]
    assert (await memory.store.find_objects(ADA, ["mel"]))["mel"].alias_of == ids.object_id(ADA, "Melanie")


class CountedSearches:
    """The vector store, counting the entity step's searches: dense ones one by one, dense ones together, lexical."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.dense_one: list[int] = []
        self.dense_many: list[int] = []
        self.lexical: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def search(self, user_id: str, kinds: Any, vector: Any, text: Any, k: int = 10) -> Any:
        if vector is not None:
            self.dense_one.append(1)
        if text is not None:
            self.lexical.append(text)
        return await self.inner.search(user_id, kinds, vector, text, k)

    async def search_many(self, user_id: str, kinds: Any, vectors: Any, k: int = 10) -> Any:
        self.dense_many.append(len(vectors))
        return await self.inner.search_many(user_id, kinds, vectors, k)


async def test_the_new_names_of_a_batch_are_searched_in_one_dense_read(open_memory: Any) -> None:
    memory = await open_memory("reads")
    await memory.said([chat(1, "Melanie paints landscapes."), chat(2, "Rosalind teaches violin.")])
    counted = memory.memorize.entities.vectors = CountedSearches(memory.memorize.entities.vectors)
    await memory.said([chat(3, "Mel went camping at Lake Tahoe."), chat(4, "Rosalin moved to Lyon.")])
    new_names = ["Lake Tahoe", "Lyon", "Mel", "Rosalin"]
    assert counted.dense_many == [len(new_names)] and counted.dense_one == []  # one read for the batch's names
    assert sorted(counted.lexical) == new_names  # and each name's words, sent at once
    # the same pairs as one search each found: both confirmed in the batch's one call
    assert sorted(memory.judge.asked[-1]) == [("Mel", "Melanie"), ("Rosalin", "Rosalind")]


async def test_a_failed_confirmation_merges_nothing_and_is_counted(open_memory: Any) -> None:
    memory = await open_memory("failed")
    memory.judge.broken = True
    before = sample("memstream_entity_pairs_total", verdict="failed")
    await memory.said([chat(1, "Melanie paints landscapes.")], [chat(2, "Mel went camping at Lake Tahoe.")])
    assert len(memory.judge.asked) == memory.memorize.settings.extraction_attempts  # retried, then given up
    assert sample("memstream_entity_pairs_total", verdict="failed") == before + 1
    assert await memory.theses_of("Melanie") == ["Melanie paints landscapes."]
    assert await memory.theses_of("Mel") == ["Mel went camping at Lake Tahoe."]


async def test_no_merge_across_users(open_memory: Any) -> None:
    memory = await open_memory("isolation")
    await memory.said([chat(1, "Melanie paints landscapes.", user=BEN)], [chat(2, "Mel went camping at Lake Tahoe.")])
    assert memory.judge.asked == []  # ben's Melanie is never a candidate for ada's Mel
    assert (await memory.store.find_objects(ADA, ["mel"]))["mel"].alias_of is None
    assert await memory.theses_of("Mel") == ["Mel went camping at Lake Tahoe."]
    assert await memory.theses_of("Melanie", user=BEN) == ["Melanie paints landscapes."]


async def structure(store: Any, user: str) -> Any:
    """Per object name its theses, the relation triplets by name, and which episodes each vertex comes from."""
    episodes = await store.episodes(user, None)
    links = await store.neighbors(user, [e.id for e in episodes], [EdgeKind.EPISODIC])
    objects = {t.start.id: t.start for t in links if t.start.kind is VertexKind.OBJECT}
    around = await store.neighbors(user, sorted(objects), [EdgeKind.THESIS, EdgeKind.RELATION])
    theses = {
        name: sorted(t.end.name for t in around if t.edge.kind is EdgeKind.THESIS and t.start.name == name)
        for name in sorted(v.name for v in objects.values())
    }
    relations = sorted(
        {
            (t.start.name, t.edge.relation, t.end.name, t.edge.t_invalid)
            for t in around
            if t.edge.kind is EdgeKind.RELATION
        }
    )
    indexed = await store.get_vectors(user, [t.edge.id for t in around if t.edge.kind is EdgeKind.RELATION])
    sources = sorted((t.start.name, t.end.props["event_id"]) for t in links)
    return theses, relations, sorted(indexed), sources


async def test_unmerge_restores_both_objects_and_their_facts(open_memory: Any) -> None:
    batches = ([chat(1, "Melanie paints landscapes.")], [chat(2, "Mel went camping at Lake Tahoe.")])
    merged = await open_memory("merged")
    await merged.said(*batches)
    done = await unmerge(merged.store.stores(), merged.memorize.embedder, ADA, "mel")
    assert done.theses_moved == 1 and done.canonical_id == ids.object_id(ADA, "Melanie") and not done.canonical_removed
    after = await structure(merged.store, ADA)
    with pytest.raises(NotAnAlias):
        await unmerge(merged.store.stores(), merged.memorize.embedder, ADA, "Mel")
    # later mentions of the name stay with it: an exact name is never resolved again
    await merged.said([chat(3, "Mel bought a kayak.")])
    assert await merged.theses_of("Mel") == ["Mel bought a kayak.", "Mel went camping at Lake Tahoe."]
    assert len(merged.judge.asked) == 1

    apart = await open_memory("apart", entity_candidates=0)  # exact names only: how it would be had none merged
    await apart.said(*batches)
    assert apart.judge.asked == []
    assert after == await structure(apart.store, ADA)


async def test_forgetting_the_only_evidence_drops_the_alias(open_memory: Any) -> None:
    full = await open_memory("full")
    await full.said([chat(1, "Melanie paints landscapes.")], [chat(2, "Mel went camping at Lake Tahoe.")])
    await full.forget.forget(
        Forget(event_id="f1", user_id=ADA, scope=ForgetScope.MESSAGE, target=f"{ADA}-m2", event_time=INGEST), "chat"
    )
    assert "mel" not in await full.store.find_objects(ADA, ["mel"])
    after = await snapshot(full.store, ADA)
    never = await open_memory("never")
    await never.said([chat(1, "Melanie paints landscapes.")])
    assert after == await snapshot(never.store, ADA)


async def test_an_alias_said_twice_outlives_forgetting_one_of_them(open_memory: Any) -> None:
    memory = await open_memory("twice")
    await memory.said(
        [chat(1, "Melanie paints landscapes.")],
        [chat(2, "Mel went camping at Lake Tahoe.")],
        [chat(3, "Mel bought a kayak.")],
    )
    await memory.forget.forget(
        Forget(event_id="f1", user_id=ADA, scope=ForgetScope.MESSAGE, target=f"{ADA}-m2", event_time=INGEST), "chat"
    )
    assert (await memory.store.find_objects(ADA, ["mel"]))["mel"].alias_of == ids.object_id(ADA, "Melanie")
    assert await memory.theses_of("Melanie") == ["Mel bought a kayak.", "Melanie paints landscapes."]


async def test_the_cli_unmerges_an_alias(
    tmp_path: Path, embedder: MiniLMEmbedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from memstream.cli import app

    settings = Settings(_env_file=None, data_dir=tmp_path)  # type: ignore[call-arg]
    store = await SqliteMemoryStore.open(settings.store_path, dim=embedder.dim)
    llm = ScriptedLLM({"extract": extract, "resolve": MEMORIZE_RULES["resolve"], "same_entity": Judge(set(ACCEPT))})
    memorize = MemorizeService(store.stores(), llm, embedder, settings)
    for batch in ([chat(1, "Melanie paints landscapes.")], [chat(2, "Mel went camping at Lake Tahoe.")]):
        await memorize.memorize(batch)
    await store.close()
    monkeypatch.setenv("MEMSTREAM_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("MEMSTREAM_STORE", "sqlite")
    runner = CliRunner()
    done = await asyncio.to_thread(runner.invoke, app, ["entities", "unmerge", ADA, "Mel"])
    assert done.exit_code == 0, done.output
    assert "1 fact(s) moved" in done.output
    again = await asyncio.to_thread(runner.invoke, app, ["entities", "unmerge", ADA, "Mel"])
    assert again.exit_code == 1 and "no merged alias" in again.output
    store = await SqliteMemoryStore.open(settings.store_path, dim=embedder.dim)
    try:
        mel = (await store.find_objects(ADA, ["mel"]))["mel"]
        assert mel.alias_of is None
        assert [t.end.name for t in await store.neighbors(ADA, [mel.id], [EdgeKind.THESIS])] == [
            "Mel went camping at Lake Tahoe."
        ]
    finally:
        await store.close()


def test_a_possessor_is_never_a_candidate_for_what_it_owns() -> None:
    """ "Dana" is a speaker's object of every message since episodes hang from it; "Dana's mom" is someone else."""
    assert _possessive_of("Dana", "Dana's mom") and _possessive_of("Dana\u2019s Mom", "dana")
    assert not _possessive_of("Dan", "Dana's mom") and not _possessive_of("Rosalin", "Rosalind")
