"""The extraction scorer on a small part of the labelled set: gold written back as memory scores perfectly, and
each kind of mistake costs exactly the metric it should."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from benchmarks.extraction.gold import GOLD_DIR, LOCOMO, load, subset
from benchmarks.extraction.score import score
from services import ids
from services.adapters.minilm import MiniLMEmbedder
from services.domain import ChangeSet, Vertex, VertexKind

DATA = Path(__file__).resolve().parents[1] / LOCOMO
pytestmark = pytest.mark.skipif(not DATA.exists(), reason=f"LoCoMo data not found at {DATA}")
NOW = datetime(2026, 1, 1, tzinfo=UTC)


@pytest.fixture(scope="module")
def embedder() -> MiniLMEmbedder:
    return MiniLMEmbedder()


@pytest.fixture(scope="module")
def turns():  # type: ignore[no-untyped-def]
    return subset(load(DATA, GOLD_DIR, samples=["conv-26"]), 12)


def as_memory(turns, rewrite=lambda t, f: (f.subject, f.text, f.start, f.end)) -> list[ChangeSet]:  # type: ignore[no-untyped-def]
    vertices = []
    for turn in turns:
        for fact in turn.facts:
            subject, text, start, end = rewrite(turn, fact)
            props = {"event_id": turn.event_id, "subject": subject}
            if start is not None:
                props |= {"when_start": start.isoformat(), "when_end": end.isoformat()}
            vertices.append(
                Vertex(id=ids.thesis_id("u", text), user_id="u", kind=VertexKind.THESIS, name=text, props=props)
            )
            vertices.append(
                Vertex(
                    id=ids.object_id("u", subject),
                    user_id="u",
                    kind=VertexKind.OBJECT,
                    name=subject,
                    props={"event_id": turn.event_id},
                )
            )
    return [ChangeSet(id="c", user_id="u", event_ids=[t.event_id for t in turns], vertices=vertices)]


def test_the_labelled_set_is_large_and_complete() -> None:
    everything = load(DATA, GOLD_DIR)
    assert len(everything) >= 200
    assert len({t.sample_id for t in everything}) >= 4 and len({(t.sample_id, t.session) for t in everything}) >= 12
    assert {t.speaker for t in everything if t.facts} >= {"Caroline", "Melanie", "Jon", "Gina"}
    assert any("[shares a photo:" in t.text for t in everything if t.facts)
    assert sum(1 for t in everything for f in t.facts if f.start is not None) >= 20


async def test_gold_as_memory_scores_perfectly(turns, embedder) -> None:  # type: ignore[no-untyped-def]
    result = await score(turns, as_memory(turns), embedder)
    summary = result.summary()
    assert summary["gold_facts"] > 5
    assert summary["fact_recall"] == summary["precision"] == summary["attribution"] == 1.0
    assert summary["date_accuracy"] == summary["date_accuracy_of_matched"] == 1.0
    assert summary["junk_entity_rate"] == 0.0


async def test_mistakes_cost_their_own_metric(turns, embedder) -> None:  # type: ignore[no-untyped-def]
    other = {"Caroline": "Melanie", "Melanie": "Caroline"}

    def wrong_speaker_no_dates(turn, fact):  # type: ignore[no-untyped-def]
        return other.get(fact.subject, fact.subject), fact.text, None, None

    result = await score(turns, as_memory(turns, wrong_speaker_no_dates), embedder)
    summary = result.summary()
    assert summary["fact_recall"] == 1.0 and summary["attribution"] == 0.0 and summary["date_accuracy"] == 0.0
    assert summary["date_accuracy_of_matched"] == 0.0 and summary["dated_matched"] == summary["dated_gold_facts"]

    junk = as_memory(turns)
    junk[0].vertices.append(
        Vertex(
            id="o_x",
            user_id="u",
            kind=VertexKind.OBJECT,
            name="zeppelin",
            props={"event_id": turns[0].event_id},
        )
    )
    junk[0].vertices.append(
        Vertex(
            id="t_x",
            user_id="u",
            kind=VertexKind.THESIS,
            name="Caroline owns a zeppelin fleet.",
            props={"event_id": turns[0].event_id, "subject": "Caroline"},
        )
    )
    summary = (await score(turns, junk, embedder)).summary()
    assert summary["precision"] < 1.0 and summary["junk_entity_rate"] > 0.0 and summary["fact_recall"] == 1.0
