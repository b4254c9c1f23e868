"""Stage 1: denoise, enhance and decompose the user's question into independent sub-questions (one call)."""

from __future__ import annotations

import difflib

from pydantic import BaseModel, Field

from services.qa.tasks.common import ListOutput, PromptTask, clean_items, content_words, require

MIN_COVERAGE = 0.7


def _stems(text: str) -> set[str]:
    # A crude plural fold is enough to compare a question with its own parts.
    return {w[:-1] if len(w) > 3 and w.endswith("s") else w for w in content_words(text)}


def coverage(question: str, parts: list[str]) -> float:
    """Share of the question's content words that the parts still contain (a fixed typo still counts)."""
    wanted = _stems(question)
    if not wanted:
        return 1.0
    have = sorted(set().union(*(_stems(p) for p in parts)))
    kept = [w for w in wanted if w in have or difflib.get_close_matches(w, have, n=1, cutoff=0.75)]
    return len(kept) / len(wanted)


class DecomposeInput(BaseModel):
    question: str
    max_sub_questions: int = 4


class DecomposeOutput(ListOutput):
    sub_questions: list[str] = Field(description="self-contained questions, in order")


class DecomposeTask(PromptTask[DecomposeOutput, list[str]]):
    name = "decompose"
    output_model = DecomposeOutput
    max_tokens = 256
    system = (
        "You prepare a user's question for a search in their memory. Keep its meaning and every name exactly as "
        "written; only fix the spelling of ordinary words and drop filler. If it asks several unrelated things, "
        "write one question per thing. Keep parts that depend on each other (e.g. 'the director of X' and his "
        'country) in one question. Do not answer. Format: {"sub_questions": ["..."]}.'
    )
    example_input = (
        "Question: whos the boss of Acme Corp and were was he born?? also when did my sister Ann move to Oslo"
    )
    example_output = DecomposeOutput.model_validate(
        {
            "sub_questions": [
                "Who is the boss of Acme Corp and where was he born?",
                "When did my sister Ann move to Oslo?",
            ]
        }
    )

    def render(self, inputs: DecomposeInput) -> str:
        return f"Question: {inputs.question}"

    def postprocess(self, output: DecomposeOutput, inputs: DecomposeInput) -> list[str]:
        parts = require(clean_items(output.sub_questions, inputs.max_sub_questions, max_chars=1000), "sub-question")
        # Small models "clarify" by changing the meaning ("directors from the same country" became "the same
        # director") or the names, so a rewrite is only taken where it splits the question, and only if the parts
        # still carry most of the question's words; otherwise the user's own words go on.
        if len(parts) == 1 or coverage(inputs.question, parts) < MIN_COVERAGE:
            return [inputs.question.strip()]
        return parts
