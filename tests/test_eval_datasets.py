"""The evaluation loaders: each on a tiny file of its format written here, and on the shared data's first records."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from evaluation import datasets
from schemas.events import ChatMessage, Document

SHARED = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/data is absent")

TINY_LOCOMO: list[dict[str, Any]] = [
    {
        "sample_id": "conv-t",
        "conversation": {
            "speaker_a": "Alice",
            "speaker_b": "Bob",
            "session_1_date_time": "1:56 pm on 8 May, 2023",
            "session_1": [
                {"speaker": "Alice", "dia_id": "D1:1", "text": "I adopted a dog named Rex at the Portland shelter."},
                {"speaker": "Bob", "dia_id": "D1:2", "text": "I started learning the violin with Maria."},
            ],
            "session_2_date_time": "10:00 am on 20 June, 2023",
            "session_2": [
                {"speaker": "Alice", "dia_id": "D2:1", "text": "Rex loves swimming in Lake Tahoe."},
                {"speaker": "Bob", "dia_id": "D2:2", "text": "I moved to Seattle for a new job at Boeing."},
            ],
        },
        "qa": [
            {"question": "Where does Rex love swimming?", "answer": "Lake Tahoe", "evidence": ["D2:1"], "category": 4},
            {"question": "Where did Bob move to?", "answer": "Seattle", "evidence": ["D2:2"], "category": 4},
            {"question": "When did Alice adopt Rex?", "answer": "8 May 2023", "evidence": ["D1:1"], "category": 2},
            {
                "question": "What did Bob say about Maria?",
                "evidence": ["D1:2"],
                "category": 5,
                "adversarial_answer": "x",
            },
        ],
    }
]


def write(tmp_path: Path, name: str, data: Any) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def test_locomo_turns_are_chat_events_at_their_session_date(tmp_path: Path) -> None:
    ds = datasets.load("locomo", tmp_path, write(tmp_path, "tiny.json", TINY_LOCOMO))
    assert all(isinstance(e, ChatMessage) for e in ds.events)
    assert [e.event_id for e in ds.events] == [f"locomo:conv-t:D{s}:{t}" for s in (1, 2) for t in (1, 2)]
    assert {e.user_id for e in ds.events} == {"eval-locomo-conv-t"}
    assert ds.events[0].event_time == datetime(2023, 5, 8, 13, 56, tzinfo=UTC)
    assert ds.events[2].event_time == datetime(2023, 6, 20, 10, 0, tzinfo=UTC)
    # category 5 (adversarial) is left out unless asked for; evidence turns name the events
    assert [q.category for q in ds.questions] == ["single-hop", "single-hop", "temporal"]
    assert ds.questions[0].evidence == ["locomo:conv-t:D2:1"]
    assert ds.questions[0].answers == ["Lake Tahoe"]
    with_adversarial = datasets.load("locomo", tmp_path, tmp_path / "tiny.json", adversarial=True)
    assert with_adversarial.questions[-1].category == "adversarial"
    assert with_adversarial.questions[-1].answers == ["No answer"]


def test_locomo_sessions_keep_the_first_sessions_and_the_questions_they_answer(tmp_path: Path) -> None:
    ds = datasets.load("locomo", tmp_path, write(tmp_path, "tiny.json", TINY_LOCOMO), sessions=1)
    assert [e.event_id for e in ds.events] == ["locomo:conv-t:D1:1", "locomo:conv-t:D1:2"]
    # the questions whose evidence lies in session 2 cannot be answered from session 1
    assert [q.text for q in ds.questions] == ["When did Alice adopt Rex?"]
    assert datasets.locomo_session("D12:3") == 12
    assert datasets.locomo_session("D") == 0  # malformed evidence ids exclude nothing


def test_mine_essays_are_documents_of_their_own_users_and_facts_the_questions(tmp_path: Path) -> None:
    data = {
        "essays": [
            {"topic": "Bees", "content": "```Bees\n\nBees make honey.```"},
            {"topic": "Owls", "content": "Owls hunt."},
        ],
        "answers": [[{"answer": "Bees make honey."}, {"answer": "Bees live in hives."}], [{"answer": "Owls hunt."}]],
    }
    ds = datasets.load("mine", tmp_path, write(tmp_path, "mine.json", data))
    assert ds.retention
    assert all(isinstance(e, Document) for e in ds.events)
    assert [e.text for e in ds.events] == ["Bees\n\nBees make honey.", "Owls hunt."]  # the code fences go
    assert len({e.user_id for e in ds.events}) == 2
    assert [(q.user_id, q.text) for q in ds.questions] == [
        ("eval-mine-0", "Bees make honey."),
        ("eval-mine-0", "Bees live in hives."),
        ("eval-mine-1", "Owls hunt."),
    ]
    assert ds.questions[0].evidence == [ds.events[0].event_id]
    one = datasets.load("mine", tmp_path, tmp_path / "mine.json", questions=1, seed=3)
    assert len(one.events) == 1 and {q.user_id for q in one.questions} == {one.events[0].user_id}


def test_hotpotqa_takes_the_chosen_questions_paragraphs_once_each(tmp_path: Path) -> None:
    shared = ["Paris", ["Paris is the capital of France.", " It is on the Seine."]]
    data = [
        {"_id": "a", "question": "What river is Paris on?", "answer": "the Seine", "type": "bridge",
         "supporting_facts": [["Paris", 1]], "context": [shared, ["Lyon", ["Lyon is in France."]]]},
        {"_id": "b", "question": "Is Rome in Italy?", "answer": "yes", "type": "comparison",
         "supporting_facts": [["Rome", 0]], "context": [shared, ["Rome", ["Rome is in Italy."]]]},
    ]  # fmt: skip
    ds = datasets.load("hotpotqa", tmp_path, write(tmp_path, "hotpot.json", data))
    titles = {e.title: e for e in ds.events if isinstance(e, Document)}
    assert sorted(titles) == ["Lyon", "Paris", "Rome"]
    assert titles["Paris"].text == "Paris is the capital of France. It is on the Seine."
    assert ds.questions[0].evidence == [titles["Paris"].event_id]
    assert ds.questions[1].evidence == [titles["Rome"].event_id]
    assert [q.category for q in ds.questions] == ["bridge", "comparison"]
    first = datasets.load("hotpotqa", tmp_path, tmp_path / "hotpot.json", questions=1, seed=0)
    chosen = first.questions[0].id
    expected = {"a": {"Paris", "Lyon"}, "b": {"Paris", "Rome"}}[chosen]
    assert {e.title for e in first.events if isinstance(e, Document)} == expected


def test_musique_supporting_paragraphs_are_the_evidence_and_aliases_count(tmp_path: Path) -> None:
    def paragraph(idx: int, title: str, text: str, supporting: bool) -> dict[str, Any]:
        return {"idx": idx, "title": title, "paragraph_text": text, "is_supporting": supporting}

    paragraphs = [
        paragraph(0, "X", "X is made by Acme. ", True),
        paragraph(1, "Acme", "Acme was founded by Ann Lee.", True),
        paragraph(2, "Other", "Unrelated.", False),
    ]
    question = "Who founded the maker of X?"
    data = [{"id": "2hop__1_2", "question": question, "answer": "Ann Lee", "answer_aliases": ["A. Lee"],
             "paragraphs": paragraphs}]  # fmt: skip
    ds = datasets.load("musique", tmp_path, write(tmp_path, "musique.json", data))
    by_title = {e.title: e.event_id for e in ds.events if isinstance(e, Document)}
    q = ds.questions[0]
    assert q.evidence == [by_title["X"], by_title["Acme"]]
    assert q.answers == ["Ann Lee", "A. Lee"]
    assert q.category == "2hop"


def test_2wiki_paragraphs_are_the_passages_its_triples_name(tmp_path: Path) -> None:
    questions = [
        {"id": "w1", "question_type": "compositional", "question": "When did Lothair II's mother die?",
         "answer": "20 March 851", "evidence": [["Lothair II", "mother", "Ermengarde of Tours"],
                                                 ["Ermengarde of Tours", "date of death", "20 March 851"]]},
    ]  # fmt: skip
    corpus = [
        {"title": "Ermengarde of Tours", "text": "Ermengarde of Tours died on 20 March 851."},
        {"title": "Lothair II", "text": "Lothair II was a king; his mother was Ermengarde of Tours."},
        {"title": "Teutberga", "text": "Teutberga was a queen."},
    ]
    ds = datasets.load(
        "2wiki", tmp_path, write(tmp_path, "q.json", questions), corpus=write(tmp_path, "c.json", corpus)
    )
    assert sorted(e.title or "" for e in ds.events if isinstance(e, Document)) == ["Ermengarde of Tours", "Lothair II"]
    q = ds.questions[0]
    assert len(q.evidence) == 2 and q.triples[1] == ("Ermengarde of Tours", "date of death", "20 March 851")


def test_2wiki_finds_a_passage_whose_title_carries_a_disambiguator(tmp_path: Path) -> None:
    questions = [
        {"id": "w2", "question_type": "compositional", "question": "Where did Goodbye, Franziska's director die?",
         "answer": "Castellina in Chianti",
         "evidence": [["Goodbye, Franziska", "director", "Helmut Käutner"],
                      ["Helmut Käutner", "place of death", "Castellina in Chianti"]]},
    ]  # fmt: skip
    corpus = [
        {"title": "Goodbye, Franziska (1941 film)", "text": "Goodbye, Franziska is a film by Helmut Käutner."},
        {"title": "Goodbye, Franziska (1957 film)", "text": "Goodbye, Franziska is a film by Wolfgang Liebeneiner."},
        {"title": "Helmut Käutner", "text": "Helmut Käutner died in Castellina in Chianti."},
        {"title": "Helmut Käutner (crater)", "text": "Not the director."},
    ]
    ds = datasets.load(
        "2wiki", tmp_path, write(tmp_path, "q.json", questions), corpus=write(tmp_path, "c.json", corpus)
    )
    titles = sorted(e.title or "" for e in ds.events if isinstance(e, Document))
    # the exact title wins where there is one; without one, every passage of that name is a reader's candidate
    assert titles == ["Goodbye, Franziska (1941 film)", "Goodbye, Franziska (1957 film)", "Helmut Käutner"]
    assert len(ds.questions[0].evidence) == 3


def test_an_unknown_dataset_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown dataset"):
        datasets.load("squad", tmp_path)


@needs_shared
@pytest.mark.parametrize("name", datasets.NAMES)
def test_each_loader_reads_the_shared_files_first_records(name: str) -> None:
    samples = {"conv-26"} if name == "locomo" else None
    ds = datasets.load(name, SHARED, questions=3, samples=samples)
    assert ds.events and ds.questions
    assert len({e.event_id for e in ds.events}) == len(ds.events)
    if name != "locomo":
        assert len({q.id for q in ds.questions}) == 3 or ds.retention
    known = {e.event_id for e in ds.events}
    evidence = [e for q in ds.questions for e in q.evidence]
    assert evidence, "gold evidence found"
    assert sum(e in known for e in evidence) >= 0.9 * len(evidence)  # evidence names the memorized events
