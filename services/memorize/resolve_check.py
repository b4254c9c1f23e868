"""A second look at the pairs ``resolve`` judged to end or refute a known thesis, before anything is ended.

The default local model answers ``updates`` to pairs of compatible conversational facts ("Caroline is looking
forward to the painting" / "... to the challenges of being a single parent"): every invalidation it made on LoCoMo
that was inspected was wrong (docs/benchmarks.md, "Temporal memory on LoCoMo"), and on a labelled probe it gave
the same answer to every pair, compatible or not (``benchmarks/resolve_probe.py``). So a verdict that ends or
refutes a known thesis is asked again the other way round (could one person say both, about the same time?), with
two control pairs whose answers are known: one that holds together (first) and one that does not (last). The
check counts only when the model gets both controls right in that very call; a model that answers every pair alike
fails one of them. Only a pair the trusted check says cannot both hold is acted on; otherwise both are kept, as for
any pair the model did not judge.

It is asked once per batch, and only in a batch where ``resolve`` found such a pair: calls per message barely grow.

Scripted-LLM contract (task name ``resolve_check``): ``{"pairs": [{"p": 1, "verdict": "both_true|not_both"}]}``,
one entry per pair shown, the controls included (``CONTROL_HOLDS`` first, ``CONTROL_ENDS`` last).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.llm.task import numbered_pairs_schema
from services.memorize.resolve import Pair, PairsTask
from services.ports import LLMMessage

Check = Literal["both_true", "not_both"]


class PairOut(BaseModel):
    model_config = ConfigDict(extra="ignore")

    p: int = Field(ge=1)
    verdict: Check


class CheckOut(BaseModel):
    model_config = ConfigDict(extra="ignore")

    pairs: list[PairOut]


SYSTEM = """For each numbered pair: could one person truthfully say both statements, about the same time? \
Answer "both_true" when both can hold together: different trips, events, hobbies, feelings, plans, people or \
things looked forward to all fit together. Answer "not_both" only when one rules the other out: a new job \
instead of the old one, a new home, a relationship that ended, a number that changed, a plan that did not \
happen. Output JSON only."""

EXAMPLE_IN = """[1] NEW (2023-06-02): Anna is looking forward to the concert.
    KNOWN (2023-05-01): Anna is looking forward to her vacation.
[2] NEW (2023-06-02): Anna works at St. Mary's hospital.
    KNOWN (2023-05-01): Anna works at Siemens.
[3] NEW (2023-06-02): Anna went to a pottery class.
    KNOWN (2023-05-01): Anna is interested in painting.
[4] NEW (2023-06-02): Anna broke up with Tom.
    KNOWN (2023-05-01): Anna is dating Tom.
[5] NEW (2023-06-02): Anna feels proud of her son.
    KNOWN (2023-05-01): Anna feels worried about her son.
[6] NEW (2023-06-02): Anna's trip to Rome was cancelled.
    KNOWN (2023-05-01, prediction): Anna will fly to Rome in June."""

EXAMPLE_OUT = (
    '{"pairs":[{"p":1,"verdict":"both_true"},{"p":2,"verdict":"not_both"},{"p":3,"verdict":"both_true"},'
    '{"p":4,"verdict":"not_both"},{"p":5,"verdict":"both_true"},{"p":6,"verdict":"not_both"}]}'
)


_CONTROL_TIME = datetime(2023, 1, 9, tzinfo=UTC)
#: the control pairs, about a person of their own; their statements appear in no example
CONTROL_HOLDS = Pair(
    "Robin is looking forward to the jazz festival.",
    _CONTROL_TIME + timedelta(days=30),
    "Robin is looking forward to visiting her grandparents.",
    _CONTROL_TIME,
)
CONTROL_ENDS = Pair(
    "Robin moved to Leeds.", _CONTROL_TIME + timedelta(days=30), "Robin lives in Glasgow.", _CONTROL_TIME
)


@dataclass(frozen=True)
class Checked:
    """Per pair asked about: True when the two cannot both hold; ``trusted`` False when a control was answered
    wrong, and then no pair counts."""

    not_both: list[bool]
    trusted: bool


class CheckTask(PairsTask[CheckOut, Checked]):
    """The pairs asked about, between the two controls."""

    name = "resolve_check"
    output_model = CheckOut
    max_tokens = 512
    system, example_in, example_out = SYSTEM, EXAMPLE_IN, EXAMPLE_OUT

    def messages(self, inputs: list[Pair]) -> list[LLMMessage]:
        return super().messages(_with_controls(inputs))

    def json_schema(self, inputs: Any = None) -> dict[str, Any]:
        schema = self.output_model.model_json_schema()
        return numbered_pairs_schema(schema, len(inputs) + 2) if isinstance(inputs, list) else schema

    def postprocess(self, output: CheckOut, inputs: list[Pair]) -> Checked:
        verdicts = {pair.p: pair.verdict for pair in output.pairs}
        # a skipped pair keeps both statements, as everywhere in resolution
        answered = [verdicts.get(n) == "not_both" for n in range(1, len(inputs) + 3)]
        trusted = not answered[0] and answered[-1]
        return Checked(answered[1:-1], trusted)


def _with_controls(pairs: list[Pair]) -> list[Pair]:
    return [CONTROL_HOLDS, *pairs, CONTROL_ENDS]
