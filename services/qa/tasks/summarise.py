"""Stage 8: the answer to one clue-query from its retrieved triplets, and the answer to a step from its clues."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field

from services.qa.tasks.common import (
    NOT_FOUND,
    FoundAnswer,
    PromptTask,
    found_answer,
    grounded,
    is_no_info,
    memory_block,
)


class ClueAnswerInput(BaseModel):
    query: str
    memory: list[str]
    as_of: datetime | None = None


class ClueAnswerOutput(BaseModel):
    evidence: str = Field(description="the memory line that answers, copied exactly; empty if none does")
    answer: str


class ClueAnswerTask(PromptTask[ClueAnswerOutput, str | None]):
    """Value: the answer, or None when the memory does not hold it.

    The model first copies the memory line it relies on: quoting makes a small model look before it answers, and
    an answer whose quote or new words are not in the memory is treated as not found.
    """

    name = "clue_answer"
    output_model = ClueAnswerOutput
    max_tokens = 192
    system = (
        "Answer the question from the memory lines only. First copy the one line that answers it into "
        '"evidence", then write a short sentence that states the fact. If the line conflicts with another, say '
        'that the memory holds both; if it is an OPINION or PREDICTION, say whose and when ("Ben thought in '
        'March that ..."). If no line answers it, reply '
        '{"evidence": "", "answer": ""}. Format: {"evidence": "...", "answer": "..."}.'
    )
    example_input = (
        "Memory:\n- Blue Nights author Joan Didion\n- Joan Didion born in Sacramento\n"
        "Question: Who is the author of Blue Nights?"
    )
    example_output = ClueAnswerOutput(
        evidence="Blue Nights author Joan Didion", answer="The author of Blue Nights is Joan Didion."
    )

    def render(self, inputs: ClueAnswerInput) -> str:
        when = f"\nAnswer as of {inputs.as_of.date().isoformat()}." if inputs.as_of else ""
        return f"Memory:\n{memory_block(inputs.memory)}\nQuestion: {inputs.query}{when}"

    def postprocess(self, output: ClueAnswerOutput, inputs: ClueAnswerInput) -> str | None:
        answer, evidence = output.answer.strip(), output.evidence.strip()
        if not evidence or is_no_info(answer) or is_no_info(evidence):
            return None
        if not grounded(evidence, inputs.memory, "", min_share=0.7):
            return None  # the quoted line is not in the memory
        return answer if grounded(answer, inputs.memory, inputs.query) else None


class Finding(BaseModel):
    query: str
    answer: str | None


def findings_block(findings: list[Finding]) -> str:
    return "\n".join(f"- {f.query} -> {f.answer or NOT_FOUND}" for f in findings) or f"- {NOT_FOUND}"


class StepAnswerInput(BaseModel):
    step: str
    findings: list[Finding]


class StepAnswerTask(PromptTask[FoundAnswer, str | None]):
    name = "step_answer"
    output_model = FoundAnswer
    max_tokens = 192
    system = (
        "Combine the findings into one short answer to the search step, keeping names and dates exact. "
        'If no finding answers it, reply {"found": false, "answer": ""}. '
        'Format: {"found": true, "answer": "..."}.'
    )
    example_input = (
        "Findings:\n- Where was Joan Didion born? -> Joan Didion was born in Sacramento.\n"
        f"- Where was Joan Didion (writer) born? -> {NOT_FOUND}\n"
        "Step: Where was the author of Blue Nights born?"
    )
    example_output = FoundAnswer(found=True, answer="Joan Didion, the author of Blue Nights, was born in Sacramento.")

    def render(self, inputs: StepAnswerInput) -> str:
        return f"Findings:\n{findings_block(inputs.findings)}\nStep: {inputs.step}"

    def postprocess(self, output: FoundAnswer, inputs: StepAnswerInput) -> str | None:
        return found_answer(output, [f.answer for f in inputs.findings if f.answer], inputs.step)
