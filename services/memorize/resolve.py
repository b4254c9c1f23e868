"""After extraction: is a new fact already known, or does it make a known one no longer true?

Candidates are found per fact by memorize (the valid theses with the same subject and relation but another
object), never shown to the extractor. Only when a fact has candidates is the model asked, once per batch, a flat
question per pair: ``compatible`` (both hold), ``updates`` (the known one stopped being true: a new job, home,
plan) or ``same`` (nothing new: the known thesis gains this message as a source). The schema fixes one verdict
per pair.

Scripted-LLM contract (task name ``resolve``): ``{"pairs": [{"p": 1, "verdict": "same|updates|compatible"}]}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.llm.task import LLMTask, numbered_pairs_schema
from services.ports import LLMMessage

Verdict = Literal["same", "updates", "compatible"]


class PairOut(BaseModel):
    model_config = ConfigDict(extra="ignore")

    p: int = Field(ge=1)
    verdict: Verdict


class ResolveOut(BaseModel):
    model_config = ConfigDict(extra="ignore")

    pairs: list[PairOut]


@dataclass(frozen=True)
class Pair:
    new: str
    new_time: datetime
    known: str
    known_time: datetime | None


SYSTEM = """You keep a memory up to date. For each numbered pair, compare the NEW statement with the KNOWN one \
about the same person and answer with one verdict: "compatible" if both can be true together (most pairs); \
"updates" only if NEW shows that KNOWN is no longer true (a changed job, home, relationship or plan); \
"same" if NEW says nothing that KNOWN does not already say. Output JSON only."""

EXAMPLE_IN = """[1] NEW (2023-06-02): Anna visited Rome.
    KNOWN (2023-05-01): Anna visited Paris.
[2] NEW (2023-06-02): Anna works at St. Mary's hospital.
    KNOWN (2023-05-01): Anna works at Siemens.
[3] NEW (2023-06-02): Anna likes tennis.
    KNOWN (2023-05-01): Anna likes hiking.
[4] NEW (2023-06-02): Anna lives in Munich.
    KNOWN (2023-05-01): Anna lives in Munich, Germany."""

EXAMPLE_OUT = (
    '{"pairs":[{"p":1,"verdict":"compatible"},{"p":2,"verdict":"updates"},{"p":3,"verdict":"compatible"},'
    '{"p":4,"verdict":"same"}]}'
)


def _date(when: datetime | None) -> str:
    return when.date().isoformat() if when else "?"


class ResolveTask(LLMTask[ResolveOut, list[Verdict]]):
    name = "resolve"
    output_model = ResolveOut
    max_tokens = 512

    def messages(self, inputs: list[Pair]) -> list[LLMMessage]:
        lines = [
            f"[{n}] NEW ({_date(p.new_time)}): {p.new}\n    KNOWN ({_date(p.known_time)}): {p.known}"
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

    def postprocess(self, output: ResolveOut, inputs: list[Pair]) -> list[Verdict]:
        verdicts: dict[int, Verdict] = {pair.p: pair.verdict for pair in output.pairs}
        # a pair the model skipped keeps both statements: losing a true fact is worse than keeping an old one
        return [verdicts.get(n, "compatible") for n in range(1, len(inputs) + 1)]
