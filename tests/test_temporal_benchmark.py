"""The temporal benchmark's scorer: which day, week, weekend, month or year a LoCoMo answer names, and when a
thesis's date counts as that date (evaluation/temporal.py; the harness and benchmarks/temporal_locomo.py)."""

from __future__ import annotations

from datetime import UTC, date, datetime
from pathlib import Path

import pytest

from evaluation.temporal import Span, gold_span, hits, text_spans, valid_spans
from services.domain import Vertex, VertexKind


@pytest.mark.parametrize(
    ("answer", "first", "last"),
    [
        ("7 May 2023", date(2023, 5, 7), date(2023, 5, 7)),
        ("19 January, 2023", date(2023, 1, 19), date(2023, 1, 19)),
        ("June 2023", date(2023, 6, 1), date(2023, 6, 30)),
        ("January, 2023", date(2023, 1, 1), date(2023, 1, 31)),
        ("2022", date(2022, 1, 1), date(2022, 12, 31)),
        ("Since 2016", date(2016, 1, 1), date(2016, 12, 31)),
        ("The sunday before 25 May 2023", date(2023, 5, 21), date(2023, 5, 21)),  # 25 May 2023 was a Thursday
        ("The Friday before 15 July 2023", date(2023, 7, 14), date(2023, 7, 14)),  # a Saturday
        ("The week before 9 June 2023", date(2023, 5, 29), date(2023, 6, 8)),
        ("The weekend before 17 July 2023", date(2023, 7, 15), date(2023, 7, 16)),
        ("two weekends before 17 July 2023", date(2023, 7, 8), date(2023, 7, 9)),
        ("The week of 23 August 2023", date(2023, 8, 21), date(2023, 8, 27)),
    ],
)
def test_an_answer_names_a_span_of_days(answer: str, first: date, last: date) -> None:
    assert gold_span(answer) == Span(first, last)


@pytest.mark.parametrize("answer", ["4 years", "10 years ago", "A few years ago", "13 August"])
def test_a_duration_or_a_date_without_a_year_names_none(answer: str) -> None:
    assert gold_span(answer) is None


def thesis(name: str, t_valid: datetime, **props: str) -> Vertex:
    return Vertex(id="t", user_id="u", kind=VertexKind.THESIS, name=name, t_valid=t_valid, props=props)


def test_a_thesis_has_the_date_in_its_validity_or_its_words() -> None:
    gold = gold_span("7 May 2023")
    assert gold is not None
    said = datetime(2023, 5, 8, 13, 56, tzinfo=UTC)
    yesterday = thesis("Caroline went to a support group (on 7 May 2023).", said)
    assert not hits(valid_spans(yesterday), gold) and hits(text_spans(yesterday), gold)
    resolved = thesis("Caroline went to a support group.", datetime(2023, 5, 7, tzinfo=UTC))
    assert hits(valid_spans(resolved), gold)
    # a period counts when it lies within the answer's, or (a week at most) contains it
    week = thesis("x", said, when_start="2023-05-01", when_end="2023-05-07")
    month = thesis("x", said, when_start="2023-05-01", when_end="2023-05-31")
    assert hits(text_spans(week), gold) and not hits(text_spans(month), gold)
    assert hits(text_spans(month), Span(date(2023, 1, 1), date(2023, 12, 31)))


def test_dated_tells_the_evidence_thesis_with_the_date_from_any_other() -> None:
    from evaluation.temporal import dated

    gold = Span(date(2023, 5, 1), date(2023, 5, 7))  # "the week before 8 May 2023"
    said = datetime(2023, 5, 8, tzinfo=UTC)
    evidence = Vertex(
        id="t1",
        user_id="u",
        kind=VertexKind.THESIS,
        name="Ann went to Paris last week (2023-05-01 to 2023-05-07).",
        t_valid=said,
        props={"when_start": "2023-05-01", "when_end": "2023-05-07"},
    )
    other = Vertex(id="t2", user_id="u", kind=VertexKind.THESIS, name="Ann swam.", t_valid=datetime(2023, 5, 3))
    assert dated([evidence], gold, {"t1"}) == {
        "date_t_valid": False,
        "date_text": True,
        "date_evidence": True,
        "date_evidence_t_valid": False,
    }
    # another thesis of that week by its t_valid: in the context, not the answer's own
    assert dated([other], gold, {"t1"}) == {
        "date_t_valid": True,
        "date_text": False,
        "date_evidence": False,
        "date_evidence_t_valid": False,
    }


async def test_said_on_dates_a_thesis_by_the_earliest_message_it_came_from(tmp_path: Path) -> None:
    """The message rule's reading of a memory built under the text rule (benchmarks/temporal_locomo.py)."""
    from benchmarks.temporal_locomo import _said_on
    from evaluation.metrics import derived_ids
    from schemas.events import ChatMessage
    from services import ids
    from services.adapters.sqlite import SqliteMemoryStore
    from services.domain import ChangeSet, Edge, EdgeKind

    user = "u1"
    said = [datetime(2023, 5, 8, 13, 0, tzinfo=UTC), datetime(2023, 6, 2, 9, 0, tzinfo=UTC)]
    messages = [
        ChatMessage(event_id=f"m{n}", user_id=user, event_time=when, speaker="Caroline", text=f"message {n}")
        for n, when in enumerate(said)
    ]
    episodes = [
        Vertex(id=ids.episode_id(user, m.event_id), user_id=user, kind=VertexKind.EPISODIC, name=m.text)
        for m in messages
    ]
    # stated in both messages: the earlier one dates it
    both = Vertex(id="t1", user_id=user, kind=VertexKind.THESIS, name="Caroline went to a group.", t_valid=said[1])
    late = Vertex(id="t2", user_id=user, kind=VertexKind.THESIS, name="Caroline moved.", t_valid=said[1])
    links = [(both, episodes[1]), (both, episodes[0]), (late, episodes[1])]
    edges = [
        Edge(id=f"r{n}", user_id=user, kind=EdgeKind.EPISODIC, source=t.id, target=e.id, relation="said in")
        for n, (t, e) in enumerate(links)
    ]
    async with SqliteMemoryStore(tmp_path / "m.sqlite3", 4) as store:
        await store.apply(
            ChangeSet(id="c1", user_id=user, event_ids=["m0", "m1"], vertices=[*episodes, both, late], edges=edges),
            [],
        )
        derived = await derived_ids(store, user, dict.fromkeys((m.event_id for m in messages), ""), chunk_chars=1)
    day = _said_on(derived, messages)
    assert day[both.id] == date(2023, 5, 8) and day[late.id] == date(2023, 6, 2)
