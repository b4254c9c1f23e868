"""The extraction task: theses, triples and labels for a micro-batch of one user's messages, in ONE LLM call.

Scripted-LLM contract (task name ``extract``): the reply is a JSON object
``{"messages": [{"message": 1, "theses": [{"text", "entities", "kind", "temporal", "replaces"}],
"triples": [{"subject", "relation", "object"}]}]}`` where ``message`` is the 1-based number of the input item
and ``replaces`` lists refs ("K1", ...) of the known theses the new one contradicts.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from services.llm.task import LLMTask, TaskOutputError
from services.ports import LLMMessage

Short = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1, max_length=120)]


class ThesisOut(BaseModel):
    model_config = ConfigDict(extra="ignore")

    text: Annotated[str, StringConstraints(strip_whitespace=True, min_length=3, max_length=400)]
    entities: list[Short] = Field(default_factory=list, max_length=12)
    kind: Literal["FACT", "OPINION", "PREDICTION"] = "FACT"
    temporal: Literal["STATIC", "DYNAMIC", "ATEMPORAL"] = "DYNAMIC"
    replaces: list[Annotated[str, StringConstraints(pattern=r"^K\d+$")]] = Field(default_factory=list, max_length=8)


class TripleOut(BaseModel):
    model_config = ConfigDict(extra="ignore")

    subject: Short
    relation: Short
    object: Short


class MessageOut(BaseModel):
    model_config = ConfigDict(extra="ignore")

    message: int = Field(ge=1)
    theses: list[ThesisOut] = Field(default_factory=list, max_length=16)
    triples: list[TripleOut] = Field(default_factory=list, max_length=24)


class ExtractionOut(BaseModel):
    model_config = ConfigDict(extra="ignore")

    messages: list[MessageOut]


@dataclass(frozen=True)
class Item:
    """One message or document chunk to extract from."""

    speaker: str | None
    text: str
    time: datetime


@dataclass(frozen=True)
class KnownThesis:
    ref: str
    text: str
    time: datetime | None


@dataclass(frozen=True)
class ExtractionInput:
    items: list[Item]
    known: list[KnownThesis]


SYSTEM = """You turn chat messages into a memory graph. For EACH numbered message output:
- theses: short self-contained statements of what the message says. "I" is the SPEAKER of that message,
  "you" the other person: write their names. Keep dates and numbers. Each thesis has its entities (people,
  places, things, events named in it), kind FACT|OPINION|PREDICTION, temporal STATIC (never changes) |
  DYNAMIC (may change later) | ATEMPORAL (general truth), and replaces: refs of KNOWN statements this one
  makes no longer true (a change of job, home, plan, status...), else [].
- triples: subject | relation | object facts, each part at most 7 words, relation in plain words.
Use only what the messages say. Greetings or chit-chat get empty lists. Output JSON only."""

EXAMPLE_IN = """KNOWN:
K1: [2023-05-01] Anna works at Siemens.
MESSAGES:
1. [2023-06-02] Anna: I quit Siemens last week, now I'm a nurse at St. Mary's hospital!
2. [2023-06-02] Ben: Wow, congrats! I'm still at Bosch in Stuttgart.
3. [2023-06-02] Anna: How are you?"""

EXAMPLE_OUT = (
    '{"messages":[{"message":1,"theses":[{"text":"Anna quit her job at Siemens in late May 2023.",'
    '"entities":["Anna","Siemens"],"kind":"FACT","temporal":"STATIC","replaces":["K1"]},'
    '{"text":"Anna works as a nurse at St. Mary\'s hospital.","entities":["Anna","St. Mary\'s hospital"],'
    '"kind":"FACT","temporal":"DYNAMIC","replaces":["K1"]}],"triples":[{"subject":"Anna","relation":"quit",'
    '"object":"Siemens"},{"subject":"Anna","relation":"works as","object":"nurse"},{"subject":"Anna",'
    '"relation":"works at","object":"St. Mary\'s hospital"}]},'
    '{"message":2,"theses":[{"text":"Ben works at Bosch in Stuttgart.","entities":["Ben","Bosch","Stuttgart"],'
    '"kind":"FACT","temporal":"DYNAMIC","replaces":[]}],"triples":[{"subject":"Ben","relation":"works at",'
    '"object":"Bosch"},{"subject":"Bosch","relation":"located in","object":"Stuttgart"}]},'
    '{"message":3,"theses":[],"triples":[]}]}'
)


def render_items(data: ExtractionInput) -> str:
    known = "\n".join(f"{k.ref}: [{k.time.date().isoformat() if k.time else '?'}] {k.text}" for k in data.known)
    lines = []
    for n, item in enumerate(data.items, start=1):
        who = f"{item.speaker}: " if item.speaker else ""
        lines.append(f"{n}. [{item.time.date().isoformat()}] {who}{item.text}")
    return f"KNOWN:\n{known or '(none)'}\nMESSAGES:\n" + "\n".join(lines)


class ExtractTask(LLMTask[ExtractionOut, ExtractionOut]):
    name = "extract"
    output_model = ExtractionOut
    max_tokens = 1500

    def messages(self, inputs: ExtractionInput) -> list[LLMMessage]:
        return [
            LLMMessage(role="system", content=SYSTEM),
            LLMMessage(role="user", content=EXAMPLE_IN),
            LLMMessage(role="assistant", content=EXAMPLE_OUT),
            LLMMessage(role="user", content=render_items(inputs)),
        ]

    def postprocess(self, output: ExtractionOut, inputs: ExtractionInput) -> ExtractionOut:
        count = len(inputs.items)
        bad = sorted({m.message for m in output.messages if m.message > count})
        if bad:
            raise TaskOutputError(f"message numbers {bad} do not exist (there are {count} messages)")
        known = {k.ref for k in inputs.known}
        for message in output.messages:
            for thesis in message.theses:
                # a ref to a statement that was not shown cannot be trusted: drop it, keep the thesis
                thesis.replaces = [r for r in thesis.replaces if r in known]
        return output
