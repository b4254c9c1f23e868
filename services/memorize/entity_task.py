"""Do two names in one user's memory name the same person, place or thing? Asked once per batch, for the name
pairs entity resolution (``services.memorize.entities``) could not settle by itself.

Each pair shows both names with a statement that uses each, so the model judges the names as used, not as
strings ("Mel" who has two kids and "Melanie" who has two kids; "Anna's sister" and "Anna's brother"). The schema
fixes one verdict per pair; a pair the model skips is "different": a missed merge is repaired by a later one or
by hand, a wrong one mixes two people's facts.

Scripted-LLM contract (task name ``same_entity``): ``{"pairs": [{"p": 1, "verdict": "same|different"}]}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.llm.task import LLMTask, numbered_pairs_schema
from services.ports import LLMMessage

Verdict = Literal["same", "different"]


class PairOut(BaseModel):
    model_config = ConfigDict(extra="ignore")

    p: int = Field(ge=1)
    verdict: Verdict


class SameEntityOut(BaseModel):
    model_config = ConfigDict(extra="ignore")

    pairs: list[PairOut]


@dataclass(frozen=True)
class NamePair:
    new: str
    new_context: str
    known: str
    known_context: str


SYSTEM = """You keep a memory of the people, places and things someone talks about. For each numbered pair, \
say whether NAME A and NAME B, as the statements use them, name the same one: "same" for a nickname or short \
form, a spelling variant, or another word for the same relative or thing; "different" for two people, places or \
things, even with similar names. When unsure, answer "different". Output JSON only."""

EXAMPLE_IN = """[1] A: "Jon" (Jon plays the guitar in a band.)
    B: "Jonathan" (Jonathan joined a band in 2020.)
[2] A: "Anna's mum" (Anna's mum lives in Porto.)
    B: "Anna's mother" (Anna's mother is a teacher.)
[3] A: "Maria" (Maria has a dog.)
    B: "Mario" (Mario works at a garage.)
[4] A: "Anna's sister" (Anna's sister is getting married.)
    B: "Anna's brother" (Anna's brother moved to Berlin.)"""

EXAMPLE_OUT = (
    '{"pairs":[{"p":1,"verdict":"same"},{"p":2,"verdict":"same"},{"p":3,"verdict":"different"},'
    '{"p":4,"verdict":"different"}]}'
)


def _quoted(text: str) -> str:
    return " ".join(text.split())[:200]


class SameEntityTask(LLMTask[SameEntityOut, list[Verdict]]):
    name = "same_entity"
    output_model = SameEntityOut
    max_tokens = 768  # about 12 tokens a pair: ``entities.MAX_PAIRS`` pairs fit

    def messages(self, inputs: list[NamePair]) -> list[LLMMessage]:
        lines = [
            f'[{n}] A: "{_quoted(p.new)}" ({_quoted(p.new_context)})\n    B: "{_quoted(p.known)}" '
            f"({_quoted(p.known_context)})"
            for n, p in enumerate(inputs, start=1)
        ]
        return [
            LLMMessage(role="system", content=SYSTEM),
            LLMMessage(role="user", content=EXAMPLE_IN),
            LLMMessage(role="assistant", content=EXAMPLE_OUT),
            LLMMessage(role="user", content="\n".join(lines)),
        ]

    def json_schema(self, inputs: Any = None) -> dict[str, Any]:
        schema = self.output_model.model_json_schema()
        if not isinstance(inputs, list):
            return schema
        return numbered_pairs_schema(schema, len(inputs))

    def postprocess(self, output: SameEntityOut, inputs: list[NamePair]) -> list[Verdict]:
        verdicts: dict[int, Verdict] = {pair.p: pair.verdict for pair in output.pairs}
        return [verdicts.get(n, "different") for n in range(1, len(inputs) + 1)]
