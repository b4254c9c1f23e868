"""The fast engine's two merged tasks (``answer_check``: answer + sufficiency; ``search_plan``: decomposition +
plan + NER + enhancement) and the streaming reader of a JSON answer being written (``answer_text_so_far``)."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from services.llm.task import TaskOutputError
from services.qa.streaming import answer_text_so_far, streamed
from services.qa.tasks import (
    AnswerCheckInput,
    AnswerCheckTask,
    SearchPlan,
    SearchPlanInput,
    SearchPlanTask,
    Verdict,
)
from services.qa.tasks.answer_check import INFER_HINT, asks_inference
from services.qa.tasks.common import GROUNDING, grounded

MEMORY = ["[2023-05-02] Joan Didion wrote Blue Nights", "[2023-05-02] Joan Didion was born in Sacramento"]


@pytest.mark.parametrize(
    ("task", "inputs"),
    [
        (AnswerCheckTask(), AnswerCheckInput(question="q?", memory=[])),
        (SearchPlanTask(), SearchPlanInput(question="q?")),
    ],
)
def test_prompt_layout_and_schema(task: AnswerCheckTask | SearchPlanTask, inputs: object) -> None:
    messages = task.messages(inputs)
    assert [m.role for m in messages] == ["system", "user", "assistant", "user"]
    assert GROUNDING in messages[0].content and len(messages[0].content) < 700
    task.output_model.model_validate_json(messages[2].content)  # the worked example is valid output


def test_the_worked_example_passes_the_answer_check_itself() -> None:
    """An example the guards would drop (words not in its lines, a name not shown) would teach the model an answer
    the engine then refuses."""
    task = AnswerCheckTask()
    lines = task.example_input.splitlines()
    memory = [line.removeprefix("- ") for line in lines if line.startswith("- ")]
    question = next(line.removeprefix("Question: ") for line in lines if line.startswith("Question: "))
    verdict = task.parse(task.example_output.model_dump_json(), AnswerCheckInput(question=question, memory=memory))
    assert verdict == Verdict(answer=task.example_output.answer, sufficient=True, missing="")


def test_the_answer_is_the_first_field_so_it_streams_first() -> None:
    assert next(iter(AnswerCheckTask().json_schema()["properties"])) == "answer"


def check(raw: dict[str, Any], question: str = "Where was the author of Blue Nights born?") -> Verdict:
    return AnswerCheckTask().parse(json.dumps(raw), AnswerCheckInput(question=question, memory=MEMORY))


def test_answer_check_keeps_a_grounded_sufficient_answer() -> None:
    verdict = check({"answer": "Joan Didion was born in Sacramento.", "sufficient": True})
    assert verdict == Verdict(answer="Joan Didion was born in Sacramento.", sufficient=True, missing="")


def test_answer_check_drops_what_the_memory_does_not_say_and_asks_for_more() -> None:
    # the model's own knowledge: no answer from memory, and so not sufficient, whatever it said
    verdict = check({"answer": "She was born in California, United States.", "sufficient": True, "missing": ""})
    assert verdict == Verdict(answer=None, sufficient=False, missing="the answer")
    nothing = check({"answer": "No answer", "sufficient": False, "missing": "where she was born"})
    assert nothing == Verdict(answer=None, sufficient=False, missing="where she was born")


def test_an_answer_naming_the_worked_example_s_people_is_dropped() -> None:
    """The names of the prompt's example are not the user's: an answer that lists them is no answer from memory,
    though its other words are; the same names in memory are the user's own."""
    question = "What musical artists has Melanie seen?"
    lines = ["[2023-08-01] Melanie saw Ed Sheeran in concert", "[2023-08-01] Melanie went to a Bach recital"]
    leaked = {"answer": "Melanie has seen Ed Sheeran in concert, a Bach recital and Joan Didion.", "sufficient": True}
    task = AnswerCheckTask()
    assert grounded(leaked["answer"], lines, question)  # most of its words are in memory: the names give it away
    verdict = task.parse(json.dumps(leaked), AnswerCheckInput(question=question, memory=lines))
    assert verdict == Verdict(answer=None, sufficient=False, missing="the answer")
    own = [*lines, "[2023-08-02] Melanie heard Joan Didion read"]
    assert task.parse(json.dumps(leaked), AnswerCheckInput(question=question, memory=own)).answer == leaked["answer"]


def test_answer_check_takes_a_date_read_off_a_line_s_stamp() -> None:
    question = "When did Joan Didion write Blue Nights?"
    assert check({"answer": "On 2 May 2023.", "sufficient": True}, question=question).answer == "On 2 May 2023."
    assert check({"answer": "May 2, 2023", "sufficient": True}, question=question).sufficient
    assert check({"answer": "In June 1987 in Paris.", "sufficient": True}, question=question).answer is None


def test_answer_check_is_not_sufficient_while_a_name_asked_about_is_not_in_memory() -> None:
    verdict = check(
        {"answer": "Joan Didion was born in Sacramento.", "sufficient": True},
        question="Were Joan Didion and Frank Herbert born in Sacramento?",
    )
    assert verdict.answer == "Joan Didion was born in Sacramento." and not verdict.sufficient
    assert verdict.missing == "the rest of the question"


def test_an_inference_is_asked_for_in_the_question_and_needs_only_its_subject_in_memory() -> None:
    question = "Would Joan Didion like a Dr. Seuss book?"
    inputs = AnswerCheckInput(question=question, memory=MEMORY)
    assert AnswerCheckTask().messages(inputs)[-1].content.endswith(INFER_HINT)
    # Seuss is not in memory, and the model calls it missing: the inference still suffices, and says it is one
    raw = {"answer": "Likely no, since Joan Didion wrote Blue Nights.", "sufficient": False, "missing": "Seuss"}
    assert check(raw, question=question) == Verdict(answer=raw["answer"], sufficient=True, inference=True)
    nothing = check({"answer": "No answer", "sufficient": False}, question=question)
    assert nothing.answer is None and not nothing.sufficient and nothing.inference
    # an inference about nobody the memory knows is not enough
    assert not check({"answer": "Likely no.", "sufficient": True}, question="Would Ann Lee like Dr. Seuss?").sufficient
    # not an inference: every name asked about must be in memory, and no hint is added
    plain = check({"answer": "Joan Didion wrote Blue Nights.", "sufficient": True}, question="Did Seuss or Didion?")
    assert not plain.sufficient and not plain.inference
    assert INFER_HINT not in AnswerCheckTask().messages(AnswerCheckInput(question="Who?", memory=[]))[-1].content
    # the rule off (ablation no_inference): no hint, and every name must be in memory
    off = AnswerCheckTask(infer=False)
    assert INFER_HINT not in off.messages(inputs)[-1].content
    assert off.messages(inputs)[0] == AnswerCheckTask().messages(inputs)[0]  # the same rules either way
    literal = off.parse(json.dumps(raw | {"sufficient": True}), inputs)
    assert literal.answer == raw["answer"] and not literal.sufficient and not literal.inference


@pytest.mark.parametrize(
    ("question", "inference"),
    [
        ("Would Caroline likely have Dr. Seuss books on her bookshelf?", True),
        ("What fields would Caroline be likely to pursue?", True),
        ("Could Ben run a marathon?", True),
        ("Where was the author of Blue Nights born?", False),
        ("Are Ben and Anna of the same nationality?", False),
    ],
)
def test_what_asks_for_an_inference(question: str, inference: bool) -> None:
    assert asks_inference(question) is inference


def test_answer_check_shows_the_parts_and_the_time() -> None:
    from datetime import UTC, datetime

    inputs = AnswerCheckInput(question="Q?", parts=["A?", "B?"], memory=MEMORY, as_of=datetime(2024, 1, 2, tzinfo=UTC))
    prompt = AnswerCheckTask().messages(inputs)[-1].content
    assert "Part: A?\nPart: B?" in prompt and "as of 2024-01-02" in prompt and f"- {MEMORY[0]}" in prompt
    one_part = AnswerCheckTask().messages(inputs.model_copy(update={"parts": ["Q?"]}))[-1].content
    assert "Part:" not in one_part


def plan(raw: dict[str, Any], **inputs: Any) -> SearchPlan:
    question = "Were the authors of Blue Nights and Dune born in the same country?"
    return SearchPlanTask().parse(json.dumps(raw), SearchPlanInput(question=question, **inputs))


def test_search_plan_steps_carry_only_names_they_contain_and_skip_done_steps() -> None:
    raw = {
        "sub_questions": ["Where was the author of Blue Nights born?", "Where was the author of Dune born?"],
        "steps": [
            {"query": "Who is the author of Dune?", "names": ["Dune", "Frank Herbert", "author"]},
            {"query": "Where was Joan Didion born?", "names": ["Joan Didion"]},
            {"query": "1. Where was the author of Dune born?"},
        ],
    }
    result = plan(raw, done=["Where was Joan Didion born?"], max_steps=5)
    steps = [(s.query, s.names) for s in result.steps]
    assert steps == [("Who is the author of Dune?", ["Dune"]), ("Where was the author of Dune born?", [])]
    assert result.sub_questions == raw["sub_questions"]


def test_search_plan_keeps_the_question_whole_unless_split_and_asked_to() -> None:
    question = "Were the authors of Blue Nights and Dune born in the same country?"
    split = {"sub_questions": ["Where was the author of Blue Nights born?", "Dune?"], "steps": [{"query": "s?"}]}
    assert plan(split, decompose=False).sub_questions == [question]
    lost = {"sub_questions": ["Who wrote a book?", "What is a country?"], "steps": [{"query": "s?"}]}
    assert plan(lost).sub_questions == [question]
    prompt = SearchPlanTask().messages(SearchPlanInput(question=question, decompose=False))[-1].content
    assert "Do not split" in prompt and "Found:" not in prompt


def test_search_plan_without_a_new_step_is_refused_and_capped_at_the_limit() -> None:
    with pytest.raises(TaskOutputError, match="new search step"):
        plan({"sub_questions": [], "steps": [{"query": "Done?"}]}, done=["Done?"])
    many = {"sub_questions": [], "steps": [{"query": f"Step {i}?"} for i in range(6)]}
    assert [s.query for s in plan(many, max_steps=2).steps] == ["Step 0?", "Step 1?"]


# -- the answer text while the JSON is written -----------------------------------------------------------------


@pytest.mark.parametrize(
    "answer",
    ['Caf\u00e9 "Le Mans" \U0001f600 ok\n', "a\\b\\\\c", "ends with a backslash \\", "\\u00e9 written out", ""],
)
def test_the_text_so_far_only_grows_and_ends_as_the_answer(answer: str) -> None:
    for ascii_only in (True, False):
        full = json.dumps({"answer": answer, "sufficient": True}, ensure_ascii=ascii_only)
        shown = [answer_text_so_far(full[:end]) for end in range(len(full) + 1)]
        assert shown[-1] == answer
        assert all(later.startswith(earlier) for earlier, later in itertools.pairwise(shown))


def test_the_text_so_far_of_other_outputs() -> None:
    assert answer_text_so_far("") == "" and answer_text_so_far('{"answ') == ""
    assert answer_text_so_far('{"found": true, "answer": "Jane R') == "Jane R"  # not the first field: still read
    assert answer_text_so_far('```json\n{"answer" : "x') == "x"
    assert answer_text_so_far('{"answer": 42}') == ""


def test_streamed_tells_each_new_text_once_and_a_restart() -> None:
    shown: list[str] = []
    listen = streamed(shown.append)
    assert listen is not None and streamed(None) is None
    for partial in ('{"ans', '{"answer": "', '{"answer": "Ja', '{"answer": "Ja', '{"answer": "Jane"}', ""):
        listen(partial)
    assert shown == ["Ja", "Jane", ""]
