"""Stage 10: rewrite the steps not yet done with what the done steps found (fill in names, split, add)."""

from __future__ import annotations

import re

from pydantic import BaseModel, Field

from services.ids import normalize_text
from services.llm.task import TaskOutputError
from services.qa.tasks.common import ListOutput, PromptTask, clean_items, numbered
from services.qa.tasks.summarise import Finding, findings_block

#: a name: capitalised words in a row ("Blue Nights", "St. Mary's"), after the step's first word
_NAME = re.compile(r"(?<!^)(?<![.?!] )\b[A-Z][\w'\u2019.-]*(?: [A-Z][\w'\u2019.-]*)*")
#: a name in a description of something else ("the author of Blue Nights", "Maya's brother", "written by X"):
#: filling in what was found may replace the whole description, the name with it
_DESCRIBED = re.compile(r"\b(?:of|by|for|from|to|with)\s+$", re.IGNORECASE)


def subjects(step: str) -> set[str]:
    """The names a step asks about directly ("Where does Maya work now?" -> Maya), not inside a description."""
    out = set()
    for match in _NAME.finditer(step):
        name = match.group(0).rstrip(".")
        possessive = name.endswith(("'s", "\u2019s"))
        if not possessive and not _DESCRIBED.search(step[: match.start()]):
            out.add(name)
    return out


class EnhanceInput(BaseModel):
    question: str
    done: list[Finding]
    remaining: list[str]
    max_steps: int = Field(ge=0, description="how many steps may still run")


class EnhanceOutput(ListOutput):
    steps: list[str] = Field(description="the steps still to do, rewritten")


class EnhanceTask(PromptTask[EnhanceOutput, list[str]]):
    """Value: the new remaining steps. Steps already done are dropped; an empty list keeps the old plan."""

    name = "enhance"
    output_model = EnhanceOutput
    max_tokens = 256
    system = (
        "Improve the remaining search steps with what the done steps found: replace descriptions such as "
        "'the author of X' by the name found, split a step that found nothing into simpler ones, add a step if "
        'something needed is missing. Do not repeat done steps. Format: {"steps": ["..."]}.'
    )
    example_input = (
        "Question: Were the authors of Blue Nights and Dune born in the same country?\n"
        "Done:\n- Who is the author of Blue Nights? -> The author of Blue Nights is Joan Didion.\n"
        "- Who is the author of Dune? -> Frank Herbert wrote Dune.\n"
        "Remaining:\n1. Where was the author of Blue Nights born?\n2. Where was the author of Dune born?\n"
        "At most 3 steps."
    )
    example_output = EnhanceOutput.model_validate(
        {"steps": ["Where was Joan Didion born?", "Where was Frank Herbert born?"]}
    )

    def render(self, inputs: EnhanceInput) -> str:
        return (
            f"Question: {inputs.question}\nDone:\n{findings_block(inputs.done)}\n"
            f"Remaining:\n{numbered(inputs.remaining)}\nAt most {inputs.max_steps} steps."
        )

    def postprocess(self, output: EnhanceOutput, inputs: EnhanceInput) -> list[str]:
        done = {normalize_text(f.query) for f in inputs.done}
        steps = [s for s in clean_items(output.steps) if normalize_text(s) not in done][: inputs.max_steps]
        # A step about Maya stays about Maya: found "Maya is Leo's sister", a small model rewrote "Where does Maya
        # work now?" as "Where does Leo work now?" and answered for Leo. Only a description is filled in.
        said = normalize_text(" ".join(steps))
        lost = sorted(n for s in inputs.remaining for n in subjects(s) if normalize_text(n) not in said)
        if steps and lost:
            raise TaskOutputError(f"the steps are about {', '.join(lost)}: keep that name, fill in only descriptions")
        return steps
