"""Stage 10: rewrite the steps not yet done with what the done steps found (fill in names, split, add)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from services.ids import normalize_text
from services.qa.tasks.common import ListOutput, PromptTask, clean_items, numbered
from services.qa.tasks.summarise import Finding, findings_block


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
        steps = [s for s in clean_items(output.steps) if normalize_text(s) not in done]
        return steps[: inputs.max_steps]
