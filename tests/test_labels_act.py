"""The labels act (issue 11 items 3 and 4): what a contradiction does depends on the labels of both theses.

Through MemorizeService on both stores (embedded SQLite; Dgraph + Weaviate), with the real embedder and a scripted
LLM: extraction gives each message the facts scripted for its words, and the resolve judge gives the verdict
scripted for each (new, known) pair, recording the pairs it was shown. The label rules themselves are applied in
code (``services.memorize.labels``), which the builder-level tests at the end check one by one.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from schemas.events import ChatMessage, ForgetScope, Query
from services import ids
from services.adapters.minilm import MiniLMEmbedder
from services.adapters.sqlite import SqliteMemoryStore
from services.domain import (
    Edge,
    EdgeKind,
    EpisodeLabel,
    Mark,
    TemporalLabel,
    Triplet,
    Vertex,
    VertexKind,
    thesis_marks,
    with_marks,
)
from services.llm.scripted import ScriptedLLM, rule_resolve_check, rule_same_entity
from services.memorize.builder import ChangeSetBuilder, KnownRef, Source
from services.memorize.extraction import Fact, ItemFacts
from services.memorize.forget import ForgetService
from services.memorize.labels import Outcome, Side, decide
from services.memorize.service import MemorizeService
from services.ports import LLMRequest
from services.qa.simple import SimpleQA
from services.settings import Settings
from tests.contract.conftest import remote_addresses
from tests.test_forget_memory import tombstone

T0 = datetime(2024, 3, 1, 9, 0, tzinfo=UTC)
INGEST = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
USER = "labels-ann"
_ITEM = re.compile(r"^\[(\d+)\] [^,]{1,80}, [A-Za-z]+ \d{1,2} [A-Za-z]+ \d{4}: (.*)$")
_PAIR = re.compile(r"^\[(\d+)\] NEW \(([^)]*)\): (.*)\n\s+KNOWN \(([^)]*)\): (.*)$", re.MULTILINE)


@dataclass(frozen=True)
class Said:
    """A message whose one fact is its own words, with the labels given."""

    text: str
    subject: str
    relation: str
    obj: str
    kind: str = "FACT"
    temporal: str = "DYNAMIC"
    when: str = ""

    def fact(self) -> dict[str, str]:
        return {
            "subject": self.subject,
            "fact": self.text,
            "relation": self.relation,
            "object": self.obj,
            "when": self.when,
            "kind": self.kind,
            "temporal": self.temporal,
        }


@dataclass
class Script:
    """The scripted model: facts per message text, verdicts per (new, known) text pair."""

    said: dict[str, Said] = field(default_factory=dict)
    verdicts: dict[tuple[str, str], str] = field(default_factory=dict)
    #: every pair the judge was shown: (new text, new date, known text, known's parenthesis)
    shown: list[tuple[str, str, str, str]] = field(default_factory=list)

    def extract(self, request: LLMRequest) -> dict[str, Any]:
        content = next(m.content for m in reversed(request.messages) if m.role == "user" and "[1] " in m.content)
        messages = []
        for line in content.splitlines():
            match = _ITEM.match(line)
            if match:
                said = self.said.get(match.group(2))
                messages.append({"m": int(match.group(1)), "facts": [said.fact()] if said else []})
        return {"messages": messages}

    def resolve(self, request: LLMRequest) -> dict[str, Any]:
        pairs = []
        for n, new_date, new, known_note, known in _PAIR.findall(request.messages[-1].content):
            self.shown.append((new, new_date, known, known_note))
            pairs.append({"p": int(n), "verdict": self.verdicts.get((new, known), "compatible")})
        return {"pairs": pairs}


@dataclass
class Memory:
    store: Any
    llm: ScriptedLLM
    script: Script
    memorize: MemorizeService
    forget: ForgetService
    n: int = 0

    async def say(self, *said: Said, speaker: str = "Ann", at: datetime | None = None) -> None:
        """One batch of messages, one fact each."""
        events = []
        for s in said:
            self.script.said[s.text] = s
            self.n += 1
            events.append(
                ChatMessage(
                    event_id=f"{USER}-m{self.n}",
                    user_id=USER,
                    conversation_id="c1",
                    speaker=speaker,
                    text=s.text,
                    event_time=at or T0 + timedelta(days=self.n),
                    ingest_time=INGEST + timedelta(seconds=self.n),
                )
            )
        outcome = await self.memorize.memorize(events)
        assert not outcome.dead_letters

    def judge(self, new: Said, known: Said, verdict: str) -> None:
        self.script.verdicts[(new.text, known.text)] = verdict

    async def thesis(self, said: Said) -> Vertex:
        thesis_id = ids.thesis_id(USER, said.text)
        return (await self.store.get_vertices(USER, [thesis_id]))[thesis_id]

    async def relation(self, said: Said) -> Edge:
        edge_id = ids.edge_id(
            USER,
            EdgeKind.RELATION.value,
            ids.object_id(USER, said.subject),
            ids.normalize_text(said.relation),
            ids.object_id(USER, said.obj),
        )
        return (await self.store.get_triplets(USER, [edge_id]))[edge_id].edge


@pytest.fixture(scope="module")
def embedder() -> MiniLMEmbedder:
    return MiniLMEmbedder()


@pytest.fixture(params=["sqlite", pytest.param("remote", marks=pytest.mark.server)])
async def memory(request: pytest.FixtureRequest, tmp_path: Path, embedder: MiniLMEmbedder) -> AsyncIterator[Memory]:
    if request.param == "sqlite":
        store: Any = await SqliteMemoryStore.open(tmp_path / "labels.sqlite3", dim=embedder.dim)
    else:
        from services.adapters.remote import RemoteMemoryStore

        dgraph, http, grpc = remote_addresses()
        store = await RemoteMemoryStore.open(dgraph, http, grpc, embedder.dim, prefix="MemstreamLabels")
        await store.delete_user(USER)
        await store.forget(USER, None)
    script = Script()
    # entity resolution asks about look-alike names ("Porto" / "Porto in Portugal"): the rule judge keeps them two
    llm = ScriptedLLM(
        {
            "extract": script.extract,
            "resolve": script.resolve,
            "resolve_check": rule_resolve_check,
            "same_entity": rule_same_entity,
        }
    )
    settings = Settings(_env_file=None, data_dir=tmp_path)  # type: ignore[call-arg]
    yield Memory(
        store,
        llm,
        script,
        MemorizeService(store.stores(), llm, embedder, settings),
        ForgetService(store, store, store, embedder),
    )
    await store.close()


def marks(thesis: Vertex) -> set[tuple[Mark, str]]:
    return {(m.mark, m.id) for m in thesis_marks(thesis.props)}


LYON = Said("Ann lives in Lyon.", "Ann", "lives in", "Lyon")
PORTO = Said("Ann lives in Porto.", "Ann", "lives in", "Porto")
BORN_LYON = Said("Ann was born in Lyon.", "Ann", "born in", "Lyon", temporal="STATIC")
BORN_PORTO = Said("Ann was born in Porto.", "Ann", "born in", "Porto", temporal="STATIC")


async def test_a_dynamic_thesis_is_superseded_by_a_newer_contradiction(memory: Memory) -> None:
    await memory.say(LYON)
    memory.judge(PORTO, LYON, "updates")
    await memory.say(PORTO)
    lyon, porto = await memory.thesis(LYON), await memory.thesis(PORTO)
    assert lyon.invalidated_by == porto.id and porto.t_invalid is None
    assert (await memory.relation(LYON)).t_invalid is not None
    assert marks(lyon) == marks(porto) == set()


async def test_one_batch_that_holds_the_old_state_and_the_new_ends_the_old(memory: Memory) -> None:
    """An imported history can put both statements in one memorize batch: judged as if apart, on both backends."""
    memory.judge(PORTO, LYON, "updates")
    await memory.say(LYON, PORTO)
    lyon, porto = await memory.thesis(LYON), await memory.thesis(PORTO)
    assert lyon.invalidated_by == porto.id and lyon.t_invalid == porto.t_valid and porto.t_invalid is None
    assert (await memory.relation(LYON)).t_invalid == porto.t_valid
    assert (await memory.relation(PORTO)).t_invalid is None


async def test_a_static_contradiction_within_one_batch_is_marked_on_both(memory: Memory) -> None:
    memory.judge(BORN_PORTO, BORN_LYON, "updates")
    await memory.say(BORN_LYON, BORN_PORTO)
    lyon, porto = await memory.thesis(BORN_LYON), await memory.thesis(BORN_PORTO)
    assert lyon.t_invalid is None and porto.t_invalid is None
    assert marks(lyon) == {(Mark.CONFLICTS_WITH, porto.id)} and marks(porto) == {(Mark.CONFLICTS_WITH, lyon.id)}


async def test_a_contradicted_static_fact_is_kept_marked_until_corrected(memory: Memory) -> None:
    await memory.say(BORN_LYON)
    memory.judge(BORN_PORTO, BORN_LYON, "updates")
    await memory.say(BORN_PORTO)
    lyon, porto = await memory.thesis(BORN_LYON), await memory.thesis(BORN_PORTO)
    assert lyon.t_invalid is None and porto.t_invalid is None  # not silently invalidated
    assert marks(lyon) == {(Mark.CONFLICTS_WITH, porto.id)} and marks(porto) == {(Mark.CONFLICTS_WITH, lyon.id)}
    for side in (BORN_LYON, BORN_PORTO):  # both relation edges stay valid
        assert (await memory.relation(side)).t_invalid is None
    assert f"(conflicts with: [{lyon.t_valid.date()}] {BORN_LYON.text})" in porto.context  # type: ignore[union-attr]

    # a later thesis contradicting one side again corrects it: that side ends, the marks go from both
    correction = Said("Ann's birthplace is the city of Porto in Portugal.", "Ann", "born in", "Porto in Portugal")
    memory.judge(correction, BORN_LYON, "updates")
    await memory.say(correction)
    lyon, porto = await memory.thesis(BORN_LYON), await memory.thesis(BORN_PORTO)
    assert lyon.invalidated_by == ids.thesis_id(USER, correction.text)
    assert porto.t_invalid is None and marks(porto) == set() and marks(lyon) == set()


async def test_an_atemporal_thesis_never_expires(memory: Memory) -> None:
    meaning = Said("Ann's name means grace.", "Ann", "name means", "grace", temporal="ATEMPORAL")
    other = Said("Ann's name means favour.", "Ann", "name means", "favour", temporal="DYNAMIC")
    again = Said("Ann's name means mercy.", "Ann", "name means", "mercy", temporal="DYNAMIC")
    await memory.say(meaning)
    memory.judge(other, meaning, "updates")
    await memory.say(other)
    memory.judge(again, meaning, "updates")  # contradicted while in conflict: still not ended
    await memory.say(again)
    kept = await memory.thesis(meaning)
    assert kept.t_invalid is None and (await memory.relation(meaning)).t_invalid is None
    assert {mark for mark, _ in marks(kept)} == {Mark.CONFLICTS_WITH} and len(marks(kept)) == 2


BEN_ACME = Said("Ben works at Acme.", "Ben", "works at", "Acme")
BEN_NIMBUS = Said("Ben believes he works at Nimbus.", "Ben", "works at", "Nimbus", kind="OPINION")


async def test_an_opinion_never_invalidates_a_fact(memory: Memory) -> None:
    await memory.say(BEN_ACME, speaker="Ben")
    memory.judge(BEN_NIMBUS, BEN_ACME, "updates")
    await memory.say(BEN_NIMBUS, speaker="Ben")
    fact, opinion = await memory.thesis(BEN_ACME), await memory.thesis(BEN_NIMBUS)
    assert fact.t_invalid is None and opinion.t_invalid is None
    assert (await memory.relation(BEN_ACME)).t_invalid is None and (await memory.relation(BEN_NIMBUS)).t_invalid is None
    assert opinion.props["holder"] == "Ben" and opinion.episode_label is EpisodeLabel.OPINION
    assert opinion.context == f"[{opinion.t_valid.date()}] OPINION (Ben): {BEN_NIMBUS.text}"  # type: ignore[union-attr]


async def test_an_opinion_is_superseded_only_by_its_holders_later_opinion(memory: Memory) -> None:
    """Its candidates are found by meaning (no shared relation wording): the nearest theses relating Ben otherwise.
    Another holder's opinion is not even judged with it: candidates relate the same subject."""
    boring = Said("Ben thinks the film Dune is boring.", "Ben", "thinks boring", "Dune", kind="OPINION")
    anns = Said("Ann thinks the film Dune is great.", "Ann", "thinks great", "Dune", kind="OPINION")
    bens = Said("Ben now thinks the film Dune is great.", "Ben", "thinks great", "Dune", kind="OPINION")
    await memory.say(boring, speaker="Ben")
    memory.judge(anns, boring, "updates")
    await memory.say(anns)
    assert (await memory.thesis(boring)).t_invalid is None  # another holder's opinion
    memory.judge(bens, boring, "updates")
    await memory.say(bens, speaker="Ben")
    assert (await memory.thesis(boring)).invalidated_by == ids.thesis_id(USER, bens.text)
    assert (await memory.thesis(anns)).t_invalid is None
    assert (anns.text, boring.text) not in {(new, known) for new, _, known, _ in memory.script.shown}


PREDICTION = Said("Ben will get the job at Acme.", "Ben", "will get job at", "Acme", kind="PREDICTION")


@pytest.mark.parametrize(
    ("verdict", "mark", "back"),
    [("confirms", Mark.CONFIRMED_BY, Mark.CONFIRMS), ("refutes", Mark.REFUTED_BY, Mark.REFUTES)],
)
async def test_a_prediction_is_linked_to_what_confirms_or_refutes_it(
    memory: Memory, verdict: str, mark: Mark, back: Mark
) -> None:
    outcome = Said(
        "Ben got the job at Acme." if verdict == "confirms" else "Ben was not hired by Acme.",
        "Ben",
        "got job at",
        "Acme",
    )
    await memory.say(PREDICTION, speaker="Ben")
    memory.judge(outcome, PREDICTION, verdict)
    await memory.say(outcome, speaker="Ben")
    prediction, later = await memory.thesis(PREDICTION), await memory.thesis(outcome)
    assert prediction.t_invalid is None and later.t_invalid is None  # a refuted prediction is kept, as a record
    assert marks(prediction) == {(mark, later.id)} and marks(later) == {(back, prediction.id)}
    assert any(known == PREDICTION.text and "prediction" in note for _, _, known, note in memory.script.shown)
    word = "confirmed" if verdict == "confirms" else "refuted"
    expected = f"(prediction, {word} {later.t_valid.date()} by: {outcome.text})"  # type: ignore[union-attr]
    assert prediction.context.startswith(f"[{prediction.t_valid.date()}] PREDICTION (Ben): ")  # type: ignore[union-attr]
    assert prediction.context.endswith(expected)


async def test_an_outdated_prediction_is_superseded_and_a_plan_ends_no_fact(memory: Memory) -> None:
    rome = Said("Ann will fly to Rome.", "Ann", "will fly to", "Rome", kind="PREDICTION")
    paris = Said("Ann will fly to Paris instead.", "Ann", "will fly to", "Paris", kind="PREDICTION")
    move = Said("Ann will move to Porto.", "Ann", "lives in", "Porto", kind="PREDICTION")
    await memory.say(rome, LYON)
    memory.judge(paris, rome, "updates")
    memory.judge(move, LYON, "updates")
    await memory.say(paris, move)
    assert (await memory.thesis(rome)).invalidated_by == ids.thesis_id(USER, paris.text)
    assert (await memory.thesis(LYON)).t_invalid is None  # a plan does not end where she lives now


async def test_candidates_relate_the_same_subject_or_are_nearest_and_one_call_judges_a_batch(memory: Memory) -> None:
    eve = Said("Eve married Dana.", "Eve", "married", "Dana")
    siemens = Said("Carl works at Siemens.", "Carl", "works at", "Siemens")
    bicycle = Said("Carl bought a red bicycle.", "Carl", "bought", "bicycle")
    bergen = Said("Carl lives in Bergen.", "Carl", "lives in", "Bergen")
    await memory.say(eve, siemens, bicycle, bergen)
    first_calls = len(memory.llm.calls)
    carl = Said("Carl married Dana.", "Carl", "married", "Dana")  # the same relation to Dana, another subject
    bosch = Said("Carl is employed by Bosch.", "Carl", "employed by", "Bosch")  # near in meaning, other words
    said_in_2019 = Said("In 2019 Carl lived in Oslo.", "Carl", "lives in", "Oslo", when="in 2019")
    memory.judge(bosch, siemens, "updates")
    await memory.say(carl, bosch, said_in_2019)
    shown = {(new, known) for new, _, known, _ in memory.script.shown}
    assert (carl.text, eve.text) not in shown and (bosch.text, siemens.text) in shown
    # "updates" on a pair found by meaning alone is not acted on (the default model gave it wrongly throughout)
    assert (await memory.thesis(siemens)).t_invalid is None
    assert (bosch.text, bicycle.text) not in shown  # not near enough in meaning
    # the world time the words name, not the message time
    dates = {date for new, date, known, _ in memory.script.shown if new.startswith("In 2019") and known == bergen.text}
    assert dates == {"2019-01-01"}
    # one extraction and one resolve call for the batch of three: calls per message do not grow
    assert [c.task for c in list(memory.llm.calls)[first_calls:]] == ["extract", "resolve"]


async def test_without_judging_by_meaning_only_rivals_and_known_predictions_are_asked(memory: Memory) -> None:
    """``resolve_by_meaning`` off: a pair found only by meaning could at most merge a repeat ("updates" on it is
    not acted on), so it is not asked, and a batch with no other pair makes no call; a known prediction near in
    meaning is still asked (it can be confirmed or refuted), and so is a rival by relation."""
    memory.memorize.settings = memory.memorize.settings.model_copy(update={"resolve_by_meaning": False})
    siemens = Said("Carl works at Siemens.", "Carl", "works at", "Siemens")
    await memory.say(siemens, PREDICTION)
    calls = len(memory.llm.calls)
    bosch = Said("Carl is employed by Bosch.", "Carl", "employed by", "Bosch")  # near in meaning, other words
    await memory.say(bosch)
    assert [c.task for c in list(memory.llm.calls)[calls:]] == ["extract"]
    assert (bosch.text, siemens.text) not in {(new, known) for new, _, known, _ in memory.script.shown}
    # near in meaning to a known prediction, with another object and relation: found by meaning only
    hired = Said("Ben got the job at Acme Corp.", "Ben", "got the job at", "Acme Corp")
    memory.judge(hired, PREDICTION, "confirms")
    lidl = Said("Carl works at Lidl.", "Carl", "works at", "Lidl")  # the same relation to another entity
    await memory.say(hired, lidl, speaker="Ben")
    shown = {(new, known) for new, _, known, _ in memory.script.shown}
    assert (hired.text, PREDICTION.text) in shown and (lidl.text, siemens.text) in shown
    assert marks(await memory.thesis(PREDICTION)) == {(Mark.CONFIRMED_BY, ids.thesis_id(USER, hired.text))}


async def test_forgetting_one_side_leaves_no_dangling_mark(memory: Memory) -> None:
    await memory.say(BORN_LYON)
    memory.judge(BORN_PORTO, BORN_LYON, "updates")
    await memory.say(BORN_PORTO)
    await memory.say(PREDICTION, speaker="Ben")
    confirm = Said("Ben got the job at Acme.", "Ben", "got job at", "Acme")
    memory.judge(confirm, PREDICTION, "confirms")
    await memory.say(confirm, speaker="Ben")
    await memory.forget.forget(tombstone(ForgetScope.MESSAGE, f"{USER}-m2", user=USER), "chat")
    await memory.forget.forget(tombstone(ForgetScope.MESSAGE, f"{USER}-m4", user=USER, n=2), "chat")
    assert marks(await memory.thesis(BORN_LYON)) == set() and marks(await memory.thesis(PREDICTION)) == set()


async def test_the_reader_sees_labels_holders_and_conflicts(memory: Memory) -> None:
    await memory.say(BORN_LYON)
    memory.judge(BORN_PORTO, BORN_LYON, "updates")
    await memory.say(BORN_PORTO)
    await memory.say(BEN_NIMBUS, speaker="Ben")
    memory.llm.responders["answer"] = lambda request: {"answer": "Ann was born in Lyon or Porto.", "found": True}
    qa = SimpleQA(memory.store, memory.store, memory.memorize.embedder, memory.llm)
    query = Query(event_id="q1", user_id=USER, question="Where was Ann born?", event_time=INGEST)
    await qa.answer(query)
    [request] = memory.llm.calls_for("answer")
    prompt = "\n".join(m.content for m in request.messages)
    assert "(conflicts with: " in prompt and "OPINION (Ben): Ben believes" in prompt
    assert "conflicts with" in request.messages[0].content  # the answer task says what to do with them


# -- builder level: the rules one by one -------------------------------------------------------------------------


def side(kind: str = "FACT", temporal: str = "DYNAMIC", holder: str = "", day: int = 1, conflict: bool = False) -> Side:
    return Side(EpisodeLabel(kind), TemporalLabel(temporal), holder, T0 + timedelta(days=day), conflict)


@pytest.mark.parametrize(
    ("verdict", "new", "old", "outcome"),
    [
        ("updates", side(day=2), side(), Outcome.SUPERSEDE),
        ("updates", side(day=2), side(temporal="STATIC"), Outcome.CONFLICT),
        ("updates", side(day=2), side(temporal="STATIC", conflict=True), Outcome.SUPERSEDE),  # a correction
        ("updates", side(day=2), side(temporal="ATEMPORAL", conflict=True), Outcome.CONFLICT),
        ("updates", side(temporal="STATIC"), side(day=2), Outcome.CONFLICT),  # late: the new one would end
        ("updates", side("OPINION", holder="Ben", day=2), side(), Outcome.KEEP),
        ("updates", side(day=2), side("OPINION", holder="Ben"), Outcome.KEEP),
        ("updates", side("OPINION", holder="Ann", day=2), side("OPINION", holder="Ben"), Outcome.KEEP),
        ("updates", side("OPINION", holder="ben", day=2), side("OPINION", holder="Ben"), Outcome.SUPERSEDE),
        ("updates", side("PREDICTION", day=2), side(), Outcome.KEEP),
        ("updates", side("PREDICTION", day=2), side("PREDICTION"), Outcome.SUPERSEDE),
        ("updates", side(day=2), side("PREDICTION"), Outcome.SUPERSEDE),  # outdated plan
        ("confirms", side(day=2), side("PREDICTION"), Outcome.CONFIRM),
        ("refutes", side(day=2), side("PREDICTION"), Outcome.REFUTE),
        ("refutes", side(day=2), side(), Outcome.KEEP),  # only a prediction is refuted
        ("compatible", side(day=2), side(), Outcome.KEEP),
    ],
)
def test_the_label_policy(verdict: str, new: Side, old: Side, outcome: Outcome) -> None:
    assert decide(verdict, new, old) is outcome


def _known(text: str, temporal: str, props: dict[str, str] | None = None) -> Vertex:
    base = {"subject": "Ann", "relation": "born in", "object": text.split()[-1].rstrip(".")}
    return Vertex(
        id=ids.thesis_id(USER, text),
        user_id=USER,
        kind=VertexKind.THESIS,
        name=text,
        props={**base, **(props or {})},
        t_valid=T0,
        episode_label=EpisodeLabel.FACT,
        temporal_label=TemporalLabel(temporal),
    )


def test_a_correction_ends_the_wrong_side_and_takes_the_mark_off_the_other() -> None:
    """The builder rewrites the known partner's props without the mark (``ChangeSet.props_updates``)."""
    from services.domain import ThesisMark

    lyon_id, porto_id = ids.thesis_id(USER, "Ann was born in Lyon."), ids.thesis_id(USER, "Ann was born in Porto.")
    lyon = _known("Ann was born in Lyon.", "STATIC")
    lyon = lyon.model_copy(
        update={"props": with_marks(lyon.props, [ThesisMark(mark=Mark.CONFLICTS_WITH, id=porto_id, text="x")])}
    )
    porto = _known("Ann was born in Porto.", "STATIC")
    porto = porto.model_copy(
        update={"props": with_marks(porto.props, [ThesisMark(mark=Mark.CONFLICTS_WITH, id=lyon_id, text="y")])}
    )
    source = Source("m3", 0, "Ann: I was born in Porto, Portugal.", T0 + timedelta(days=3), INGEST, {})
    builder = ChangeSetBuilder(USER, "c", ["m3"])
    fact = Fact("Ann", "Ann was born in Porto, Portugal.", "born in", "Porto, Portugal", "FACT", "STATIC")
    [new_id] = builder.add(source, ItemFacts(facts=[fact]))
    builder.invalidate(KnownRef.of(lyon, [], "updates", {porto_id: porto.props}), new_id, source)
    cs = builder.build(0)
    assert [i.thesis_id for i in cs.invalidations] == [lyon_id]
    updates = {u.thesis_id: u.props for u in cs.props_updates}
    assert set(updates) == {lyon_id, porto_id} and all("marks" not in p for p in updates.values())
    assert updates[porto_id] == {k: v for k, v in porto.props.items() if k != "marks"}


def test_a_conflict_marks_both_and_ends_no_edge() -> None:
    lyon = _known("Ann was born in Lyon.", "STATIC")
    source = Source("m2", 0, "Ann: I was born in Porto.", T0 + timedelta(days=2), INGEST, {})
    builder = ChangeSetBuilder(USER, "c", ["m2"])
    fact = Fact("Ann", "Ann was born in Porto.", "born in", "Porto", "FACT", "STATIC")
    [new_id] = builder.add(source, ItemFacts(facts=[fact]))
    builder.invalidate(KnownRef.of(lyon), new_id, source)
    cs = builder.build(0)
    assert cs.invalidations == [] and cs.edge_invalidations == []
    [update] = cs.props_updates
    assert marks(Vertex(**{**lyon.model_dump(), "props": update.props})) == {(Mark.CONFLICTS_WITH, new_id)}
    [new] = [v for v in cs.vertices if v.id == new_id]
    assert marks(new) == {(Mark.CONFLICTS_WITH, lyon.id)}
    edge = Edge(id="e", user_id=USER, kind=EdgeKind.THESIS, source="o", target=new.id, relation="thesis")
    assert Triplet(start=new, edge=edge, end=new).context.endswith(
        "(conflicts with: [2024-03-01] Ann was born in Lyon.)"
    )


async def test_a_rival_relates_the_same_subject_by_the_same_relation_to_another_entity(memory: Memory) -> None:
    """With no candidates by meaning, the known theses relating the same subject by the same relation to another
    entity; another subject's are not judged, even with an entity in common (the default model called such pairs
    "updates" throughout LoCoMo)."""
    memory.memorize.settings = memory.memorize.settings.model_copy(update={"contradiction_min_similarity": 1.0})
    eve = Said("Eve married Dana.", "Eve", "married", "Dana")
    oslo = Said("Carl lives in Oslo.", "Carl", "lives in", "Oslo")
    other = Said("Frank married Gina.", "Frank", "married", "Gina")  # the same relation, no entity in common
    await memory.say(eve, oslo, other)
    carl = Said("Carl married Dana.", "Carl", "married", "Dana")  # Dana in common, another subject
    bergen = Said("Carl lives in Bergen.", "Carl", "lives in", "Bergen")  # Carl in common, as the subject
    await memory.say(carl, bergen)
    shown = {(new, known) for new, _, known, _ in memory.script.shown}
    assert shown == {(bergen.text, oslo.text)}


async def test_the_planning_readers_memory_lines_carry_the_marks(memory: Memory) -> None:
    """PlanningQA's clue-answer stage (stage 8) reads ``Triplet.context``: the conflict is in its memory lines."""
    from tests.test_qa_pipeline import Reader, last, make_qa, query

    lyon = Said("Ann lives in Lyon.", "Ann", "lives in", "Lyon", temporal="STATIC")
    porto = Said("Ann lives in Porto.", "Ann", "lives in", "Porto", temporal="STATIC")
    await memory.say(lyon)
    memory.judge(porto, lyon, "updates")
    await memory.say(porto)
    llm = ScriptedLLM(Reader(["Ann"]).responders())
    await make_qa(memory.store, memory.memorize.embedder, llm).answer(query("Where does Ann live?", user=USER))
    prompts = [last(r) for r in llm.calls_for("clue_answer")]
    assert any(f"{porto.text} (conflicts with: " in p for p in prompts)
    assert "conflicts with another" in llm.calls_for("clue_answer")[0].messages[0].content
