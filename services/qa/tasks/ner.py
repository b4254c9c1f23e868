"""Stage 3: the entities of the current search step, to be matched to object vertices."""

from __future__ import annotations

from pydantic import BaseModel, Field

from services.qa.tasks.common import ListOutput, PromptTask, clean_items, content_words


def _in_step(entity: str, step: str) -> bool:
    words = content_words(entity) or {entity.casefold()}
    return all(w in step for w in words)


def _written_as_name(entity: str, step: str) -> bool:
    """Capitalised, a number or several words, as the step writes it."""
    if len(entity.split()) > 1 or any(c.isdigit() for c in entity):
        return True
    at = step.casefold().find(entity.casefold())
    written = step[at : at + len(entity)] if at >= 0 else entity
    return any(c.isupper() for c in written)


class NerInput(BaseModel):
    step: str
    max_entities: int = 5


class NerOutput(ListOutput):
    entities: list[str] = Field(description="entity names exactly as written in the step")


class NerTask(PromptTask[NerOutput, list[str]]):
    """An empty list is a valid answer: the pipeline then matches the step text itself."""

    name = "ner"
    output_model = NerOutput
    max_tokens = 128
    system = (
        "List the names in the search step exactly as written: people, places, organisations, works, products, "
        "events, dates. Leave out question words and words for relations or types (director, country, film). "
        'Format: {"entities": ["..."]}.'
    )
    example_input = "Step: What country is the director of the film Blue Nights from, and did he visit Paris in 1990?"
    example_output = NerOutput.model_validate({"entities": ["Blue Nights", "Paris", "1990"]})

    def render(self, inputs: NerInput) -> str:
        return f"Step: {inputs.step}"

    def postprocess(self, output: NerOutput, inputs: NerInput) -> list[str]:
        return names_written(output.entities, inputs.step, inputs.max_entities)


def names_written(entities: list[str], step: str, limit: int) -> list[str]:
    """The entities a model named that ``step`` contains, names before common words, at most ``limit``."""
    # Only names the step contains: a small model also "extracts" names from its own knowledge.
    found = [e for e in clean_items(entities, max_chars=120) if _in_step(e, step.casefold())]
    # Lowercase common words ("director", "country") are relation words, not names, when the step has names.
    named = [e for e in found if _written_as_name(e, step)]
    return (named or found)[:limit]
