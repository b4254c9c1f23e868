"""A second look at the pairs ``resolve`` judged to end or refute a known thesis, before anything is ended.

The default local model answers ``updates`` to pairs of compatible conversational facts ("Caroline is looking
forward to the painting" / "... to the challenges of being a single parent"): every invalidation it made on LoCoMo
that was inspected was wrong (docs/benchmarks.md, "Temporal memory on LoCoMo"). Asked the other way round, per
pair, whether one person could say both about the same time, it separates the two kinds far better ("Contradiction
check" in the same document). So a verdict that ends, refutes or marks a known thesis is acted on only when this
check also says the two cannot both hold; otherwise both are kept, as for any pair the model did not judge.

It is asked once per batch, and only in a batch where ``resolve`` found such a pair (rare): calls per message
barely grow.

Scripted-LLM contract (task name ``resolve_check``): ``{"pairs": [{"p": 1, "verdict": "both_true|not_both"}]}``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.llm.task import numbered_pairs_schema
from services.memorize.resolve import Pair, PairsTask

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


class CheckTask(PairsTask[CheckOut, list[bool]]):
    """Per pair: True when the two cannot both hold (the verdict that ends or refutes one stands)."""

    name = "resolve_check"
    output_model = CheckOut
    max_tokens = 512
    system, example_in, example_out = SYSTEM, EXAMPLE_IN, EXAMPLE_OUT

    def json_schema(self, inputs: Any = None) -> dict[str, Any]:
        schema = self.output_model.model_json_schema()
        return numbered_pairs_schema(schema, len(inputs)) if isinstance(inputs, list) else schema

    def postprocess(self, output: CheckOut, inputs: list[Pair]) -> list[bool]:
        verdicts = {pair.p: pair.verdict for pair in output.pairs}
        # a skipped pair keeps both statements, as everywhere in resolution
        return [verdicts.get(n) == "not_both" for n in range(1, len(inputs) + 1)]
