"""Stages 1, 2, 3 and 10 of the fast engine in one call: split the question into its parts (decomposition), write
the search steps (plan) with the names each mentions (entities, matched without a call of their own), using what
the first answer found and what it said is missing (enhancement)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from services.ids import normalize_text
from services.qa.tasks.common import PromptTask, clean_items, require
from services.qa.tasks.decompose import MIN_COVERAGE, coverage
from services.qa.tasks.ner import names_written


class SearchPlanInput(BaseModel):
    question: str
    found: str = Field(default="", description="what the memory answered so far; empty: not shown (no enhancement)")
    missing: str = ""
    done: list[str] = Field(default_factory=list, description="steps already searched")
    decompose: bool = True
    max_sub_questions: int = 4
    max_steps: int = 5
    max_entities: int = 5


class PlannedStep(BaseModel):
    query: str
    names: list[str] = Field(default_factory=list, description="names in the query, exactly as written there")


class SearchPlanOutput(BaseModel):
    sub_questions: list[str] = Field(description="the question's independent parts, in order")
    steps: list[PlannedStep] = Field(description="search steps in order, each one simple question")


class SearchPlan(BaseModel):
    sub_questions: list[str]
    steps: list[PlannedStep]


class SearchPlanTask(PromptTask[SearchPlanOutput, SearchPlan]):
    name = "search_plan"
    output_model = SearchPlanOutput
    max_tokens = 384
    system = (
        "You plan a search in a user's memory. First write the question's parts: one question per unrelated thing "
        "it asks, keeping every name exactly as written (one part if it asks one thing). Then write a few short "
        "search steps, in order, each a simple question about one fact, with the names it mentions. A later step "
        "may refer to an earlier one ('the author of X'). Use what was found: put a found name in place of its "
        "description and search only for what is missing. Do not answer. "
        'Format: {"sub_questions": ["..."], "steps": [{"query": "...", "names": ["..."]}]}.'
    )
    example_input = (
        "Question: Were the authors of Blue Nights and Dune born in the same country?\n"
        "Found: Joan Didion wrote Blue Nights.\nMissing: the author of Dune, where both were born\nAt most 5 steps."
    )
    example_output = SearchPlanOutput.model_validate(
        {
            "sub_questions": ["Were the authors of Blue Nights and Dune born in the same country?"],
            "steps": [
                {"query": "Where was Joan Didion born?", "names": ["Joan Didion"]},
                {"query": "Who is the author of Dune?", "names": ["Dune"]},
                {"query": "Where was the author of Dune born?", "names": ["Dune"]},
            ],
        }
    )

    def render(self, inputs: SearchPlanInput) -> str:
        lines = [f"Question: {inputs.question}"]
        if not inputs.decompose:
            lines.append("Do not split the question: its one part is the question as written.")
        if inputs.found or inputs.missing:
            lines += [f"Found: {inputs.found or 'nothing yet'}", f"Missing: {inputs.missing or 'unknown'}"]
        if inputs.done:
            lines.append("Already searched: " + "; ".join(inputs.done))
        lines.append(f"At most {inputs.max_steps} steps.")
        return "\n".join(lines)

    def postprocess(self, output: SearchPlanOutput, inputs: SearchPlanInput) -> SearchPlan:
        question = inputs.question.strip()
        parts = clean_items(output.sub_questions, inputs.max_sub_questions, max_chars=1000)
        # as in the decompose task: a rewrite is taken only where it splits the question and keeps its words
        if not inputs.decompose or len(parts) < 2 or coverage(question, parts) < MIN_COVERAGE:
            parts = [question]
        done = {normalize_text(d) for d in inputs.done}
        by_text = {normalize_text(s.query): s for s in output.steps}
        texts = [t for t in clean_items(s.query for s in output.steps) if normalize_text(t) not in done]
        steps = []
        for text in require(texts, "new search step")[: inputs.max_steps]:
            named = by_text.get(normalize_text(text))
            names = names_written(named.names if named else [], text, inputs.max_entities)
            steps.append(PlannedStep(query=text, names=names))
        return SearchPlan(sub_questions=parts, steps=steps)
