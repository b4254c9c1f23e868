"""Stage 2: the initial search plan of a sub-question, as short natural-language search steps."""

from __future__ import annotations

from pydantic import BaseModel, Field

from services.qa.tasks.common import ListOutput, PromptTask, clean_items, require


class PlanInput(BaseModel):
    question: str
    max_steps: int = 5


class PlanOutput(ListOutput):
    steps: list[str] = Field(description="search steps in order, each one simple question")


class PlanTask(PromptTask[PlanOutput, list[str]]):
    name = "plan"
    output_model = PlanOutput
    max_tokens = 256
    system = (
        "You plan a search in a memory graph. Break the question into a few short search steps, in order, "
        "each a simple question about one fact. A later step may refer to an earlier result "
        '(e.g. \'the author of X\'). Do not answer. Format: {"steps": ["..."]}.'
    )
    example_input = "Question: In which country was the author of Blue Nights born?\nAt most 5 steps."
    example_output = PlanOutput.model_validate(
        {"steps": ["Who is the author of Blue Nights?", "In which country was the author of Blue Nights born?"]}
    )

    def render(self, inputs: PlanInput) -> str:
        return f"Question: {inputs.question}\nAt most {inputs.max_steps} steps."

    def postprocess(self, output: PlanOutput, inputs: PlanInput) -> list[str]:
        return require(clean_items(output.steps, inputs.max_steps), "search step")
