"""Stages 8, 9 and 13 of the fast engine in one call: the answer to the whole question from the memory found, with
the verdict whether that memory was enough (sufficiency) and, if not, what is missing (what the next plan searches).

``answer`` comes first in the schema, so a streaming listener gets the answer's text from the first tokens on.
"""

from __future__ import annotations

import calendar
import functools
import re
from collections.abc import Sequence
from datetime import datetime

from pydantic import BaseModel, Field

from services.qa.tasks.common import PromptTask, content_words, grounded, is_no_info, memory_block, names_in

_ISO_DATE = re.compile(r"\b(\d{4})-(\d{2})-(\d{2})\b")
_LABEL = re.compile(r"^(?:Memory|Question):", re.MULTILINE)
#: a question of what someone would do, be or like: its answer is an inference, which no line of memory states
_HYPOTHETICAL = re.compile(r"^\W*(?:would|could|might)\b|\blikely\b", re.IGNORECASE)
# Said in the question's own message, where a small model heeds it (a rule among the system's it did not follow).
INFER_HINT = 'This asks for an inference from the lines: answer what is likely and why ("Likely no, since ...").'


@functools.cache
def _example_names(example: str, answer: str) -> frozenset[str]:
    """The names of a worked example's lines and answer, without the layout's own ("Memory:", "Question:"): fixed
    per task, so worked out once."""
    return frozenset(names_in(". " + _LABEL.sub("", f"{example}\n{answer}")))


def asks_inference(question: str) -> bool:
    return _HYPOTHETICAL.search(question) is not None


def spelled_dates(lines: Sequence[str]) -> list[str]:
    """The dates of ``lines`` as an answer writes them ("2023-05-08" -> "8 May 2023"): a date read off a line's
    stamp is in the memory, though not in its words."""
    return [
        f"{int(day)} {calendar.month_name[int(month)]} {year}"
        for line in lines
        for year, month, day in _ISO_DATE.findall(line)
        if 1 <= int(month) <= 12
    ]


class AnswerCheckInput(BaseModel):
    question: str
    parts: list[str] = Field(default_factory=list, description="the question's parts, when it has several")
    memory: list[str]
    headings: dict[int, str] = Field(
        default_factory=dict, description="a heading shown before the memory line of that index (the chain layout)"
    )
    found: str = Field(default="", description="what an answer call on part of these lines found (the chain's start)")
    as_of: datetime | None = None


class AnswerCheckOutput(BaseModel):
    answer: str
    sufficient: bool
    missing: str = ""


class Verdict(BaseModel):
    """``answer``: None when the memory gave none (or the model's words are not in it)."""

    answer: str | None
    sufficient: bool
    missing: str = ""
    inference: bool = False  # the question asks for an inference: no round would find a line that states it


def _laid_out(inputs: AnswerCheckInput) -> str:
    if not inputs.headings or not inputs.memory:
        return memory_block(inputs.memory)
    rows: list[str] = []
    for i, line in enumerate(inputs.memory):
        if i in inputs.headings:
            rows.append(inputs.headings[i])
        rows.append(f"- {line}")
    return "\n".join(rows)


class AnswerCheckTask(PromptTask[AnswerCheckOutput, Verdict]):
    name = "answer_check"
    output_model = AnswerCheckOutput
    max_tokens = 256
    system = (
        "Answer the question from the memory lines only, briefly: a phrase or one sentence. Prefer the most recent "
        'line when they disagree, but a line that "conflicts with" another is disputed: give both. An OPINION or '
        'PREDICTION line is what its holder thought: say whose and when ("Ben thought in March that ..."). Then '
        "say if the memory was enough to answer every part of the question (sufficient); if not, name what is "
        'still missing in a few words (missing). If the memory says nothing of it, answer "No answer". '
        'Format: {"answer": "...", "sufficient": true, "missing": ""}.'
    )
    example_input = (
        "Memory:\n- [2023-05-02] Joan Didion wrote Blue Nights\n- [2023-05-02] Joan Didion was born in Sacramento\n"
        "Question: Where was the author of Blue Nights born?"
    )
    example_output = AnswerCheckOutput(
        answer="Joan Didion, the author of Blue Nights, was born in Sacramento.", sufficient=True, missing=""
    )

    def __init__(self, *, infer: bool = True) -> None:
        self.infer = infer  # ``QAConfig.infer_answers``

    def inference(self, question: str) -> bool:
        return self.infer and asks_inference(question)

    def leaks(self, answer: str, told: set[str]) -> bool:
        """Whether the answer names someone of the worked example whom ``told`` (the content words of the memory and
        the question) does not. Tried with a second example (6 December), the 1.5B model listed its two people among
        the bands a user had seen, and the rest of that answer passed the grounding check."""
        return bool((names_in(f". {answer}") & _example_names(self.example_input, self.example_output.answer)) - told)

    def render(self, inputs: AnswerCheckInput) -> str:
        parts = "".join(f"\nPart: {p}" for p in inputs.parts) if len(inputs.parts) > 1 else ""
        when = f"\nAnswer as of {inputs.as_of.date().isoformat()}." if inputs.as_of else ""
        hint = f"\n{INFER_HINT}" if self.inference(inputs.question) else ""
        if inputs.found:
            # the chain's first link, read from the named thing's lines: the rest of the chain starts from it
            parts = f"\nFound so far: {inputs.found}{parts}"
        return f"Memory:\n{_laid_out(inputs)}\nQuestion: {inputs.question}{parts}{when}{hint}"

    def postprocess(self, output: AnswerCheckOutput, inputs: AnswerCheckInput) -> Verdict:
        answer: str | None = output.answer.strip()
        missing = output.missing.strip()
        # An answer with words the memory does not hold is the model's own knowledge: not an answer from memory.
        sources = [*inputs.memory, *spelled_dates(inputs.memory)]
        shown, names = content_words(" ".join(inputs.memory)), names_in(inputs.question)
        if (
            not answer
            or is_no_info(answer)
            or not grounded(answer, sources, inputs.question)
            or self.leaks(answer, shown | content_words(inputs.question))
        ):
            answer = None
        # A small model says "sufficient" after finding out about one of two names: each must be in the memory.
        inference = self.inference(inputs.question)
        if inference:
            # What an inference is about ("Dr. Seuss books") is what memory lacks, and the model calls it missing
            # for that: its subject in memory and a grounded answer suffice.
            sufficient = answer is not None and (bool(names & shown) or not names)
        else:
            sufficient = output.sufficient and answer is not None and names <= shown
        if not sufficient and not missing:
            missing = "the answer" if answer is None else "the rest of the question"
        return Verdict(answer=answer, sufficient=sufficient, missing="" if sufficient else missing, inference=inference)
