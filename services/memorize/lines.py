"""The line output of extraction: the compact design's fields, written as text lines under a grammar, not JSON.

Generated tokens are the cost of extraction on a CPU (docs/benchmarks.md, "Model time"). The compact JSON still
spends about 18 tokens a fact and 8 a message on keys, quotes and brackets; here a batch's output is

    [1] Anna: Hi Ben! How was your
    [2] Ben: Busy! I started a pottery
    - Ben started a pottery class and loves it. | pottery class | on Monday | FACT DYNAMIC

one label line per message (fixed by the grammar, as the compact design's ``m``: it puts the model's attention on
that message), then at most ``max_facts`` fact lines: sentence | object | time words | kind temporal. The grammar
(llama.cpp GBNF) makes every label come once, in order, and bounds every field, so decoding can neither skip a
message nor loop. The parser turns the text into the compact shape (``services.memorize.compact``), whose
subject and relation are then read off the sentence in code.
"""

from __future__ import annotations

from typing import Any

from services.memorize.compact import KINDS, MAX_FACT, TEMPORALS

SYSTEM_LINES = """You keep a long-term memory of what people tell each other. For EACH numbered message list the \
facts worth remembering about people: what they did, do, plan, own, like, feel or think, with names, places, dates \
and numbers. A fact is one short sentence that starts with the name of the person it is about and makes sense \
alone: never "I", "you", "he" or "she". The speaker is named before each message: "I", "me" and "my" mean the \
speaker, "you" the person they talk to. A photo the speaker shares is part of their message. A message that only \
greets, thanks, asks or compliments has no facts: write no fact line under it; one that opens so and then tells \
something has the facts it tells. Write each message's line, then one line per fact: "- " then the sentence | the \
object (the person, place, thing or activity of the sentence the fact is about, in the sentence's words) | when \
(the words of the message that say when it happened, such as "yesterday" or "last year", else nothing) | kind \
(FACT, OPINION, or PREDICTION for a plan or expectation) and temporal (STATIC: never changes, DYNAMIC: may change, \
ATEMPORAL: always true)."""

EXAMPLE_OUT_LINES = """[1] Anna: Hi Ben! How was your
[2] Ben: Busy! I started a pottery
- Ben started a pottery class and loves it. | pottery class | on Monday | FACT DYNAMIC
- Ben made a clay bowl in his pottery class. | clay bowl | | FACT STATIC
[3] Anna: Wow, that bowl is great!
[4] Anna: Big news: I quit Siemens
- Anna quit her job at Siemens. | Siemens | last week | FACT STATIC
- Anna works as a nurse at St. Mary's. | St. Mary's | | FACT DYNAMIC
[5] Ben: I'm off to Rome tomorrow
- Ben is going to Rome for his sister's wedding. | Rome | tomorrow | PREDICTION DYNAMIC
"""

# field bounds as the compact schema's (``compact.fact_schema``)
_SENTENCE = (8, MAX_FACT)
_OBJECT = 60
_WHEN = 40


def _literal(text: str) -> str:
    """A GBNF string literal."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
    return f'"{escaped}"'


def grammar(labels: list[str], max_facts: int) -> str:
    """The GBNF grammar of a batch's output: each label line in order, each followed by 0..``max_facts`` facts."""
    rules = ["root ::= " + " ".join(f"m{n}" for n in range(1, len(labels) + 1))]
    facts = " ".join(["fact?"] * max_facts)
    rules += [f"m{n} ::= {_literal(label + chr(10))} {facts}".rstrip() for n, label in enumerate(labels, start=1)]
    low, high = _SENTENCE
    rules += [
        'fact ::= "- " sentence sep object sep when sep kind " " temporal "\\n"',
        'sep ::= " "? "|" " "?',
        f"sentence ::= [^|\\n]{{{low},{high}}}",
        f"object ::= [^|\\n]{{0,{_OBJECT}}}",
        f"when ::= [^|\\n]{{0,{_WHEN}}}",
        "kind ::= " + " | ".join(_literal(k) for k in KINDS),
        "temporal ::= " + " | ".join(_literal(t) for t in TEMPORALS),
    ]
    return "\n".join(rules) + "\n"


def is_lines(text: str) -> bool:
    """Whether ``text`` is the line output (not JSON: scripted replies and cached outputs of the JSON designs)."""
    return text.lstrip().startswith("[")


def to_compact(text: str, labels: list[str]) -> dict[str, Any]:
    """The line output as the compact shape ``{"messages": [{"m": label, "facts": [...]}]}``. Lines the grammar
    rules out (a fact before any label, a fact of the wrong shape) are kept in a form validation rejects, so the
    model is shown its error."""
    messages: list[dict[str, Any]] = []
    known = set(labels)
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if line in known or not line.startswith("- "):
            messages.append({"m": line, "facts": []})
            continue
        parts = [part.strip() for part in line[2:].split("|")]
        if not messages or len(parts) != 4:
            messages.append({"m": line, "facts": [{"fact": line, "kind": "?"}]})  # fails validation
            continue
        sentence, obj, when, labels_part = parts
        kind, _, temporal = labels_part.partition(" ")
        messages[-1]["facts"].append(
            {"fact": sentence, "object": obj, "when": when, "kind": kind, "temporal": temporal.strip()}
        )
    return {"messages": messages}
