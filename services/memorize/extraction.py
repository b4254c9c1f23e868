"""The extraction task: the facts worth remembering in a micro-batch of one user's messages, in ONE LLM call.

Designed for a small local model (measured in docs/benchmarks.md, "Extraction"):
- the input makes speaker and date explicit before every message ("[2] Ben, Friday 2 June 2023: ...");
- the output is flat and small: per message a short list of facts, each one sentence with its subject, one
  relation to one object, and the message's own time words ("last week") — never a computed date;
- the schema is made per call: one entry per message, in order, with its number fixed, so decoding cannot skip,
  repeat or invent a message; every list and string is bounded, so decoding cannot loop; no regex patterns;
- nothing known is shown to the model (it copied known statements instead of extracting new ones):
  duplicates and contradictions are checked after extraction (``services.memorize.resolve``);
- what a small model gets wrong is checked in code (``services.memorize.attribution``): pronouns, misattributed
  first-person facts, facts with no ground in the message; time words become dates in ``services.memorize.when``.

Scripted-LLM contract (task name ``extract``): ``{"messages": [{"m": 1, "facts": [{"subject", "fact",
"relation", "object", "when", "kind", "temporal"}]}]}``, one entry per input message, ``m`` its 1-based number.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from services import ids, metrics
from services.llm.scope import held_slot
from services.llm.task import LLMTask, TaskOutputError, load_json_object, run_task
from services.memorize import compact, lines, repeats
from services.memorize.attribution import MIN_GROUNDING, Speakers, check_fact, grounding
from services.memorize.chunking import sentences
from services.memorize.facts import Alias, ExtractionInput, Fact, Item, ItemFacts
from services.memorize.when import When, resolve, sounds_future, time_words

__all__ = ["Alias", "ExtractTask", "ExtractionInput", "Fact", "Item", "ItemFacts"]
from services.ports import LLM, LLMMessage, StopRule
from services.settings import Settings

MAX_FACTS_PER_MESSAGE = 3
#: "compact": positional facts, subject and relation derived in code (the default; ``services.memorize.compact``);
#: "json": the keyed JSON of every field (the design before 4 December, kept to compare); "lines": the compact
#: fields as text lines under a GBNF grammar (llama.cpp only; ``services.memorize.lines``)
OUTPUTS = ("compact", "json", "lines")


def _text(max_length: int, min_length: int = 0) -> Any:
    return Annotated[str, StringConstraints(strip_whitespace=True, min_length=min_length, max_length=max_length)]


class FactOut(BaseModel):
    model_config = ConfigDict(extra="ignore")

    subject: _text(compact.MAX_SUBJECT, 1)  # type: ignore[valid-type]
    fact: _text(compact.MAX_FACT, 8)  # type: ignore[valid-type]
    relation: _text(40)  # type: ignore[valid-type]
    object: _text(60)  # type: ignore[valid-type]
    when: _text(40) = ""  # type: ignore[valid-type]
    kind: Literal["FACT", "OPINION", "PREDICTION"] = "FACT"
    temporal: Literal["STATIC", "DYNAMIC", "ATEMPORAL"] = "DYNAMIC"


class MessageFactsOut(BaseModel):
    model_config = ConfigDict(extra="ignore")

    m: int = Field(ge=1)
    speaker: str = ""
    starts: str = ""
    facts: list[FactOut] = Field(default_factory=list, max_length=MAX_FACTS_PER_MESSAGE)


class ExtractionOut(BaseModel):
    model_config = ConfigDict(extra="ignore")

    messages: list[MessageFactsOut]


SYSTEM = """You keep a long-term memory of what people tell each other. For EACH numbered message list the facts \
worth remembering about people: what they did, do, plan, own, like, feel or think, with names, places, dates and \
numbers. A fact is one short sentence that makes sense alone: use names, never "I", "you", "he" or "she". The \
speaker is named before each message: "I", "me" and "my" mean the speaker, "you" the person they talk to. A photo \
the speaker shares is part of their message. A message that only greets, thanks, asks or compliments has no \
facts: give it an empty list; one that opens so and then tells something has the facts it tells. Each fact \
has: subject (the person it is about), fact, relation and object (the fact as subject - relation - object, \
the object a person, place, thing or activity named in the message), when (the words \
of the message that say when it happened, such as "yesterday" or "last year", else ""), kind (FACT, OPINION, or \
PREDICTION for a plan or expectation) and temporal (STATIC: never changes, DYNAMIC: may change, ATEMPORAL: \
always true). Output JSON only."""

EXAMPLE_IN = """Conversation between Anna and Ben.
[1] Anna, Friday 2 June 2023: Hi Ben! How was your week?
[2] Ben, Friday 2 June 2023: Busy! I started a pottery class on Monday, I love it. [shares a photo: a clay bowl]
[3] Anna, Friday 2 June 2023: Wow, that bowl is great! What else do you make there?
[4] Anna, Friday 2 June 2023: Big news: I quit Siemens last week, now I'm a nurse at St. Mary's!
[5] Ben, Friday 2 June 2023: Congrats, you'll be amazing at it! I'm off to Rome tomorrow for my sister's wedding."""

EXAMPLE_OUT = (
    '{"messages":[{"m":1,"speaker":"Anna","starts":"Hi Ben! How was your","facts":[]},'
    '{"m":2,"speaker":"Ben","starts":"Busy! I started a pottery","facts":['
    '{"subject":"Ben","fact":"Ben started a pottery class and loves it.","relation":"started","object":"pottery class",'
    '"when":"on Monday","kind":"FACT","temporal":"DYNAMIC"},'
    '{"subject":"Ben","fact":"Ben made a clay bowl in his pottery class.","relation":"made","object":"clay bowl",'
    '"when":"","kind":"FACT","temporal":"STATIC"}]},'
    '{"m":3,"speaker":"Anna","starts":"Wow, that bowl is great!","facts":[]},'
    '{"m":4,"speaker":"Anna","starts":"Big news: I quit Siemens","facts":['
    '{"subject":"Anna","fact":"Anna quit her job at Siemens.","relation":"quit job at","object":"Siemens",'
    '"when":"last week","kind":"FACT","temporal":"STATIC"},'
    '{"subject":"Anna","fact":"Anna works as a nurse at St. Mary\'s.","relation":"works at","object":"St. Mary\'s",'
    '"when":"","kind":"FACT","temporal":"DYNAMIC"}]},'
    '{"m":5,"speaker":"Ben","starts":"I\'m off to Rome tomorrow","facts":['
    '{"subject":"Ben","fact":"Ben is going to Rome for his sister\'s wedding.","relation":"going to","object":"Rome",'
    '"when":"tomorrow","kind":"PREDICTION","temporal":"DYNAMIC"}]}]}'
)


#: The compact output ("compact", the default): no field the code can read off the sentence. Per message
#: {"m": label, "facts": [...]}: the label "[n] Speaker: opening words" is fixed by the grammar (it puts the model's
#: attention on that message, see ``_opening``); each fact is {fact, object, when, kind, temporal}. The subject is
#: the name the sentence starts with and the relation the words between subject and object
#: (``services.memorize.compact``). Positional lists without keys were tried first: the 1.5B model then gave most
#: messages an empty list (docs/benchmarks.md, "Model time").
SYSTEM_COMPACT = """You keep a long-term memory of what people tell each other. For EACH numbered message list \
the facts worth remembering about people: what they did, do, plan, own, like, feel or think, with names, places, \
dates and numbers. A fact is one short sentence that starts with the name of the person it is about and makes \
sense alone: never "I", "you", "he" or "she". The speaker is named before each message: "I", "me" and "my" mean \
the speaker, "you" the person they talk to. A photo the speaker shares is part of their message. A message that \
only greets, thanks, asks or compliments has no facts: give it an empty list; one that opens so and then tells \
something has the facts it tells. Each fact has: fact (the sentence), object (the person, place, thing or \
activity of the sentence the fact is about, in the sentence's words), when (the words of the message that say \
when it happened, such as "yesterday" or "last year", else ""), kind (FACT, OPINION, or PREDICTION for a plan or \
expectation) and temporal (STATIC: never changes, DYNAMIC: may change, ATEMPORAL: always true). Output JSON only."""

EXAMPLE_OUT_COMPACT = (
    '{"messages":[{"m":"[1] Anna: Hi Ben! How was your","facts":[]},'
    '{"m":"[2] Ben: Busy! I started a pottery","facts":['
    '{"fact":"Ben started a pottery class and loves it.","object":"pottery class","when":"on Monday",'
    '"kind":"FACT","temporal":"DYNAMIC"},'
    '{"fact":"Ben made a clay bowl in his pottery class.","object":"clay bowl","when":"","kind":"FACT",'
    '"temporal":"STATIC"}]},'
    '{"m":"[3] Anna: Wow, that bowl is great!","facts":[]},'
    '{"m":"[4] Anna: Big news: I quit Siemens","facts":['
    '{"fact":"Anna quit her job at Siemens.","object":"Siemens","when":"last week","kind":"FACT","temporal":"STATIC"},'
    '{"fact":"Anna works as a nurse at St. Mary\'s.","object":"St. Mary\'s","when":"","kind":"FACT",'
    '"temporal":"DYNAMIC"}]},'
    '{"m":"[5] Ben: I\'m off to Rome tomorrow","facts":['
    '{"fact":"Ben is going to Rome for his sister\'s wedding.","object":"Rome","when":"tomorrow",'
    '"kind":"PREDICTION","temporal":"DYNAMIC"}]}]}'
)


#: The compact output with ``when`` and ``kind`` left out where they are "" and FACT (``compact.fact_schema``).
SYSTEM_LEAN = SYSTEM_COMPACT.replace(
    'when (the words of the message that say when it happened, such as "yesterday" or "last year", else ""), kind '
    "(FACT, OPINION, or PREDICTION for a plan or expectation) and temporal (STATIC: never changes, DYNAMIC: may "
    "change, ATEMPORAL: always true).",
    "temporal (STATIC: never changes, DYNAMIC: may change, ATEMPORAL: always true), then only where the message "
    'says it: when (the words of the message that say when it happened, such as "yesterday" or "last year") and '
    "kind (OPINION, or PREDICTION for a plan or expectation; a plain fact has no kind).",
)

EXAMPLE_OUT_LEAN = (
    '{"messages":[{"m":"[1] Anna: Hi Ben! How was your","facts":[]},'
    '{"m":"[2] Ben: Busy! I started a pottery","facts":['
    '{"fact":"Ben started a pottery class and loves it.","object":"pottery class","temporal":"DYNAMIC",'
    '"when":"on Monday"},'
    '{"fact":"Ben made a clay bowl in his pottery class.","object":"clay bowl","temporal":"STATIC"}]},'
    '{"m":"[3] Anna: Wow, that bowl is great!","facts":[]},'
    '{"m":"[4] Anna: Big news: I quit Siemens","facts":['
    '{"fact":"Anna quit her job at Siemens.","object":"Siemens","temporal":"STATIC","when":"last week"},'
    '{"fact":"Anna works as a nurse at St. Mary\'s.","object":"St. Mary\'s","temporal":"DYNAMIC"}]},'
    '{"m":"[5] Ben: I\'m off to Rome tomorrow","facts":['
    '{"fact":"Ben is going to Rome for his sister\'s wedding.","object":"Rome","temporal":"DYNAMIC",'
    '"when":"tomorrow","kind":"PREDICTION"}]}]}'
)


def _who(item: Item) -> str:
    return ("document" if item.document else item.speaker) or "someone"


#: a short leading greeting, thanks, exclamation or question that says nothing of the speaker ("Thanks, Mel!",
#: "Wow, that's cool!", "How are you?") is passed over by a message's opening words
_OPENER_WORDS = 6
_PLEASANTRY = re.compile(
    r"^(?:hey|hi|hello|thanks|thank|wow|whoa|yeah|yep|yes|yay|oh|aw+|congrats|congratulations|good|great|nice|cool|"
    r"awesome|amazing|totally|sure|ok|okay|haha|lol|omg|sorry|no|hmm|that's|so)\b",
    re.IGNORECASE,
)
_FIRST_PERSON = re.compile(r"\b(?:i|i'm|i've|i'll|i'd|me|my|we|our)\b", re.IGNORECASE)
_SECOND_PERSON = re.compile(r"\b(?:you|you're|you've|you'll|you'd|your|yours)\b", re.IGNORECASE)


def _tells_nothing_of_the_speaker(sentence: str) -> bool:
    """A question, a short greeting or thanks ("Thanks, Mel!", "Wow, that's cool!"), or a remark on the person
    spoken to ("Sorry about your job Jon, but starting your own business sounds awesome!")."""
    if sentence.rstrip().endswith("?"):
        return True
    if _FIRST_PERSON.search(sentence):
        return False
    greeting = len(sentence.split()) <= _OPENER_WORDS and _PLEASANTRY.match(sentence) is not None
    return greeting or _SECOND_PERSON.search(sentence) is not None


def _opening(text: str, words: int = 5) -> str:
    """The first words of the message's first sentence that tells something. The grammar makes the model write
    them before the message's facts, and a small model lists what follows them: given "Thanks, Melanie! That's"
    or "Sorry about your job Jon, but" it lists nothing for a message that goes on to tell its news ("I also lost
    my job at Door Dash this month")."""
    flat = " ".join(text.split())
    rest = flat
    for sentence in sentences(flat):
        if not _tells_nothing_of_the_speaker(sentence):
            break
        rest = rest[len(sentence) :].lstrip()
    return " ".join((rest or flat).split()[:words]).replace("\\", "")


def _labels(inputs: ExtractionInput) -> list[str]:
    """Each message's label in the compact output: "[2] Ben: Busy! I started a pottery"."""
    return [f"[{n}] {_who(item)}: {_opening(item.text)}" for n, item in enumerate(inputs.items, start=1)]


def _day(when: datetime) -> str:
    return f"{when:%A} {when.day} {when:%B %Y}"


def render_items(data: ExtractionInput) -> str:
    lines = []
    speakers = sorted({i.speaker for i in data.items if i.speaker and not i.document} | set(data.participants))
    if speakers:
        lines.append(f"Conversation between {' and '.join(speakers)}." if len(speakers) > 1 else "")
    for n, item in enumerate(data.items, start=1):
        if item.document:
            title = f'document "{item.speaker}", ' if item.speaker else "document, "
            lines.append(f"[{n}] {title}{_day(item.time)}: {item.text}")
        else:
            lines.append(f"[{n}] {item.speaker or 'someone'}, {_day(item.time)}: {item.text}")
    return "\n".join(line for line in lines if line)


def _when(words: str, fact: FactOut, subject: str, item: Item, speakers: Speakers) -> tuple[When | None, str]:
    """When the fact happened: from the time words the model copied, else from the message's one time phrase
    (a small model often leaves ``when`` empty); either only if the fact comes from the clause those words date.
    Second: the model's words, when the message says them and they date this fact but name no time the resolver
    can place ("since I was 12"): kept with the fact so nothing said is lost."""
    phrases = time_words(item.text)
    if words and words.casefold() in item.text.casefold():
        # the model's words, dated by their own clause if they are a phrase we know, else by the message
        phrases = [(p, c) for p, c in phrases if p.casefold() == words.casefold()] or [(words, item.text)]
    if len(phrases) != 1:
        return None, ""
    phrase, context = phrases[0]
    if grounding(fact.fact, subject, context, speakers) < MIN_GROUNDING:
        return None, ""
    when = resolve(phrase, item.time, future=fact.kind == "PREDICTION" or sounds_future(context))
    return when, " ".join(phrase.split()) if when is None else ""


class ExtractTask(LLMTask[ExtractionOut, list[ItemFacts]]):
    name = "extract"
    output_model = ExtractionOut
    #: per message at most 4 facts of ~60 tokens; the schema bounds every string, so this limit is never the stop
    max_tokens = 2048

    def __init__(
        self, *, example: bool = True, output: str = "compact", stop_repeats: bool = True, lean: bool = False
    ) -> None:
        if output not in OUTPUTS:
            raise ValueError(f"unknown extraction output {output!r}; known: {OUTPUTS}")
        self.example = example
        self.output = output
        #: the compact output with its default fields left out (``compact.fact_schema``)
        self.lean = lean and output == "compact"
        #: stop a call at a fact it already wrote (``services.memorize.repeats``; the compact output's shapes)
        self.stops_repeats = stop_repeats and output == "compact"

    @classmethod
    def from_settings(cls, settings: Settings, **overrides: Any) -> ExtractTask:
        """The task the settings describe (output design, repeats stopped, lean fields); ``overrides`` win."""
        options: dict[str, Any] = {
            "output": settings.extraction_output,
            "stop_repeats": settings.extraction_stop_repeats,
            "lean": settings.extraction_lean,
        }
        return cls(**(options | overrides))

    def stop_rule(self, inputs: ExtractionInput) -> StopRule | None:
        return repeats.RepeatStop(inputs.said) if self.stops_repeats else None

    def messages(self, inputs: ExtractionInput) -> list[LLMMessage]:
        system, example = {
            "compact": (SYSTEM_LEAN, EXAMPLE_OUT_LEAN) if self.lean else (SYSTEM_COMPACT, EXAMPLE_OUT_COMPACT),
            "json": (SYSTEM, EXAMPLE_OUT),
            "lines": (lines.SYSTEM_LINES, lines.EXAMPLE_OUT_LINES),
        }[self.output]
        shots = (
            [LLMMessage(role="user", content=EXAMPLE_IN), LLMMessage(role="assistant", content=example)]
            if self.example
            else []
        )
        # The instructions and the worked example come first and never change: the engine keeps them in its KV
        # cache between calls, so a call reads only its own messages.
        return [
            LLMMessage(role="system", content=system),
            *shots,
            LLMMessage(role="user", content=render_items(inputs)),
        ]

    def json_schema(self, inputs: Any = None) -> dict[str, Any]:
        """One entry per input message, numbered in order: the grammar forbids skipping or inventing one."""
        schema = self.output_model.model_json_schema()
        if not isinstance(inputs, ExtractionInput):
            return schema
        if self.output in ("compact", "lines"):
            return compact.output_schema(_labels(inputs)[inputs.start :], MAX_FACTS_PER_MESSAGE, self.lean)
        entry = schema["$defs"]["MessageFactsOut"]
        count = len(inputs.items)
        # Each entry opens with the message's speaker and first words, fixed by the grammar: writing them puts the
        # model's attention on that message right before its facts (without them a small model shifts facts to
        # the wrong message).
        numbered = [
            {
                **entry,
                "properties": {
                    **entry["properties"],
                    "m": {"const": n},
                    "speaker": {"const": _who(item)},
                    "starts": {"const": _opening(item.text)},
                },
                "required": ["m", "speaker", "starts", "facts"],
            }
            for n, item in enumerate(inputs.items, start=1)
        ]
        messages = {"type": "array", "prefixItems": numbered, "minItems": count, "maxItems": count}
        return {**schema, "properties": {"messages": messages}, "required": ["messages"]}

    def grammar(self, inputs: Any = None) -> str | None:
        if self.output != "lines" or not isinstance(inputs, ExtractionInput):
            return None
        return lines.grammar(_labels(inputs), MAX_FACTS_PER_MESSAGE)

    def parse(self, text: str, inputs: Any) -> list[ItemFacts]:
        if self.output == "json" or not isinstance(inputs, ExtractionInput):
            return super().parse(text, inputs)
        if self.output == "lines" and lines.is_lines(text):
            data: Any = lines.to_compact(text, _labels(inputs))
        else:
            data = load_json_object(repeats.before_repeat(text, inputs.said) if self.stops_repeats else text)
        if not compact.is_compact(data):
            # the keyed shape is read in either mode: scripted replies and outputs cached before the compact one
            return super().parse(text, inputs)
        keyed = compact.to_keyed(data, _labels(inputs), Speakers.of(inputs))
        return super().parse(json.dumps(keyed), inputs)

    def postprocess(self, output: ExtractionOut, inputs: ExtractionInput) -> list[ItemFacts]:
        count = len(inputs.items)
        bad = sorted({m.m for m in output.messages if m.m > count})
        if bad:
            raise TaskOutputError(f"message numbers {bad} do not exist (there are {count} messages)")
        by_number: dict[int, list[FactOut]] = {}
        for entry in output.messages:
            by_number.setdefault(entry.m, []).extend(entry.facts)
        speakers = Speakers.of(inputs)
        results = [ItemFacts(answered=n in by_number) for n in range(1, count + 1)]
        for n in range(1, count + 1):
            for raw in by_number.get(n, [])[:MAX_FACTS_PER_MESSAGE]:
                # a small model sometimes writes a fact under a neighbouring message: it belongs to the message
                # that says it (and that message's speaker decides who "I" is)
                target = self._home(raw, inputs, speakers, n)
                checked = check_fact(
                    raw.subject, raw.fact, raw.relation, raw.object, inputs.items[target - 1], speakers
                )
                if isinstance(checked, str):
                    results[n - 1].dropped.append(checked)
                    continue
                subject, text, obj = checked
                source = inputs.items[target - 1]
                if any(ids.normalize_text(f.text) == ids.normalize_text(text) for f in results[target - 1].facts):
                    continue
                when, unresolved = _when(raw.when, raw, subject, source, speakers)
                results[target - 1].facts.append(
                    Fact(
                        subject,
                        text,
                        raw.relation,
                        obj,
                        raw.kind,
                        raw.temporal,
                        when,
                        unresolved,
                        cut=compact.was_cut(raw.fact),
                    )
                )
        return results

    @staticmethod
    def _home(raw: FactOut, inputs: ExtractionInput, speakers: Speakers, n: int) -> int:
        """The message of the batch that says ``raw``: its own (``n``), unless another grounds it and says at
        least twice as much of it ("Lost my job as a banker" written under the reply "Sorry about your job")."""
        own = grounding(raw.fact, raw.subject, inputs.items[n - 1].text, speakers)
        share, best = max(
            ((grounding(raw.fact, raw.subject, item.text, speakers), m) for m, item in enumerate(inputs.items, 1)),
            key=lambda scored: (scored[0], scored[1] == n),
        )
        if best != n and share >= MIN_GROUNDING and (own < MIN_GROUNDING or share >= 2 * own):
            return best
        return n


async def extract_batch(
    llm: LLM, task: ExtractTask, data: ExtractionInput, *, attempts: int
) -> tuple[list[ItemFacts], int]:
    """A batch's facts, message by message, and the calls made: one extraction call, and while a call stopped at a
    fact it had already written, another from the first message left unanswered, with the same prompt (nothing
    read again) and the facts written so far named to it (``services.memorize.repeats``). Every call answers at
    least its first message, so there are at most as many calls as messages."""
    with held_slot():  # the calls that continue a stopped one find its prompt in the engine slot it used
        return await _extract_parts(llm, task, data, attempts)


async def _extract_parts(
    llm: LLM, task: ExtractTask, data: ExtractionInput, attempts: int
) -> tuple[list[ItemFacts], int]:
    found = [ItemFacts(answered=False) for _ in data.items]
    calls = 0
    part = data
    while True:
        result = await run_task(llm, task, part, attempts=attempts, stop_when=task.stop_rule(part))
        calls += result.calls
        for mine, new in zip(found, result.value, strict=True):
            _merge(mine, new)
        text = result.raw[-1]
        repeat = repeats.find(text, part.said) if task.stops_repeats else None
        if repeat is None:
            return found, calls  # a message the model skipped otherwise is the caller's to ask about again
        metrics.EXTRACTION_REPEATS.inc()
        unanswered = next((n for n in range(part.start, len(found)) if not found[n].answered), None)
        if unanswered is None:
            return found, calls
        written = repeats.facts_in(text[: repeat.fact_at])  # what the output kept (a cut entry had none before it)
        part = replace(data, start=unanswered, said=(*part.said, *written))


def _merge(mine: ItemFacts, new: ItemFacts) -> None:
    """``new``'s facts into ``mine`` (a fact a later call moved to an earlier message joins what it had)."""
    mine.answered = mine.answered or new.answered
    known = {ids.normalize_text(f.text) for f in mine.facts}
    mine.facts += [f for f in new.facts if ids.normalize_text(f.text) not in known]
    mine.dropped += new.dropped
