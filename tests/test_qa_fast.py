"""The fast engine (the default) end to end on the hand-built film graph of ``test_qa_pipeline``: real SQLite store,
real MiniLM embedder, real retrievers, and a scripted LLM that reads the engine's two prompts literally.

What it must keep: a first answer that suffices costs one call; an insufficient one runs a bounded planning round;
every one of the 13 stages emits its event (a merged or skipped stage says so); the ablation switches change what
the calls are asked; the answer's text streams from the one call that writes it."""

from __future__ import annotations

import itertools
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from schemas.events import AnswerStatus, StageStatus
from services.adapters.minilm import MiniLMEmbedder
from services.adapters.sqlite import SqliteMemoryStore
from services.container import build_engine
from services.llm.scripted import Responder, ScriptedLLM, rule_based_llm
from services.ports import LLM, LLMRequest, LLMResponse
from services.qa.base import NO_ANSWER, QAConfig
from services.qa.fast import FastQA
from services.qa.planning import PlanningQA
from services.qa.simple import SimpleQA
from services.retrieval.base import Retriever
from services.retrieval.registry import get_retriever
from services.settings import Settings
from tests.test_qa_pipeline import (
    ASKS,
    FILMS,
    PAYMENT_PLAN,
    PAYMENT_Q,
    USER,
    Events,
    add_facts,
    block,
    last,
    line,
    query,
)

DIRECTED = re.compile(r"(?:^|; )(.+?) director ([^;]+)")
#: the answer and plan tasks of the fast engine; any other task would be a call the design does not make
FAST_TASKS = {"answer_check", "search_plan"}


@pytest.fixture(scope="module")
def embedder() -> MiniLMEmbedder:
    return MiniLMEmbedder()


@pytest.fixture
async def films(tmp_path: Path, embedder: MiniLMEmbedder) -> AsyncIterator[SqliteMemoryStore]:
    """The film graph of ``test_qa_pipeline``: two films, their directors, and where the directors are from."""
    async with SqliteMemoryStore(tmp_path / "memory.sqlite3", embedder.dim) as store:
        await add_facts(store, embedder, USER, FILMS, "films")
        yield store


def memory_lines(text: str) -> list[str]:
    return [re.sub(r"^\[[\d-]+\] ", "", fact) for fact in block(text, "Memory")]


def optional(text: str, label: str) -> str:
    return next((row[len(label) + 2 :] for row in text.splitlines() if row.startswith(f"{label}: ")), "")


class FastReader:
    """Answers from the memory lines shown, and plans from what was found, like a very literal model."""

    def __init__(self) -> None:
        self.plans = 0

    def responders(self) -> dict[str, Responder]:
        return {"answer_check": self.answer_check, "search_plan": self.search_plan}

    def answer_check(self, request: LLMRequest) -> dict[str, Any]:
        text = last(request)
        question, memory = line(text, "Question"), memory_lines(text)
        if "same country" in question:
            countries = [f.rsplit(" ", 1)[1] for f in memory if " country of citizenship " in f]
            if len(countries) >= 2:
                same = "Yes" if len(set(countries)) == 1 else "No"
                return {"answer": f"{same}: {', '.join(countries)}.", "sufficient": True, "missing": ""}
            directors = "; ".join(f for f in memory if " director " in f) or "No answer"
            return {"answer": directors, "sufficient": False, "missing": "the countries of the directors"}
        asked = question.casefold()
        for relation in [rel for word, rel in ASKS.items() if word in asked][:1]:
            for fact in memory:
                if f" {relation} " in fact and fact.split(f" {relation} ")[0].casefold() in asked:
                    return {"answer": fact, "sufficient": True, "missing": ""}
        return {"answer": "No answer", "sufficient": False, "missing": "the fact asked"}

    def search_plan(self, request: LLMRequest) -> dict[str, Any]:
        self.plans += 1
        text = last(request)
        question, found = line(text, "Question"), optional(text, "Found")
        directors = [person.strip() for _, person in DIRECTED.findall(found)]
        if directors:
            steps = [{"query": f"What country is {p} from?", "names": [p]} for p in directors]
        elif question == PAYMENT_Q:
            steps = [{"query": s, "names": [s.split("film ")[-1].rstrip("?")]} for s in PAYMENT_PLAN]
        else:
            steps = [{"query": question, "names": []}]
        parts = [question] if "Do not split" in text else [question, *(["And the countries?"] if directors else [])]
        return {"sub_questions": parts, "steps": steps}


def make_fast(store: SqliteMemoryStore, embedder: MiniLMEmbedder, llm: LLM, **config: Any) -> FastQA:
    def retrievers(name: str) -> Retriever:
        if name == "beamsearch":
            return get_retriever(name, store, store, embedder, depth=1)
        return get_retriever(name, store, store, embedder)

    # one hop from the matched seeds: the first retrieval reaches the directors, never their countries
    # the chain's reading and the first link have their own tests (test_qa_chain, test_qa_hops): these pin the
    # first answer's one call and the round
    walk: dict[str, Any] = {
        "retriever": "beamsearch",
        "episodic_context": False,
        "matches_per_entity": 1,
        "chain_context": False,
        "first_link": False,
    }
    return FastQA(store, store, embedder, llm, retrievers, QAConfig(**(walk | config)))


def calls_by_task(llm: ScriptedLLM) -> dict[str, int]:
    counts: dict[str, int] = {}
    for request in llm.calls:
        counts[request.task] = counts.get(request.task, 0) + 1
    return counts


def assert_every_stage_reported(events: Events) -> None:
    assert events.stages() == set(range(1, 14))
    assert events.items[-1].stage == 13
    assert all(e.duration_ms >= 0 for e in events.items)


async def test_a_sufficient_first_answer_is_one_call(films: SqliteMemoryStore, embedder: MiniLMEmbedder) -> None:
    llm = ScriptedLLM(FastReader().responders())
    events = Events()
    question = "Who is the director of the film Payment On Demand?"
    answer = await make_fast(films, embedder, llm).answer(query(question), events)
    assert answer.status is AnswerStatus.ANSWERED
    assert answer.answer == "Payment On Demand director Curtis Bernhardt"
    assert answer.llm_calls == 1 and calls_by_task(llm) == {"answer_check": 1}
    assert any("Curtis Bernhardt" in e.text for e in answer.evidence)
    assert_every_stage_reported(events)
    # what did not run says why, and what ran inside another stage's call says where
    for stage in (1, 2, 10):
        (event,) = events.of(stage)
        assert event.status is StageStatus.SKIPPED and event.detail["reason"] == "first answer sufficient"
    assert events.of(12)[0].status is StageStatus.SKIPPED and events.of(12)[0].detail["reason"] == "sufficient"
    assert events.of(3)[0].detail["named_by"] == "question" and events.of(3)[0].llm_calls == 0
    (read,) = events.of(8)
    assert read.llm_calls == 1 and read.detail["merged"] == ["sufficiency", "combine"]
    assert events.of(9)[0].detail == {"merged_into": "summarise", "sufficient": True, "missing": ""}
    assert events.of(13)[0].detail["merged_into"] == "summarise" and events.of(13)[0].llm_calls == 0
    # one retrieval: the question itself, seeded by every match
    assert len(events.of(6)) == 1 and events.of(6)[0].vertices >= 1
    assert events.of(5)[0].detail["clue_queries"] == [question]


async def test_top_k_bounds_the_lines_the_answer_call_reads(films: SqliteMemoryStore, embedder: MiniLMEmbedder) -> None:
    question = "Who is the director of the film Payment On Demand?"

    async def lines_read(**options: Any) -> int:
        llm = ScriptedLLM(FastReader().responders())
        await make_fast(films, embedder, llm).answer(query(question, **options), Events())
        (request,) = llm.calls
        return len(block(request.messages[-1].content, "Memory"))

    assert await lines_read() == 2  # all the first retrieval found
    assert await lines_read(filter_top_k=1) == 1


@pytest.mark.parametrize("inferred", ["Likely yes, since Payment On Demand director Curtis Bernhardt.", "No answer"])
async def test_an_inference_is_one_call_and_without_the_rule_runs_a_round(
    films: SqliteMemoryStore, embedder: MiniLMEmbedder, inferred: str
) -> None:
    question = "Would Curtis Bernhardt like Seuss books?"  # no line says it, nor could one that a round finds
    responders: dict[str, Responder] = {
        "answer_check": lambda r: {"answer": inferred, "sufficient": False, "missing": "Seuss books"},
        "search_plan": lambda r: {"sub_questions": [question], "steps": [{"query": "What does Seuss write?"}]},
    }
    llm = ScriptedLLM(responders)
    events = Events()
    answer = await make_fast(films, embedder, llm).answer(query(question), events)
    assert answer.llm_calls == 1 and "This asks for an inference" in last(llm.calls[0])
    assert answer.answer == (inferred if inferred.startswith("Likely") else NO_ANSWER)
    if answer.answer == NO_ANSWER:  # the stages that did not run say why
        assert events.of(2)[0].detail["reason"].startswith("an inference")
        assert events.of(12)[0].detail["reason"].startswith("an inference")
    else:
        assert events.of(2)[0].detail["reason"] == "first answer sufficient"
    # MEMSTREAM_QA_INFER_ANSWERS=false (ablation no_inference): no hint, Seuss must be in memory, a round runs
    literal = ScriptedLLM(responders)
    events = Events()
    answer = await make_fast(films, embedder, literal).answer(query(question, infer_answers=False), events)
    assert answer.llm_calls == 3 and calls_by_task(literal) == {"answer_check": 2, "search_plan": 1}
    assert "inference" not in last(literal.calls[0])
    assert [e.detail["sufficient"] for e in events.of(9)] == [False, False]


async def test_an_insufficient_first_answer_runs_one_planning_round(
    films: SqliteMemoryStore, embedder: MiniLMEmbedder
) -> None:
    llm = ScriptedLLM(FastReader().responders())
    events = Events()
    answer = await make_fast(films, embedder, llm).answer(query(PAYMENT_Q), events)
    assert answer.status is AnswerStatus.ANSWERED
    assert answer.answer == "Yes: Germany, Germany."
    assert answer.llm_calls == 3 and calls_by_task(llm) == {"answer_check": 2, "search_plan": 1}
    assert_every_stage_reported(events)
    # the plan was written with what the first answer found: the directors' names, not descriptions
    assert answer.plan[0].text == PAYMENT_Q
    assert sorted(s.text for s in answer.plan[1:]) == [
        "What country is Carl Boese from?",
        "What country is Curtis Bernhardt from?",
    ]
    assert len(answer.plan_history) == 2 and answer.plan[1].revision == 1
    (plan,) = events.of(2)
    assert plan.llm_calls == 1 and plan.detail["merged"] == ["decompose", "ner", "enhance"]
    assert events.of(1)[0].detail["merged_into"] == "plan" and events.of(10)[0].detail["merged_into"] == "plan"
    assert events.of(1)[0].detail["sub_questions"] == [PAYMENT_Q, "And the countries?"]
    # the planned steps' entities came with them: no NER call, and their clue-queries need none either
    planned = [e for e in events.of(3) if e.detail["named_by"] == "plan"]
    assert len(planned) == 2 and all(e.llm_calls == 0 for e in planned)
    assert sum(e.llm_calls for e in events.of(5)) == 0
    assert [e.detail["sufficient"] for e in events.of(9)] == [False, True]
    first, second = (block(last(r), "Memory") for r in llm.calls_for("answer_check"))
    assert second[: len(first)] == first  # read again as first read: the model reuses its cache of that prefix
    assert "Curtis Bernhardt country of citizenship Germany" in second[len(first) :]
    assert "Part: And the countries?" in last(llm.calls_for("answer_check")[1])  # the decomposition reaches it
    assert events.of(12)[0].status is StageStatus.SKIPPED


async def test_no_enhancement_plans_without_what_was_found(films: SqliteMemoryStore, embedder: MiniLMEmbedder) -> None:
    results = {}
    for enhance in (True, False):
        llm = ScriptedLLM(FastReader().responders())
        events = Events()
        answer = await make_fast(films, embedder, llm).answer(query(PAYMENT_Q, plan_enhancement=enhance), events)
        results[enhance] = (answer, events, llm)
    on, _, on_llm = results[True]
    off, off_events, off_llm = results[False]
    assert "Found:" in last(on_llm.calls_for("search_plan")[0])
    assert "Found:" not in last(off_llm.calls_for("search_plan")[0])
    assert on.answer == "Yes: Germany, Germany."
    # planned from the question alone, one hop from the films never reaches the countries: the first answer's
    # partial reading stands, and the round limit is why
    assert "Germany" not in off.answer and off.status is AnswerStatus.ANSWERED
    assert [s.text for s in off.plan][1:] == PAYMENT_PLAN
    assert off_events.of(10)[0].status is StageStatus.SKIPPED
    assert off_events.of(12)[0].detail["reason"] == "round limit"
    assert off_events.of(13)[0].detail["sufficient"] is False
    assert off.llm_calls == 3


class SameFilmTwice(FastReader):
    """Plans two steps that both name the question's first film, as a model often does."""

    def search_plan(self, request: LLMRequest) -> dict[str, Any]:
        self.plans += 1
        steps = [
            {"query": "Who is the director of the film Payment On Demand?", "names": ["Payment On Demand"]},
            {"query": "When was Payment On Demand made?", "names": ["Payment On Demand"]},
        ]
        return {"sub_questions": [line(last(request), "Question")], "steps": steps}


async def test_an_entity_is_matched_once_a_query(films: SqliteMemoryStore, embedder: MiniLMEmbedder) -> None:
    """Steps searched side by side that name the same film share one search of it, and get the same vertices."""
    engine = make_fast(films, embedder, ScriptedLLM(SameFilmTwice().responders()))
    asked: list[str] = []
    match = engine.matcher.match

    async def counted(user_id: str, entities: Any, per_entity: int = 3) -> Any:
        asked.extend(entities)
        return await match(user_id, entities, per_entity)

    engine.matcher.match = counted  # type: ignore[method-assign]
    events = Events()
    answer = await engine.answer(query("Tell me about Payment On Demand."), events)
    assert answer.llm_calls == 3 and len(answer.plan) == 3
    assert asked.count("Payment On Demand") == 1 and len(asked) == len(set(asked))
    first, second = [e for e in events.of(4) if "Payment On Demand" in e.detail["matches"]]
    assert first.detail["matches"] == second.detail["matches"] and first.vertices == second.vertices == 1


async def test_a_query_may_bound_the_rounds(films: SqliteMemoryStore, embedder: MiniLMEmbedder) -> None:
    """The query's ``max_rounds`` (ablation rounds=N) overrides the engine's: 0 keeps the first answer."""
    llm = ScriptedLLM(FastReader().responders())
    events = Events()
    answer = await make_fast(films, embedder, llm).answer(query(PAYMENT_Q, max_rounds=0), events)
    assert answer.llm_calls == 1 and calls_by_task(llm) == {"answer_check": 1}
    assert events.of(12)[0].detail["reason"] == "round limit"


async def test_an_exactly_matched_name_is_searched_as_written(
    films: SqliteMemoryStore, embedder: MiniLMEmbedder
) -> None:
    """In a round, a director matched exactly gets one clue-query, the step itself; with near-match clues on, each
    near match (another person of the graph) is put in the name's place as well, a search each."""
    clues: dict[tuple[bool, bool | None], list[list[str]]] = {}
    # (MEMSTREAM_QA_NEAR_MATCH_CLUES, the query's option: ablation no_near_matches)
    for configured, asked in ((False, None), (True, None), (True, False)):
        llm = ScriptedLLM(FastReader().responders())
        engine = make_fast(films, embedder, llm, matches_per_entity=3, near_match_clues=configured)
        events = Events()
        answer = await engine.answer(query(PAYMENT_Q, near_match_clues=asked), events)
        assert answer.answer == "Yes: Germany, Germany."
        planned = [e for e in events.of(5) if e.detail["clue_queries"][0].startswith("What country is")]
        assert len(planned) == 2
        # the two steps are searched concurrently, so their events come in either order
        clues[configured, asked] = sorted(e.detail["clue_queries"] for e in planned)
        near = configured if asked is None else asked
        assert all(("near_matches" in e.detail) is not near for e in planned)
    assert sorted(c for cs in clues[False, None] for c in cs) == [
        "What country is Carl Boese from?",
        "What country is Curtis Bernhardt from?",
    ]
    assert clues[True, False] == clues[False, None]  # the query's option overrides the setting
    assert all(len(cs) > 1 for cs in clues[True, None])  # the same step with other people's names


async def test_no_decomposition_keeps_the_question_whole(films: SqliteMemoryStore, embedder: MiniLMEmbedder) -> None:
    llm = ScriptedLLM(FastReader().responders())
    events = Events()
    answer = await make_fast(films, embedder, llm).answer(query(PAYMENT_Q, decomposition=False), events)
    assert answer.answer == "Yes: Germany, Germany."
    assert "Do not split" in last(llm.calls_for("search_plan")[0])
    assert "Part:" not in last(llm.calls_for("answer_check")[1])
    assert [e.status for e in events.of(1)] == [StageStatus.SKIPPED]


async def test_step_and_clue_limits_reach_the_round(films: SqliteMemoryStore, embedder: MiniLMEmbedder) -> None:
    llm = ScriptedLLM(FastReader().responders())
    events = Events()
    options: dict[str, Any] = {"plan_enhancement": False, "max_steps": 2, "max_clue_queries": 1}
    answer = await make_fast(films, embedder, llm, matches_per_entity=3).answer(query(PAYMENT_Q, **options), events)
    assert [s.text for s in answer.plan][1:] == PAYMENT_PLAN[:2]
    assert "At most 2 steps." in last(llm.calls_for("search_plan")[0])
    # the steps are searched concurrently: their stage events arrive in either order, each names its step
    clues = {e.step_id: e.detail["clue_queries"] for e in events.of(5)}
    assert [clues[s.id] for s in answer.plan[1:]] == [[s] for s in PAYMENT_PLAN[:2]]


def never_enough(step: Callable[[], str]) -> dict[str, Responder]:
    return {
        "answer_check": lambda r: {"answer": "No answer", "sufficient": False, "missing": "everything"},
        "search_plan": lambda r: {"sub_questions": [line(last(r), "Question")], "steps": [{"query": step()}]},
    }


@pytest.mark.parametrize(("rounds", "calls"), [(0, 1), (1, 3), (2, 5)])
async def test_rounds_bound_the_calls_when_evidence_stays_missing(
    films: SqliteMemoryStore, embedder: MiniLMEmbedder, rounds: int, calls: int
) -> None:
    people = iter(["Curtis Bernhardt", "Carl Boese"])  # each round searches somewhere else
    llm = ScriptedLLM(never_enough(lambda: f"Where was {next(people)} born?"))
    events = Events()
    qa = make_fast(films, embedder, llm, max_rounds=rounds, filter_top_k=2, filter_threshold=-1.0)
    answer = await qa.answer(query("Who is the mayor of Payment On Demand?"), events)
    assert answer.status is AnswerStatus.NO_ANSWER and answer.answer == NO_ANSWER
    assert answer.llm_calls == calls == len(llm.calls)
    assert answer.evidence == []
    assert_every_stage_reported(events)
    assert events.of(12)[0].detail["reason"] == "round limit"
    if rounds > 1:  # a later round is told what the earlier ones searched, and reads what they found
        assert "Already searched: Where was Curtis Bernhardt born?" in last(llm.calls_for("search_plan")[1])
        shown = [block(last(r), "Memory") for r in llm.calls_for("answer_check")]
        assert [len(lines) for lines in shown] == [2, 4, 6]
        assert all(later[: len(earlier)] == earlier for earlier, later in itertools.pairwise(shown))


async def test_a_failed_answer_call_ends_with_error_and_a_failed_plan_with_the_first_answer(
    films: SqliteMemoryStore, embedder: MiniLMEmbedder
) -> None:
    responders = FastReader().responders()
    responders["search_plan"] = lambda r: "not json"
    llm = ScriptedLLM(responders)
    events = Events()
    answer = await make_fast(films, embedder, llm, task_attempts=2).answer(query(PAYMENT_Q), events)
    assert answer.status is AnswerStatus.ANSWERED and "Curtis Bernhardt" in answer.answer  # the partial first answer
    assert events.of(2)[0].status is StageStatus.ERROR and events.of(2)[0].llm_calls == 2
    assert answer.llm_calls == 3  # the answer call, and the plan call's two bounded tries
    assert events.of(12)[0].detail["reason"] == "no new step"

    llm = ScriptedLLM({"answer_check": lambda r: '{"sufficient": true}', "search_plan": responders["search_plan"]})
    answer = await make_fast(films, embedder, llm, task_attempts=1, max_rounds=0).answer(query(PAYMENT_Q))
    assert answer.status is AnswerStatus.ERROR and answer.error and "answer_check" in answer.error


class StreamingLLM(ScriptedLLM):
    """Tells ``on_text`` the reply so far every few characters, as a decoding model does."""

    async def complete(self, request: LLMRequest) -> LLMResponse:
        response = await super().complete(request)
        if request.on_text is not None:
            for end in range(1, len(response.text) + 1, 7):
                request.on_text(response.text[:end])
            request.on_text(response.text)
        return response


async def test_the_answer_streams_and_a_replacing_answer_streams_again(
    films: SqliteMemoryStore, embedder: MiniLMEmbedder
) -> None:
    shown: list[str] = []
    llm = StreamingLLM(FastReader().responders())
    answer = await make_fast(films, embedder, llm).answer(query(PAYMENT_Q), on_text=shown.append)
    first = max((t for t in shown if "director" in t), key=len)  # the first answer, whole: the directors
    assert "Curtis Bernhardt" in first and "Carl Boese" in first
    assert shown[-1] == answer.answer == "Yes: Germany, Germany."
    switch = shown.index(first)
    assert all(first.startswith(text) for text in shown[: switch + 1])
    assert all(answer.answer.startswith(text) for text in shown[switch + 1 :])
    assert len(shown[switch + 1 :]) > 2  # the second answer came in pieces, not whole at the end
    assert len(set(shown)) == len(shown)  # each text once


async def test_a_model_that_does_not_stream_still_shows_the_answer_once(
    films: SqliteMemoryStore, embedder: MiniLMEmbedder
) -> None:
    shown: list[str] = []
    llm = ScriptedLLM(FastReader().responders())
    question = "Who is the director of the film Payment On Demand?"
    answer = await make_fast(films, embedder, llm).answer(query(question), on_text=shown.append)
    assert shown == [answer.answer]


async def test_planning_engine_streams_its_combine_call(films: SqliteMemoryStore, embedder: MiniLMEmbedder) -> None:
    from tests.test_qa_pipeline import film_reader, make_qa

    shown: list[str] = []
    responders = film_reader().responders()
    subs = ["Who is the director of the film Payment On Demand?", "What country is Carl Boese from?"]
    responders["decompose"] = lambda r: {"sub_questions": subs}
    llm = StreamingLLM(responders)
    answer = await make_qa(films, embedder, llm).answer(query(" and ".join(subs)), on_text=shown.append)
    assert answer.status is AnswerStatus.ANSWERED and len(shown) > 2
    assert shown[-1] == answer.answer and all(answer.answer.startswith(t) for t in shown)


def test_the_engine_setting_picks_the_engine(tmp_path: Path, embedder: MiniLMEmbedder) -> None:
    assert Settings.model_fields["qa_engine"].default == "fast"
    kinds = {"fast": FastQA, "planning": PlanningQA, "simple": SimpleQA}
    memory = SqliteMemoryStore(tmp_path / "m.sqlite3", embedder.dim)
    for name, kind in kinds.items():
        settings = Settings(_env_file=None, qa_engine=name, qa_max_rounds=2)  # type: ignore[call-arg]
        engine = build_engine(settings, memory.stores(), embedder, ScriptedLLM())
        assert type(engine) is kind
        if isinstance(engine, FastQA):
            assert engine.config.max_rounds == 2


async def test_the_rule_based_scripted_llm_answers_the_default_engine(
    films: SqliteMemoryStore, embedder: MiniLMEmbedder
) -> None:
    """Demos and workers run with ``MEMSTREAM_SCRIPTED_LLM=services.llm.scripted:rule_based_llm``: it answers the
    default engine's two tasks too."""
    llm = rule_based_llm()
    found = await make_fast(films, embedder, llm).answer(query("Who is the director of the film Payment On Demand?"))
    assert found.status is AnswerStatus.ANSWERED and found.llm_calls == 1
    assert found.answer == "Payment On Demand director Curtis Bernhardt"
    missing = await make_fast(films, embedder, llm).answer(query("Who is the mayor of Gotham?"))
    assert missing.status is AnswerStatus.NO_ANSWER and missing.llm_calls == 3
