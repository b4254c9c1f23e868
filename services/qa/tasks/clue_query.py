"""Stage 5: clue-queries, the step rewritten for each combination of matched object vertices (one call for all).

A combination whose vertices all carry their entity's own name needs no rewrite: the step itself is its clue-query.
``substitute`` is the deterministic rewrite used for those and when the task fails.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from pydantic import BaseModel, Field

from services.llm.task import TaskOutputError
from services.qa.tasks.common import ListOutput, PromptTask, clean_items


class Substitution(BaseModel):
    entity: str
    vertex: str


class ClueQueryInput(BaseModel):
    step: str
    combinations: list[list[Substitution]]


class ClueQueryOutput(ListOutput):
    queries: list[str] = Field(description="one rewritten query per numbered combination, same order")


def _literal(text: str) -> Callable[[re.Match[str]], str]:
    return lambda _match: text


def mention(step: str, names: Sequence[str]) -> str:
    """The step with the names it does not already contain appended in brackets."""
    extra = [n for n in dict.fromkeys(names) if n.casefold() not in step.casefold()]
    return f"{step} ({', '.join(extra)})" if extra else step


def substitute(step: str, combination: Sequence[Substitution]) -> str:
    """Put each vertex name in place of its entity; a vertex whose entity is not in the step is appended."""
    text = step
    extra: list[str] = []
    for sub in combination:
        pattern = re.compile(re.escape(sub.entity), re.IGNORECASE)
        if sub.entity.strip() and pattern.search(text):
            # A function replacement: the vertex name is literal text, not a regex template.
            text = pattern.sub(_literal(sub.vertex), text, count=1)
        else:
            extra.append(sub.vertex)
    return mention(text, extra)


class ClueQueryTask(PromptTask[ClueQueryOutput, list[str]]):
    name = "clue_query"
    output_model = ClueQueryOutput
    max_tokens = 384
    system = (
        "Rewrite a search step once for each numbered line of matches: put each memory name in place of its "
        "entity and keep the rest of the step. If a memory name clearly means something else than the entity, "
        'keep the entity. One query per line, same order. Format: {"queries": ["..."]}.'
    )
    example_input = (
        "Step: Where was Bob Dylan born?\n"
        "Matches:\n"
        "1. Bob Dylan -> Bob Dylan (musician)\n"
        "2. Bob Dylan -> Robert Zimmerman\n"
        "3. Bob Dylan -> Dylan Thomas"
    )
    example_output = ClueQueryOutput.model_validate(
        {
            "queries": [
                "Where was Bob Dylan (musician) born?",
                "Where was Robert Zimmerman born?",
                "Where was Bob Dylan born?",
            ]
        }
    )

    def render(self, inputs: ClueQueryInput) -> str:
        lines = [
            f"{i}. " + "; ".join(f"{s.entity} -> {s.vertex}" for s in combo)
            for i, combo in enumerate(inputs.combinations, 1)
        ]
        return f"Step: {inputs.step}\nMatches:\n" + "\n".join(lines)

    def postprocess(self, output: ClueQueryOutput, inputs: ClueQueryInput) -> list[str]:
        # Keep positions (no dedup here): query i belongs to combination i.
        queries = [next(iter(clean_items([q])), "") for q in output.queries]
        if len(queries) != len(inputs.combinations):
            raise TaskOutputError(f"expected {len(inputs.combinations)} queries, got {len(queries)}")
        if not all(queries):
            raise TaskOutputError("empty query in the output")
        return queries
