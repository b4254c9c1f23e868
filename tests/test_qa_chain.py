"""Reading along the question's chain in the fast engine's first answer (``QAConfig.chain_context``): the lines
about what the question names, then the lines about what those name, then the rest, laid out from the graph and
the lines' own names without a call (real SQLite store); the named thing's lines read first, the chain's after
them only when that answer is insufficient or names a bridge."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services import ids
from services.adapters.minilm import MiniLMEmbedder
from services.adapters.sqlite import SqliteMemoryStore
from services.domain import ChangeSet, Edge, EdgeKind, Triplet, Vertex, VertexKind
from services.llm.scripted import ScriptedLLM
from services.ports import VectorItem
from services.qa.chain import Chain, Names, line_objects
from tests.test_qa_fast import embedder, films, make_fast  # noqa: F401 (the fixtures)
from tests.test_qa_pipeline import T0, USER, Events, last, obj, query

QUESTION = "What country is the director of Payment On Demand from?"


def memory_rows(prompt: str) -> list[str]:
    """The memory part of an answer prompt, headings and lines as written."""
    rows = prompt.splitlines()
    return rows[rows.index("Memory:") + 1 : next(i for i, r in enumerate(rows) if r.startswith("Question: "))]


async def ask(
    store: SqliteMemoryStore, model: MiniLMEmbedder, answers: list[dict[str, Any]], **options: Any
) -> tuple[list[str], Events, str]:
    """The answer prompts of one question, its events and its answer; ``answers``: the model's, call by call."""
    said = iter(answers)
    llm = ScriptedLLM({"answer_check": lambda r: next(said)})
    events = Events()
    answer = await make_fast(store, model, llm, retriever="flat").answer(query(QUESTION, **options), events)
    assert answer.llm_calls == len(llm.calls) == len(answers)
    return [last(r) for r in llm.calls], events, answer.answer


def says(answer: str, sufficient: bool = True) -> dict[str, Any]:
    return {"answer": answer, "sufficient": sufficient, "missing": "" if sufficient else "the rest"}


async def test_an_answer_naming_a_bridge_reads_on_along_the_chain(
    films: SqliteMemoryStore,  # noqa: F811
    embedder: MiniLMEmbedder,  # noqa: F811
) -> None:
    # the 1.5B model's way: the film's line gives its director, called sufficient
    prompts, events, answer = await ask(
        films, embedder, [says("Curtis Bernhardt"), says("Germany")], chain_context=True
    )
    first, second = (memory_rows(p) for p in prompts)
    assert first == [
        "About Payment On Demand:",
        *(f"- {line}" for line in _groups(first)["About Payment On Demand:"]),
    ]
    assert set(_groups(first)["About Payment On Demand:"]) == {
        "Payment On Demand director Curtis Bernhardt",
        "Payment On Demand cast member Bette Davis",
    }
    # then the film's lines and its director's, without the rest, with what the first call found
    heads = [r for r in second if not r.startswith("- ")]
    assert heads == ["About Payment On Demand:", "About Curtis Bernhardt (named above):"]
    # his own lines, searched for by his name (no call): the filter had left his place of birth out of the first
    assert set(_groups(second)["About Curtis Bernhardt (named above):"]) == {
        "Curtis Bernhardt country of citizenship Germany",
        "Curtis Bernhardt place of birth Worms",
    }
    assert events.of(5)[-1].detail["clue_queries"] == ["Curtis Bernhardt"]
    assert "Found so far: Curtis Bernhardt" in prompts[1].splitlines()
    assert answer == "Germany"
    reads = events.of(8)
    assert [e.detail["read"] for e in reads] == ["the named", "along the chain"]
    assert reads[1].detail["chain"] == heads


async def test_a_sufficient_answer_naming_nothing_further_is_one_short_call(
    films: SqliteMemoryStore,  # noqa: F811
    embedder: MiniLMEmbedder,  # noqa: F811
) -> None:
    prompts, events, answer = await ask(films, embedder, [says("A director.")], chain_context=True)
    assert answer == "A director."  # names nothing the chain goes on to
    assert [r for r in memory_rows(prompts[0]) if not r.startswith("- ")] == ["About Payment On Demand:"]
    assert len(events.of(6)) == 1  # one search


async def test_an_insufficient_answer_reads_on(
    films: SqliteMemoryStore,  # noqa: F811
    embedder: MiniLMEmbedder,  # noqa: F811
) -> None:
    prompts, _, _ = await ask(films, embedder, [says("No answer", False), says("Germany")], chain_context=True)
    assert "Found so far" not in prompts[1]  # nothing found: the chain's lines alone
    assert "About Curtis Bernhardt (named above):" in memory_rows(prompts[1])


async def test_off_the_lines_are_in_retrieval_order_without_headings(
    films: SqliteMemoryStore,  # noqa: F811
    embedder: MiniLMEmbedder,  # noqa: F811
) -> None:
    prompts, events, _ = await ask(films, embedder, [says("Curtis Bernhardt")])
    rows = memory_rows(prompts[0])
    assert len(rows) == 5 and all(r.startswith("- ") for r in rows)
    assert "chain" not in events.of(8)[0].detail


async def test_top_k_bounds_the_laid_out_lines_chain_first(
    films: SqliteMemoryStore,  # noqa: F811
    embedder: MiniLMEmbedder,  # noqa: F811
) -> None:
    prompts, _, _ = await ask(
        films, embedder, [says("No answer", False), says("Germany")], chain_context=True, filter_top_k=3
    )
    rows = memory_rows(prompts[1])
    assert len([r for r in rows if r.startswith("- ")]) == 3  # the film's two lines and the director's one
    assert "Other lines:" not in rows


async def test_a_message_is_about_every_thing_it_links(
    tmp_path: Path,
    embedder: MiniLMEmbedder,  # noqa: F811
) -> None:
    """A line showing a message is about every object the message links to (one read), not only its ends."""
    song, singer, other = obj(USER, "Changed It"), obj(USER, "Nicki Minaj"), obj(USER, "Lil Wayne")
    message = Vertex(
        id=ids.episode_id(USER, "e1"), user_id=USER, kind=VertexKind.EPISODIC, t_valid=T0,
        name='"Changed It" is a song by Nicki Minaj and Lil Wayne.',
    )  # fmt: skip
    edges = [
        Edge(id=ids.edge_id(USER, "episodic", o.id, "episodic", message.id), user_id=USER, kind=EdgeKind.EPISODIC,
             source=o.id, target=message.id, relation="episodic")
        for o in (song, singer)
    ]  # fmt: skip
    vertices = [song, singer, other, message]
    async with SqliteMemoryStore(tmp_path / "m.sqlite3", embedder.dim) as store:
        vectors = await embedder.embed([v.name for v in vertices])
        items = [
            VectorItem(id=v.id, kind=v.kind.value, text=v.name, vector=x)
            for v, x in zip(vertices, vectors, strict=True)
        ]
        change = ChangeSet(id="cs1", user_id=USER, event_ids=["e1"], vertices=vertices, edges=edges)
        await store.apply(change, items)
        shown = Triplet(start=song, edge=edges[0], end=message)  # as a retriever shows the message
        assert await line_objects(store, USER, [shown]) == {shown.id: {song.id: "Changed It", singer.id: "Nicki Minaj"}}


def test_no_line_about_a_name_the_question_says_leaves_the_order_alone() -> None:
    lines = [_relation("Ann Lee", "likes", "Bob Ray"), _relation("Cy Dee", "likes", "Di Eve")]
    (only,) = _chain("Who likes Zed Zee?", lines).sections(limit=5)
    assert only.heading == "" and only.lines == lines
    (cut,) = _chain("Who?", lines).sections(limit=1)
    assert cut.lines == lines[:1]


def test_the_bridge_is_what_the_first_lines_say_and_a_line_is_shown_once() -> None:
    ab, bc, cd, xy = (
        _relation(*t)
        for t in [
            ("Ann Lee", "r", "Bob Ray"),
            ("Bob Ray", "r", "Cy Dee"),
            ("Cy Dee", "r", "Di Eve"),
            ("X Y", "r", "Z W"),
        ]
    )
    lines = [xy, cd, bc, ab]
    laid = _chain("What is the r of the r of ann lee?", lines).sections(limit=10)
    assert [(s.heading, s.lines) for s in laid] == [
        ("About Ann Lee:", [ab]),
        ("About Bob Ray (named above):", [bc]),
        ("Other lines:", [xy, cd]),  # two hops from the question's name: the rest, in retrieval order
    ]


def test_a_stray_linked_object_is_no_bridge() -> None:
    """Extraction links a message to objects such as "In"; a bridge is what the first lines' words name."""
    first = _relation("Ann Lee", "r", "Bob Ray")
    stray = obj(USER, "In")
    other = _relation("In", "r", "Q Q")
    linked = _linked([first, other])
    linked[first.id][stray.id] = "In"  # linked, and "In" opens no sentence of the line: not said there
    chain = Chain("Who is Ann Lee?")
    chain.add([first, other], linked)
    laid = chain.sections(limit=10)
    assert [s.heading for s in laid] == ["About Ann Lee:", "Other lines:"]


def test_names_said() -> None:
    names = Names({"a": "Mugain", "b": "Holstein", "c": "Mary of Burgundy", "d": "Mary", "e": "In", "f": "song"})
    assert names.said("Who is Mugain's mother?") == {"a"}  # a possessive says the name
    assert names.said("Holstein-Gottorp") == set()  # part of a longer name
    assert names.said("who met mary of burgundy?") == {"c"}  # several words: any case; "Mary" only inside it
    assert names.said("In 1400 Mary came. In") == {"d"}  # one word opening a sentence is not a name there
    assert names.said("a song") == set()  # a common noun chains nothing


def _groups(rows: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    head = ""
    for row in rows:
        if row.startswith("- "):
            out.setdefault(head, []).append(row[2:])
        else:
            head = row
    return out


def _chain(question: str, lines: list[Triplet]) -> Chain:
    chain = Chain(question)
    chain.add(lines, _linked(lines))
    return chain


def _linked(lines: list[Triplet]) -> dict[str, dict[str, str]]:
    return {t.id: {t.start.id: t.start.name, t.end.id: t.end.name} for t in lines}


def _relation(s: str, r: str, o: str) -> Triplet:
    a, b = obj(USER, s), obj(USER, o)
    edge = Edge(
        id=f"{s}-{r}-{o}", user_id=USER, kind=EdgeKind.RELATION, source=a.id, target=b.id, relation=r, t_valid=T0
    )
    return Triplet(start=a, edge=edge, end=b)


async def test_an_inference_reads_the_lines_as_without_the_chain(
    films: SqliteMemoryStore,  # noqa: F811
    embedder: MiniLMEmbedder,  # noqa: F811
) -> None:
    """A "would ..." question follows no link: one call on the lines in the retrieval's order, as with it off."""
    question = "Would the director of Payment On Demand like Seuss books?"

    async def prompt(**options: Any) -> str:
        llm = ScriptedLLM({"answer_check": lambda r: says("Likely yes, since Curtis Bernhardt director.")})
        fast = make_fast(films, embedder, llm, retriever="flat")
        answer = await fast.answer(query(question, **options), Events())
        assert answer.llm_calls == 1
        return last(llm.calls[0])

    assert await prompt(chain_context=True) == await prompt()
