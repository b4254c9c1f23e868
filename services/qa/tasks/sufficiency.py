"""Stage 9: is what the steps found enough to answer the sub-question? If so, the answer itself (one call)."""

from __future__ import annotations

import re

from pydantic import BaseModel, Field

from services.qa.tasks.common import PromptTask, content_words, grounded, is_no_info, names_in
from services.qa.tasks.summarise import Finding, findings_block

_YES_NO = re.compile(r"^\W*(yes|no)\b", re.IGNORECASE)


class SufficiencyInput(BaseModel):
    question: str
    findings: list[Finding]
    steps_left: int = Field(default=0, ge=0, description="search steps that may still run (not shown to the model)")


class SufficiencyOutput(BaseModel):
    sufficient: bool
    answer: str


class SufficiencyTask(PromptTask[SufficiencyOutput, str | None]):
    """Value: the answer to the sub-question when the findings suffice, else None."""

    name = "sufficiency"
    output_model = SufficiencyOutput
    max_tokens = 192
    system = (
        "Decide if the findings are enough to answer the question. If yes, give the short answer, based only "
        "on the findings; a yes/no answer must name the facts (e.g. 'Yes: both were born in Spain.'). If "
        'something is still missing, reply {"sufficient": false, "answer": ""}. '
        'Format: {"sufficient": true, "answer": "..."}.'
    )
    example_input = (
        "Findings:\n- Who is the author of Blue Nights? -> The author of Blue Nights is Joan Didion.\n"
        "- In which country was the author of Blue Nights born? -> not found\n"
        "Question: In which country was the author of Blue Nights born?"
    )
    example_output = SufficiencyOutput.model_validate({"sufficient": False, "answer": ""})

    def render(self, inputs: SufficiencyInput) -> str:
        return f"Findings:\n{findings_block(inputs.findings)}\nQuestion: {inputs.question}"

    def postprocess(self, output: SufficiencyOutput, inputs: SufficiencyInput) -> str | None:
        answer = output.answer.strip()
        if not output.sufficient or is_no_info(answer):
            return None
        if inputs.steps_left and _YES_NO.match(answer) and not content_words(answer) - content_words(inputs.question):
            # A bare "Yes"/"No" names no fact to check against the findings; small models say it early. Trust it
            # only once the search has run its course.
            return None
        found = [f for f in inputs.findings if f.answer]
        # An answer with facts the findings do not hold is the model's own knowledge: keep searching instead.
        if not grounded(answer, [f.answer for f in found if f.answer], inputs.question):
            return None
        # A small model says "Yes" to "do X and Y ..." after finding out about X alone: every name the question
        # asks about must appear in what was found.
        seen = content_words(" ".join(f"{f.query} {f.answer}" for f in found))
        return answer if names_in(inputs.question) <= seen else None
