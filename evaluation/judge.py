"""LLM-as-a-judge: one task grades an answer against the gold answers, one grades whether memory retains a fact
(MINE, as the KGGen paper scores it). Each prompt is one constant here; the verdict comes with the judge's reason,
which the results keep."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, StringConstraints

from services.llm.task import LLMTask
from services.ports import LLMMessage


class Verdict(BaseModel):
    model_config = ConfigDict(extra="ignore")

    reason: Annotated[str, StringConstraints(strip_whitespace=True, min_length=1, max_length=1000)]
    verdict: Literal["CORRECT", "WRONG"]

    @property
    def correct(self) -> bool:
        return self.verdict == "CORRECT"


ANSWER_PROMPT = """You grade an answer to a question against the gold answer(s). Mark CORRECT when the answer \
states the same thing as a gold answer, however it is worded: a date in another format, a name with or without its \
title, a longer answer that contains the gold one without contradicting it. Mark WRONG when it differs, is \
missing, says there is no answer, or only hedges. First give a one-sentence reason, then the verdict. \
Reply with JSON only: {"reason": "...", "verdict": "CORRECT" | "WRONG"}."""

RETENTION_PROMPT = """You check whether a FACT can be inferred from the CONTEXT a memory returned for it. Mark \
CORRECT only if the CONTEXT states the fact or clearly implies it; WRONG if it is absent, only related, or \
contradicted. First give a one-sentence reason, then the verdict. \
Reply with JSON only: {"reason": "...", "verdict": "CORRECT" | "WRONG"}."""


@dataclass(frozen=True)
class AnswerJudgeInput:
    question: str
    answers: list[str]
    prediction: str


@dataclass(frozen=True)
class RetentionInput:
    fact: str
    context: list[str]


class AnswerJudgeTask(LLMTask[Verdict, Verdict]):
    name = "judge"
    output_model = Verdict
    max_tokens = 200

    def messages(self, inputs: AnswerJudgeInput) -> list[LLMMessage]:
        gold = " | ".join(inputs.answers)
        text = f"QUESTION: {inputs.question}\nGOLD: {gold}\nANSWER: {inputs.prediction or '(none)'}"
        return [LLMMessage(role="system", content=ANSWER_PROMPT), LLMMessage(role="user", content=text)]


class RetentionTask(LLMTask[Verdict, Verdict]):
    name = "judge_retention"
    output_model = Verdict
    max_tokens = 200

    def messages(self, inputs: RetentionInput) -> list[LLMMessage]:
        context = "\n".join(f"- {line}" for line in inputs.context) or "(nothing)"
        text = f"CONTEXT:\n{context}\nFACT: {inputs.fact}"
        return [LLMMessage(role="system", content=RETENTION_PROMPT), LLMMessage(role="user", content=text)]
