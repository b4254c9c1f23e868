"""Do two names in one user's memory name the same person, place or thing? Asked once per batch, for the name
pairs entity resolution (``services.memorize.entities``) could not settle by itself.

Each pair shows both names with a statement that uses each, so the model judges the names as used, not as
strings ("Mel" who has two kids and "Melanie" who has two kids; "Anna's sister" and "Anna's brother"). The schema
fixes one verdict per pair; a pair the model skips is "different": two objects for one entity lose no fact, one
object for two people mixes theirs.

The model names how A relates to B (a nickname, a misspelling, a synonym: one entity; a relative, a broader or
narrower thing, another one): a small model asked "same or different?" answered the same for nearly every pair,
or copied the worked example's pattern; naming the relation it rejects look-alikes reliably (measured on the
default local model, ``docs/benchmarks.md``, "Entity resolution").

Scripted-LLM contract (task name ``same_entity``): ``{"pairs": [{"p": 1, "verdict": KIND}]}``, KIND one of
``nickname|misspelling|synonym|relative|broader_or_narrower|other``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.llm.task import LLMTask, numbered_pairs_schema
from services.ports import LLMMessage

Verdict = Literal["same", "different"]
#: how name A relates to name B; the first three are one entity
Kind = Literal["nickname", "misspelling", "synonym", "relative", "broader_or_narrower", "other"]
SAME_KINDS = frozenset({"nickname", "misspelling", "synonym"})


class PairOut(BaseModel):
    model_config = ConfigDict(extra="ignore")

    p: int = Field(ge=1)
    verdict: Kind


class SameEntityOut(BaseModel):
    model_config = ConfigDict(extra="ignore")

    pairs: list[PairOut]


@dataclass(frozen=True)
class NamePair:
    new: str
    new_context: str
    known: str
    known_context: str


SYSTEM = """You merge duplicate entries in a memory of the people, places and things someone talks about. Each \
numbered pair gives two names, A and B, each with a statement that uses it. Say how A relates to B: \
"nickname": one is a short form or pet name of the other (Bob and Robert, Kate and Katherine, Chris and \
Christopher); "misspelling": the same name spelled differently (Jonathon and Jonathan, Ohio and Ohaio); \
"synonym": another word for the very same relative, place or thing (Tom's mum and Tom's mother, NYC and New York); \
"relative": a person and their relative, or two different relatives of someone (Tom and Tom's wife, Tom's son and \
Tom's daughter); "broader_or_narrower": one thing is part, kind or place of the other (chess and chess club); \
"other": two different people, places or things, however alike their names (Maria and Mario). Output JSON only."""

EXAMPLE_IN = """[1] A: "Maria" (Maria has a dog.)
    B: "Mario" (Mario works at a garage.)
[2] A: "Liz" (Liz adopted a cat.)
    B: "Elizabeth" (Elizabeth works as a nurse.)
[3] A: "Anna's sister" (Anna's sister is getting married.)
    B: "Anna's brother" (Anna's brother moved to Berlin.)
[4] A: "Anna's dad" (Anna's dad fixed the roof.)
    B: "Anna's father" (Anna's father is a carpenter.)
[5] A: "tennis club" (Anna joined a tennis club.)
    B: "tennis" (Anna loves tennis.)
[6] A: "Jonathon" (Jonathon plays the guitar.)
    B: "Jonathan" (Jonathan joined a band in 2020.)
[7] A: "Anna" (Anna went hiking.)
    B: "Anna's father" (Anna's father is a carpenter.)"""

EXAMPLE_OUT = (
    '{"pairs":[{"p":1,"verdict":"other"},{"p":2,"verdict":"nickname"},{"p":3,"verdict":"relative"},'
    '{"p":4,"verdict":"synonym"},{"p":5,"verdict":"broader_or_narrower"},{"p":6,"verdict":"misspelling"},'
    '{"p":7,"verdict":"relative"}]}'
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
        kinds: dict[int, Kind] = {pair.p: pair.verdict for pair in output.pairs}
        return ["same" if kinds.get(n) in SAME_KINDS else "different" for n in range(1, len(inputs) + 1)]
