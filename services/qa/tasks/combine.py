"""Stage 13: the final answer from the sub-answers (only asked when there are several)."""

from __future__ import annotations

from pydantic import BaseModel

from services.qa.tasks.common import FoundAnswer, PromptTask, found_answer
from services.qa.tasks.summarise import Finding, findings_block


class CombineInput(BaseModel):
    question: str
    sub_answers: list[Finding]


class CombineTask(PromptTask[FoundAnswer, str | None]):
    name = "combine"
    output_model = FoundAnswer
    max_tokens = 256
    system = (
        "Write the final answer to the question from the answers to its parts, short and exact, keeping "
        "what they say of conflicting statements and of whose opinion or prediction something is. "
        'If they do not answer it, reply {"found": false, "answer": ""}. '
        'Format: {"found": true, "answer": "..."}.'
    )
    example_input = (
        "Answers:\n- Who is the boss of Acme Corp? -> Jane Roe is the boss of Acme Corp.\n"
        "- When did Ann move to Oslo? -> Ann moved to Oslo in May 2021.\n"
        "Question: Who is the boss of Acme Corp, and when did Ann move to Oslo?"
    )
    example_output = FoundAnswer.model_validate(
        {"found": True, "answer": "Jane Roe is the boss of Acme Corp; Ann moved to Oslo in May 2021."}
    )

    def render(self, inputs: CombineInput) -> str:
        return f"Answers:\n{findings_block(inputs.sub_answers)}\nQuestion: {inputs.question}"

    def postprocess(self, output: FoundAnswer, inputs: CombineInput) -> str | None:
        return found_answer(output, [f.answer for f in inputs.sub_answers if f.answer], inputs.question)
