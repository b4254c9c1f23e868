"""A question's first link found from its words (``qa.hops``), and the fast engine asking it on its own
(``QAConfig.first_link``): the link of the named thing's lines, then the rest of the question of the thing it
named, read from that thing's own lines (real SQLite store, scripted model)."""

from __future__ import annotations

import re

import pytest

from services.adapters.minilm import MiniLMEmbedder
from services.adapters.sqlite import SqliteMemoryStore
from services.qa.hops import split
from tests.test_qa_chain import ask, memory_rows, says
from tests.test_qa_fast import StreamingLLM, embedder, films, make_fast  # noqa: F401 (the fixtures)
from tests.test_qa_pipeline import query


def spans(question: str, *names: str) -> list[tuple[int, int]]:
    return [(m.start(), m.end()) for n in names for m in re.finditer(re.escape(n), question)]


@pytest.mark.parametrize(
    ("question", "names", "ask_", "rest"),
    [
        (
            "Where was the father of Emilio Azcárraga Milmo born?",
            ["Emilio Azcárraga Milmo"],
            "Who or what is the father of Emilio Azcárraga Milmo?",
            "Where was B born?",
        ),
        (
            "When was the company that published The Miscellany News founded?",
            ["The Miscellany News"],
            "Who or what is the company that published The Miscellany News?",
            "When was B founded?",
        ),
        (
            "Who is the spouse of the director of film The Unholy Wife?",
            ["The Unholy Wife"],
            "Who or what is the director of film The Unholy Wife?",
            "Who is the spouse of B?",
        ),
        ("Where did Adolph's mother die?", ["Adolph"], "Who or what is Adolph's mother?", "Where did B die?"),
        ("Which country Tajlu Khanum's husband is from?", ["Tajlu Khanum"], None, "Which country B is from?"),
        ("What nationality is Beatrice's husband?", ["Beatrice"], None, "What nationality is B?"),
    ],
)
def test_a_link_before_the_rest(question: str, names: list[str], ask_: str | None, rest: str) -> None:
    hop = split(question, spans(question, *names))
    assert hop is not None
    if ask_ is not None:
        assert hop.ask == ask_
    assert hop.then("B") == rest


@pytest.mark.parametrize(
    ("question", "names"),
    [
        ("Who is Tlilpotoncatzin's uncle?", ["Tlilpotoncatzin"]),  # the link is the question
        ("Who is the paternal grandfather of Hamad Bin Isa?", ["Hamad Bin Isa"]),
        ("Who is younger, Ebtissam Mohamed or Beekman Du Barry?", ["Ebtissam Mohamed", "Beekman Du Barry"]),
        ("What is one of Joanna's favorite movies?", ["Joanna"]),  # a thing of hers, no named link
        ("What damages have happened to John's car?", ["John"]),
        ("When did Melanie's family go on a roadtrip?", ["Melanie"]),
        ("What genre is Joanna's first screenplay?", ["Joanna"]),
        ("Where was the father of the bride born?", []),  # no name
    ],
)
def test_no_link(question: str, names: list[str]) -> None:
    assert split(question, spans(question, *names)) is None


QUESTION = "What country is the director of Payment On Demand from?"


async def test_the_link_then_the_rest_of_its_answer(
    films: SqliteMemoryStore,  # noqa: F811
    embedder: MiniLMEmbedder,  # noqa: F811
) -> None:
    prompts, events, answer = await ask(
        films, embedder, [says("Curtis Bernhardt"), says("Germany")], chain_context=True, first_link=True
    )
    link, rest = prompts
    assert "Question: Who or what is the director of Payment On Demand?" in link.splitlines()
    assert "About Payment On Demand:" in memory_rows(link)
    # the rest, asked of the director, read from his own lines (searched for by his name) alone
    assert "Question: What country is Curtis Bernhardt from?" in rest.splitlines()
    assert "Found so far: the director of Payment On Demand: Curtis Bernhardt" in rest.splitlines()
    rows = memory_rows(rest)
    assert [r for r in rows if not r.startswith("- ")] == ["About Curtis Bernhardt (named above):"]
    assert "- Curtis Bernhardt country of citizenship Germany" in rows
    assert answer == "Germany"
    reads = events.of(8)
    assert [e.detail["read"] for e in reads] == ["the first link", "the rest, of the first link's answer"]
    assert [e.detail["asked"] for e in reads] == [
        "Who or what is the director of Payment On Demand?",
        "What country is Curtis Bernhardt from?",
    ]


async def test_a_link_naming_nothing_known_reads_the_chain_as_without_it(
    films: SqliteMemoryStore,  # noqa: F811
    embedder: MiniLMEmbedder,  # noqa: F811
) -> None:
    prompts, _, answer = await ask(
        films,
        embedder,
        [says("A director."), says("Curtis Bernhardt"), says("Germany")],
        chain_context=True,
        first_link=True,
    )
    assert f"Question: {QUESTION}" in prompts[1].splitlines()  # the whole question, of the named lines
    assert "Found so far: Curtis Bernhardt" in prompts[2].splitlines()
    assert answer == "Germany"


async def test_off_the_question_is_asked_whole(
    films: SqliteMemoryStore,  # noqa: F811
    embedder: MiniLMEmbedder,  # noqa: F811
) -> None:
    prompts, _, _ = await ask(films, embedder, [says("A director.")], chain_context=True, first_link=False)
    assert f"Question: {QUESTION}" in prompts[0].splitlines()


async def test_the_links_answer_is_not_streamed_as_the_answer(
    films: SqliteMemoryStore,  # noqa: F811
    embedder: MiniLMEmbedder,  # noqa: F811
) -> None:
    said = iter([says("Curtis Bernhardt"), says("Germany")])
    llm = StreamingLLM({"answer_check": lambda r: next(said)})
    shown: list[str] = []
    fast = make_fast(films, embedder, llm, retriever="flat", chain_context=True, first_link=True)
    answer = await fast.answer(query(QUESTION), on_text=shown.append)
    assert len(llm.calls) == 2 and answer.answer == "Germany"
    assert shown and all("Germany".startswith(text) for text in shown)  # never "Curtis Bernhardt": a part's answer


async def test_the_linked_things_lines_have_a_top_k_of_their_own(
    films: SqliteMemoryStore,  # noqa: F811
    embedder: MiniLMEmbedder,  # noqa: F811
) -> None:
    # a top-k of 3: the film's two lines and one more laid out first; the director's two lines are read, not one
    prompts, _, answer = await ask(
        films, embedder, [says("Curtis Bernhardt"), says("Germany")], chain_context=True, first_link=True,
        filter_top_k=3,
    )  # fmt: skip
    assert len([r for r in memory_rows(prompts[0]) if r.startswith("- ")]) == 2
    assert memory_rows(prompts[1]) == [
        "About Curtis Bernhardt (named above):",
        "- Curtis Bernhardt country of citizenship Germany",
        "- Curtis Bernhardt place of birth Worms",
    ]
    assert answer == "Germany"
