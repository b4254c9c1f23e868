"""After extraction: is a new fact already known, or does it make a known one no longer true?

Candidates are found per fact by memorize (the valid theses sharing an entity with it and stating the same
relation to another one, plus its nearest valid theses by meaning about the same entities), never shown to the
extractor. Only when a fact has candidates is the model asked, once per batch, a flat question per pair:
``compatible`` (both hold), ``updates`` (the known one stopped being true: a new job, home, plan) or ``same``
(nothing new: the known thesis gains this message as a source); for a KNOWN prediction also ``confirms`` /
``refutes`` (it came true, or did not). The schema fixes one verdict per pair, from those its pair allows. What
a verdict does is decided in code from the labels of both theses (``services.memorize.labels``).

Scripted-LLM contract (task name ``resolve``): ``{"pairs": [{"p": 1, "verdict":
"same|updates|compatible|confirms|refutes"}]}``; a KNOWN prediction's line reads ``KNOWN (date, prediction): ``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.llm.task import LLMTask, OutT, T, numbered_pairs_schema
from services.ports import LLMMessage

Verdict = Literal["same", "updates", "compatible", "confirms", "refutes"]
PLAIN: tuple[Verdict, ...] = ("same", "updates", "compatible")
ON_PREDICTION: tuple[Verdict, ...] = (*PLAIN, "confirms", "refutes")


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
    #: the world time each is about (``builder.validity``), not when it was said
    new_time: datetime
    known: str
    known_time: datetime | None
    #: the known one is a PREDICTION: it may also be confirmed or refuted
    known_prediction: bool = False

    @property
    def allowed(self) -> tuple[Verdict, ...]:
        return ON_PREDICTION if self.known_prediction else PLAIN


SYSTEM = """You keep a memory up to date. For each numbered pair, compare the NEW statement with the KNOWN one \
about the same person and answer with one verdict: "compatible" if both can be true together (most pairs); \
"updates" only if NEW shows that KNOWN is no longer true (a changed job, home, relationship or plan); \
"same" if NEW says nothing that KNOWN does not already say. When KNOWN is a prediction, also "confirms" if NEW \
shows it came true, "refutes" if NEW shows it did not. Output JSON only."""

EXAMPLE_IN = """[1] NEW (2023-06-02): Anna visited Rome.
    KNOWN (2023-05-01): Anna visited Paris.
[2] NEW (2023-06-02): Anna works at St. Mary's hospital.
    KNOWN (2023-05-01): Anna works at Siemens.
[3] NEW (2023-06-02): Anna likes tennis.
    KNOWN (2023-05-01): Anna likes hiking.
[4] NEW (2023-06-02): Anna lives in Munich.
    KNOWN (2023-05-01): Anna lives in Munich, Germany.
[5] NEW (2023-06-02): Anna got the job at Siemens.
    KNOWN (2023-05-01, prediction): Anna will get the job at Siemens.
[6] NEW (2023-06-02): Anna's flight to Rome was cancelled.
    KNOWN (2023-05-01, prediction): Anna will fly to Rome in June."""

EXAMPLE_OUT = (
    '{"pairs":[{"p":1,"verdict":"compatible"},{"p":2,"verdict":"updates"},{"p":3,"verdict":"compatible"},'
    '{"p":4,"verdict":"same"},{"p":5,"verdict":"confirms"},{"p":6,"verdict":"refutes"}]}'
)


def _date(when: datetime | None) -> str:
    return when.date().isoformat() if when else "?"


def pair_lines(pairs: list[Pair]) -> str:
    """The numbered pairs as every pair-judging prompt shows them: each side with the world time it is about."""
    return "\n".join(
        f"[{n}] NEW ({_date(p.new_time)}): {p.new}\n"
        f"    KNOWN ({_date(p.known_time)}{', prediction' if p.known_prediction else ''}): {p.known}"
        for n, p in enumerate(pairs, start=1)
    )


class PairsTask(LLMTask[OutT, T]):
    """A task over numbered NEW/KNOWN pairs: its instruction, one worked example, then the pairs."""

    system: str
    example_in: str
    example_out: str

    def messages(self, inputs: list[Pair]) -> list[LLMMessage]:
        return [
            LLMMessage(role="system", content=self.system),
            LLMMessage(role="user", content=self.example_in),
            LLMMessage(role="assistant", content=self.example_out),
            LLMMessage(role="user", content=pair_lines(inputs)),
        ]


class ResolveTask(PairsTask[ResolveOut, list[Verdict]]):
    name = "resolve"
    output_model = ResolveOut
    max_tokens = 512
    system, example_in, example_out = SYSTEM, EXAMPLE_IN, EXAMPLE_OUT

    def json_schema(self, inputs: Any = None) -> dict[str, Any]:
        schema = self.output_model.model_json_schema()
        if not isinstance(inputs, list):
            return schema
        return numbered_pairs_schema(schema, len(inputs), [pair.allowed for pair in inputs])

    def postprocess(self, output: ResolveOut, inputs: list[Pair]) -> list[Verdict]:
        verdicts: dict[int, Verdict] = {pair.p: pair.verdict for pair in output.pairs}
        # a pair the model skipped, or gave a verdict its pair does not allow, keeps both statements: losing a
        # true fact is worse than keeping an old one
        found = [verdicts.get(n, "compatible") for n in range(1, len(inputs) + 1)]
        return [v if v in pair.allowed else "compatible" for v, pair in zip(found, inputs, strict=True)]
