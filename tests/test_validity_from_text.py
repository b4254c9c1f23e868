"""Validity from the text: a thesis holds from the time its words name, not from when they were said.

"I went to Paris last weekend", said Friday 12 May 2023, holds from 6 May; "from 2019 to 2021" ended on 1 January
2022; words that name no time the resolver can place ("since I was 12") keep the message time; a plan keeps it
too. Invalidation orders by these world times: "Back in 2019 I worked at Bosch", said after "I work at Siemens",
is about an earlier time and leaves Siemens current. Through ``ChangeSetBuilder`` (a table of cases) and through
``MemorizeService`` on SQLite with a scripted extraction, then ``as_of`` retrieval.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from schemas.events import ChatMessage, ForgetScope
from services import ids
from services.adapters.minilm import MiniLMEmbedder
from services.adapters.sqlite import SqliteMemoryStore
from services.domain import EdgeKind, Vertex, VertexKind
from services.llm.scripted import ScriptedLLM, rule_resolve_check
from services.memorize.builder import ChangeSetBuilder, KnownRef, Source, thesis_text, validity
from services.memorize.extraction import ExtractionInput, ExtractTask, Fact, Item, ItemFacts
from services.memorize.forget import ForgetService
from services.memorize.service import MemorizeService
from services.memorize.when import resolve
from services.ports import LLMRequest
from services.retrieval.base import RetrievalRequest
from services.retrieval.registry import get_retriever
from services.settings import Settings
from tests import test_forget_memory
from tests.contract.conftest import remote_addresses

embedder = test_forget_memory.embedder

USER = "when-caroline"  # this module's own user: the remote store is shared with other modules' tests
SAID = datetime(2023, 5, 12, 15, 0, tzinfo=UTC)  # Friday 12 May 2023
AUG = datetime(2023, 8, 20, 10, 0, tzinfo=UTC)
INGEST = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def day(y: int, m: int, d: int) -> datetime:
    return datetime(y, m, d, tzinfo=UTC)


# words, kind, said at -> t_valid, t_invalid
CASES = [
    ("last weekend", "FACT", SAID, day(2023, 5, 6), None),  # an event: it stays a valid record after it
    ("yesterday", "FACT", SAID, day(2023, 5, 11), None),
    ("in March", "FACT", SAID, day(2023, 3, 1), None),
    ("since 2019", "FACT", SAID, day(2019, 1, 1), None),
    ("from 2019 to 2021", "FACT", SAID, day(2019, 1, 1), day(2022, 1, 1)),
    ("until June", "FACT", AUG, day(2023, 6, 1), day(2023, 7, 1)),  # said after June: it ended
    ("until June", "FACT", SAID, SAID, None),  # said in May: an end still to come is no t_invalid yet
    ("till last Friday", "FACT", SAID, day(2023, 5, 5), day(2023, 5, 6)),
    ("since I was 12", "FACT", SAID, SAID, None),  # unresolved: the message time, the words in the props
    ("", "FACT", SAID, SAID, None),
    ("next week", "PREDICTION", SAID, SAID, None),  # a plan holds, as a plan, from when it was said
    ("tomorrow", "FACT", SAID, SAID, None),  # never later than said
]


def source(said: datetime, event_id: str = "m1", text: str = "text") -> Source:
    return Source(event_id, 0, text, said, INGEST, {})


def fact(place: str, words: str, said: datetime, kind: str = "FACT", relation: str = "works at") -> Fact:
    when = resolve(words, said, future=kind == "PREDICTION") if words else None
    return Fact(
        subject="Ada",
        text=f"Ada {relation} {place}.",
        relation=relation,
        object=place,
        kind=kind,
        temporal="DYNAMIC",
        when=when,
        unresolved=words if when is None else "",
    )


def relation_edge(user: str, place: str, relation: str = "works at", subject: str = "Ada") -> str:
    source, target = ids.object_id(user, subject), ids.object_id(user, place)
    return ids.edge_id(user, EdgeKind.RELATION.value, source, relation, target)


@pytest.mark.parametrize(("words", "kind", "said", "t_valid", "t_invalid"), CASES)
def test_the_builder_takes_validity_from_the_time_words(
    words: str, kind: str, said: datetime, t_valid: datetime, t_invalid: datetime | None
) -> None:
    builder = ChangeSetBuilder("ada", "c", ["m1"])
    [thesis_id] = builder.add(source(said), ItemFacts(facts=[fact("Paris", words, said, kind)]))
    cs = builder.build(0)
    vertices = {v.id: v for v in cs.vertices}
    thesis, episode = vertices[thesis_id], next(v for v in cs.vertices if v.kind is VertexKind.EPISODIC)
    assert (thesis.t_valid, thesis.t_invalid) == (t_valid, t_invalid)
    assert thesis.invalidated_by is None and cs.invalidations == []  # nothing invalidated it: its words ended it
    assert thesis.t_expired == (INGEST if t_invalid else None)
    assert episode.t_valid == said  # what was said when
    if words and "12" not in words:
        assert thesis.props["when_text"] == words and "when_unresolved" not in thesis.props
    if "12" in words:  # nothing said is lost: the words, in the props and (no date to show) in the text
        assert thesis.props["when_unresolved"] == words and "when_text" not in thesis.props
        assert thesis.name == 'Ada works at Paris (as said: "since I was 12").'
    edges = {e.id: e for e in cs.edges}
    edge = edges[relation_edge("ada", "Paris")]
    assert (edge.t_valid, edge.t_invalid, edge.invalidated_by) == (t_valid, t_invalid, None)
    assert all(e.t_valid == t_valid for e in cs.edges if e.kind is EdgeKind.THESIS)


def known(place: str, t_valid: datetime) -> KnownRef:
    props = {"subject": "Ada", "relation": "works at", "object": place}
    vertex = Vertex(id=f"t_{place}", user_id="ada", kind=VertexKind.THESIS, name=f"Ada works at {place}.", props=props)
    return KnownRef.of(vertex.model_copy(update={"t_valid": t_valid}))


@pytest.mark.parametrize(
    ("words", "invalidated", "t_invalid"),
    [
        # about an earlier time than the known state (10 May): it is the one that ended, when Siemens began
        ("back in 2019", "new", day(2023, 5, 10)),
        # it ended on its own before Siemens began: neither is invalidated, its own end stays
        ("from 2019 to 2021", None, day(2022, 1, 1)),
        # no time words: said after Siemens, it replaces it
        ("", "old", SAID),
        # a later time than the known state: it replaces it from the day it names
        ("yesterday", "old", day(2023, 5, 11)),
    ],
)
def test_invalidation_orders_by_the_times_the_words_name(
    words: str, invalidated: str | None, t_invalid: datetime
) -> None:
    builder = ChangeSetBuilder("ada", "c", ["m2"])
    old = known("Siemens", day(2023, 5, 10))
    [new_id] = builder.add(source(SAID, "m2"), ItemFacts(facts=[fact("Bosch", words, SAID)]))
    builder.invalidate(old, new_id, source(SAID, "m2"))
    cs = builder.build(0)
    new = next(v for v in cs.vertices if v.id == new_id)
    by_thesis = {i.thesis_id: i for i in cs.invalidations}
    bosch = next(e for e in cs.edges if e.id == relation_edge("ada", "Bosch"))
    if invalidated == "new":
        assert set(by_thesis) == {new_id} and by_thesis[new_id].invalidated_by == old.id
        assert by_thesis[new_id].t_invalid == t_invalid and cs.edge_invalidations == []
        assert (bosch.t_invalid, bosch.invalidated_by) == (t_invalid, old.id)
    elif invalidated == "old":
        assert set(by_thesis) == {old.id} and by_thesis[old.id].invalidated_by == new_id
        assert by_thesis[old.id].t_invalid == t_invalid
        assert new.t_invalid is None and bosch.t_invalid is None
    else:
        assert cs.invalidations == [] and cs.edge_invalidations == []
        assert (new.t_invalid, new.invalidated_by) == (t_invalid, None)
        assert (bosch.t_invalid, bosch.invalidated_by) == (t_invalid, None)


# --- through MemorizeService on SQLite, with a scripted extraction ----------------------------------------------

_ITEM = re.compile(r"^\[(\d+)\] ([^,]{1,80}), [A-Za-z]+ \d{1,2} [A-Za-z]+ \d{4}: (.*)$")
_PAIR = re.compile(r"^\[(\d+)\] NEW \([^)]*\): (.*)\n\s+KNOWN \([^)]*\): (.*)$", re.MULTILINE)

# message text -> (fact, relation, object, when words, kind)
SCRIPT = {
    "I went to the support group last weekend.": ("went to", "support group", "last weekend", "FACT"),
    "I went to the gym yesterday.": ("went to", "gym", "yesterday", "FACT"),
    "I went to the gym today.": ("went to", "gym", "today", "FACT"),
    "I painted a lake in March.": ("painted", "lake", "in March", "FACT"),
    "I lived in Boston from 2019 to 2021.": ("lived in", "Boston", "from 2019 to 2021", "FACT"),
    "I coached the team until June.": ("coached", "team", "until June", "FACT"),
    "I have played the violin since I was 12.": ("has played", "violin", "since I was 12", "FACT"),
    "Next week I fly to Rome.": ("will fly to", "Rome", "next week", "PREDICTION"),
    "I work at Siemens.": ("works at", "Siemens", "", "FACT"),
    "Back in 2019 I worked at Bosch.": ("works at", "Bosch", "back in 2019", "FACT"),
}


def extract(request: LLMRequest) -> dict[str, Any]:
    content = next(m.content for m in reversed(request.messages) if m.role == "user" and "[1] " in m.content)
    messages = []
    for line in content.splitlines():
        match = _ITEM.match(line)
        if match:
            n, speaker, text = match.groups()
            relation, obj, words, kind = SCRIPT[text]
            facts = [
                {
                    "subject": speaker,
                    "fact": f"{speaker} {relation} {obj}.",
                    "relation": relation,
                    "object": obj,
                    "when": words,
                    "kind": kind,
                    "temporal": "DYNAMIC",
                }
            ]
            messages.append({"m": int(n), "facts": facts})
    return {"messages": messages}


def resolve_pairs(request: LLMRequest) -> dict[str, Any]:
    """Another employer replaces the known one; the model is asked only about same-relation pairs."""
    pairs = [
        {"p": int(n), "verdict": "updates" if "works at" in new and "works at" in old else "compatible"}
        for n, new, old in _PAIR.findall(request.messages[-1].content)
    ]
    return {"pairs": pairs}


def chat(n: int, text: str, said: datetime) -> ChatMessage:
    return ChatMessage(
        event_id=f"{USER}-m{n}",
        user_id=USER,
        conversation_id="c1",
        speaker="Caroline",
        text=text,
        event_time=said,
        ingest_time=INGEST + timedelta(seconds=n),
    )


@pytest.fixture(params=["sqlite", pytest.param("remote", marks=pytest.mark.server)])
async def memory(request: pytest.FixtureRequest, tmp_path: Path, embedder: MiniLMEmbedder) -> AsyncIterator[Any]:
    """A fresh memory, on SQLite (a file) or on the remote store (this module's user erased first)."""
    store: Any
    if request.param == "sqlite":
        store = await SqliteMemoryStore.open(tmp_path / "m.sqlite3", dim=embedder.dim)
    else:
        from services.adapters.remote import RemoteMemoryStore

        dgraph, http, grpc = remote_addresses()
        store = await RemoteMemoryStore.open(dgraph, http, grpc, embedder.dim, prefix="MemstreamWhen")
        await store.delete_user(USER)
    llm = ScriptedLLM(
        {"extract": extract, "resolve": resolve_pairs, "resolve_check": rule_resolve_check}, model="scripted-when"
    )
    settings = Settings(_env_file=None, data_dir=tmp_path)  # type: ignore[call-arg]
    yield store, MemorizeService(store.stores(), llm, embedder, settings)
    await store.close()


async def theses(store: Any, obj: str) -> list[Vertex]:
    found = await store.neighbors(USER, [ids.object_id(USER, obj)], [EdgeKind.THESIS])
    return [t.end for t in found if t.end.kind is VertexKind.THESIS]


MEMORIZED = [
    ("I went to the support group last weekend.", SAID, "support group", day(2023, 5, 6), None),
    ("I went to the gym yesterday.", SAID, "gym", day(2023, 5, 11), None),
    ("I painted a lake in March.", SAID, "lake", day(2023, 3, 1), None),
    ("I lived in Boston from 2019 to 2021.", SAID, "Boston", day(2019, 1, 1), day(2022, 1, 1)),
    ("I coached the team until June.", AUG, "team", day(2023, 6, 1), day(2023, 7, 1)),
    ("I have played the violin since I was 12.", SAID, "violin", SAID, None),
    ("Next week I fly to Rome.", SAID, "Rome", SAID, None),
]


@pytest.mark.parametrize(("text", "said", "obj", "t_valid", "t_invalid"), MEMORIZED)
async def test_memorize_stores_the_validity_the_words_name(
    memory: tuple[Any, MemorizeService],
    text: str,
    said: datetime,
    obj: str,
    t_valid: datetime,
    t_invalid: datetime | None,
) -> None:
    store, service = memory
    outcome = await service.memorize([chat(1, text, said)])
    assert not outcome.dead_letters
    [thesis] = await theses(store, obj)
    assert (thesis.t_valid, thesis.t_invalid, thesis.invalidated_by) == (t_valid, t_invalid, None)
    words = SCRIPT[text][2]
    if resolve(words, said) is None:  # said, with no date the resolver can place: kept as said
        assert thesis.props["when_unresolved"] == words and f'"{words}"' in thesis.name
    edge_id = relation_edge(USER, obj, SCRIPT[text][0], subject="Caroline")
    edge = (await store.get_triplets(USER, [edge_id]))[edge_id].edge
    assert (edge.t_valid, edge.t_invalid) == (t_valid, t_invalid)
    [episode] = await store.episodes(USER, None)
    assert episode.t_valid == said


async def test_a_later_message_about_an_earlier_time_does_not_supersede_the_newer_state(
    memory: tuple[Any, MemorizeService],
) -> None:
    store, service = memory
    await service.memorize([chat(1, "I work at Siemens.", day(2023, 5, 10))])
    await service.memorize([chat(2, "Back in 2019 I worked at Bosch.", SAID)])
    [siemens], [bosch] = await theses(store, "Siemens"), await theses(store, "Bosch")
    assert siemens.t_invalid is None and siemens.valid_at(None)
    assert bosch.t_valid == day(2019, 1, 1)
    assert (bosch.t_invalid, bosch.invalidated_by) == (day(2023, 5, 10), siemens.id)
    assert [v.id for v in await store.valid_theses(USER)] == [siemens.id]
    assert bosch.valid_at(day(2020, 6, 1)) and not siemens.valid_at(day(2020, 6, 1))


@pytest.mark.parametrize("name", ["flat", "beamsearch"])
async def test_as_of_sees_a_fact_from_the_day_its_words_name(
    memory: tuple[Any, MemorizeService], embedder: MiniLMEmbedder, name: str
) -> None:
    store, service = memory
    await service.memorize([chat(1, "I went to the support group last weekend.", SAID)])
    query = "When did Caroline go to the support group?"
    [vector] = await embedder.embed([query])

    async def found(as_of: datetime) -> bool:
        request = RetrievalRequest(
            user_id=USER,
            query=query,
            query_vector=list(vector),
            seeds=[ids.object_id(USER, "Caroline")],
            budget=20,
            as_of=as_of,
        )
        triplets = await get_retriever(name, store, store).retrieve(request)
        return any("support group" in t.text and "6 May 2023" in t.text for t in triplets)

    assert await found(day(2023, 5, 8))  # after the weekend, before it was said
    assert await found(SAID)
    assert not await found(day(2023, 5, 5))  # before it happened


async def test_forgetting_the_first_source_keeps_the_time_the_words_name(
    memory: tuple[Any, MemorizeService], embedder: MiniLMEmbedder
) -> None:
    """Both messages date the gym to 11 May (one thesis, two sources): without the first, it still holds from
    11 May, not from when the second was said."""
    store, service = memory
    await service.memorize([chat(1, "I went to the gym yesterday.", SAID)])
    await service.memorize([chat(2, "I went to the gym today.", day(2023, 5, 11) + timedelta(hours=20))])
    [thesis] = await theses(store, "gym")
    assert thesis.t_valid == day(2023, 5, 11)
    forget = ForgetService(store, store, store, embedder)
    tombstone = test_forget_memory.tombstone(ForgetScope.MESSAGE, f"{USER}-m1", user=USER)
    await forget.forget(tombstone, "chat")
    [kept] = await theses(store, "gym")
    assert kept.id == thesis.id and kept.props["event_id"] == f"{USER}-m2"
    assert kept.t_valid == day(2023, 5, 11)


# --- the model-free fallback: the message's own time words when the model gave none ------------------------------

# message, said at -> t_valid, t_invalid of its one fact (the model's ``when`` left empty)
FALLBACK = [
    ("I coached the team until June.", AUG, day(2023, 6, 1), day(2023, 7, 1)),  # ended, no start: June
    ("I coached the team until June.", SAID, SAID, None),  # an end still to come
    ("I coached the team till last Friday.", SAID, day(2023, 5, 5), day(2023, 5, 6)),
    ("I coached the team up until 2020.", SAID, day(2020, 1, 1), day(2021, 1, 1)),
    ("I coached the team from 2019 to 2021.", SAID, day(2019, 1, 1), day(2022, 1, 1)),
    ("I coached the team from May to July.", AUG, day(2023, 5, 1), day(2023, 8, 1)),
    ("I coached the team from June 2020 until March 2021.", SAID, day(2020, 6, 1), day(2021, 4, 1)),
    ("I have coached the team since March 2020.", SAID, day(2020, 3, 1), None),  # since: it still holds
    ("I have coached the team since last year.", SAID, day(2022, 1, 1), None),
    ("I have coached the team since I was 12.", SAID, SAID, None),  # no date in it: the message time
    ("I coached the team on May 7, 2021.", SAID, day(2021, 5, 7), None),  # the year after the comma is its year
    ("I coached the team from May 7, 2021 to June 1, 2022.", SAID, day(2021, 5, 7), day(2022, 6, 2)),
]


@pytest.mark.parametrize(("text", "said", "t_valid", "t_invalid"), FALLBACK)
def test_the_fallback_reads_until_from_to_and_since_in_the_message(
    text: str, said: datetime, t_valid: datetime, t_invalid: datetime | None
) -> None:
    out = {
        "messages": [
            {
                "m": 1,
                "facts": [
                    {
                        "subject": "Ada",
                        "fact": "Ada coached the team.",
                        "relation": "coached",
                        "object": "team",
                        "when": "",
                    }
                ],
            }
        ]
    }
    [found] = ExtractTask().parse(json.dumps(out), ExtractionInput(items=[Item("Ada", text, said)]))
    [checked] = found.facts
    assert checked.unresolved == ""  # the model said no time words: nothing to keep
    t_valid_found, t_invalid_found = validity(checked.when, checked.kind, said)
    assert (t_valid_found, t_invalid_found) == (t_valid, t_invalid), checked.when


@pytest.mark.parametrize(
    ("words", "unresolved"),
    [
        ("since I was 12", "since I was 12"),  # said, and no date in it: kept
        ("when I was a kid", "when I was a kid"),
        ("in 2019", ""),  # not said in the message: the model's invention is not kept
        ("", ""),
    ],
)
def test_time_words_the_resolver_cannot_place_are_kept_with_the_fact(words: str, unresolved: str) -> None:
    text = "I have coached the team since I was 12, when I was a kid."
    out = {
        "messages": [
            {
                "m": 1,
                "facts": [
                    {
                        "subject": "Ada",
                        "fact": "Ada has coached the team.",
                        "relation": "coached",
                        "object": "team",
                        "when": words,
                    }
                ],
            }
        ]
    }
    [found] = ExtractTask().parse(json.dumps(out), ExtractionInput(items=[Item("Ada", text, SAID)]))
    [checked] = found.facts
    assert checked.when is None and checked.unresolved == unresolved
    said_in_text = Fact(
        "Ada",
        "Ada has coached the team since she was 12.",
        "coached",
        "team",
        "FACT",
        "DYNAMIC",
        unresolved="since she was 12",
    )
    assert thesis_text(said_in_text) == said_in_text.text  # the fact says them already: not twice
