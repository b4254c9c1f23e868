"""The compact extraction output: facts as positional lists, and the fields read off the sentence in code.

The keyed JSON (``{"subject": ..., "fact": ..., "relation": ..., "object": ..., ...}``) spends about half of its
generated tokens on keys and on subject and relation, which repeat words of the sentence; generated tokens are the
cost of extraction on a CPU (docs/benchmarks.md, "Model time"). Here the model writes per message
``[label, [[sentence, object, when, kind, temporal], ...]]`` and the code derives:

- subject: the name the sentence starts with ("Ben's sister is ..." is about Ben; "I ..." is the speaker, decided
  later by ``attribution.check_fact`` as for the keyed output);
- relation: the words between the subject and the object ("Anna works as a nurse at | St. Mary's" gives "works as
  a nurse at"), without a trailing article; the verb when the sentence does not name the object.
"""

from __future__ import annotations

import re
from typing import Any

from services.memorize.attribution import Speakers

KINDS = ("FACT", "OPINION", "PREDICTION")
TEMPORALS = ("STATIC", "DYNAMIC", "ATEMPORAL")

# sentence openings that are not a name: a fact that starts so names nobody and is dropped as a pronoun subject
_NOT_A_NAME = frozenset(
    [
        "a",
        "an",
        "the",
        "this",
        "that",
        "these",
        "those",
        "it",
        "its",
        "they",
        "their",
        "them",
        "he",
        "his",
        "she",
        "her",
        "we",
        "our",
        "us",
        "you",
        "your",
        "i",
        "my",
        "me",
        "there",
        "here",
        "some",
        "someone",
        "everyone",
        "people",
        "one",
    ]
)
_PERSONAL = frozenset(["i", "my", "me", "you", "your"])
_CAPITALISED = re.compile(r"[A-Z][\w.'’-]*")
_POSSESSIVE = re.compile(r"(?:'s|’s|')$")
_LEADING_POSSESSIVE = re.compile(r"^(?:'s|’s|')?[\s,]*")
_TRAILING_FILLER = re.compile(r"(?:\s+(?:a|an|the|his|her|their|its|my|our|your|some))+$", re.IGNORECASE)
MAX_RELATION = 40


def subject_of(sentence: str, speakers: Speakers) -> str:
    """The person a fact sentence is about: a participant whose name opens it, else its leading capitalised
    words (a name); "I" and "you" as they are (the checks know whom they mean); "it" when it opens with no name."""
    words = sentence.split()
    if not words:
        return ""
    for name in sorted(speakers.names, key=len, reverse=True):
        if re.match(rf"{re.escape(name)}(?:\b|$)", sentence):
            return name
    first = words[0].strip(",.;:!")
    opening = _POSSESSIVE.sub("", first).casefold()
    if opening in _PERSONAL:
        return first  # "I", "you": whose it is, the checks decide from the speaker
    if opening in _NOT_A_NAME:
        return "it"  # names nobody: dropped by the checks as a pronoun subject, and counted
    leading: list[str] = []
    for word in words:
        if not _CAPITALISED.fullmatch(word.strip(",.;:!")):
            break
        bare = word.strip(",.;:!")
        leading.append(_POSSESSIVE.sub("", bare))
        if _POSSESSIVE.search(bare) or bare != word:
            break  # "Ben's sister": the person is Ben
    return " ".join(leading) or first


def relation_of(sentence: str, subject: str, obj: str) -> str:
    """The words between subject and object, without trailing articles; the first word after the subject when
    the sentence does not say the object."""
    lowered = sentence.casefold()
    start = lowered.find(subject.casefold()) if subject else -1
    after = start + len(subject) if start >= 0 else 0
    rest = _LEADING_POSSESSIVE.sub("", sentence[after:])
    at = rest.casefold().find(obj.casefold()) if obj else -1
    words = rest[:at] if at > 0 else " ".join(rest.split()[:1])
    relation = _TRAILING_FILLER.sub("", " ".join(words.split())).strip(" ,.;:")
    return relation[:MAX_RELATION].strip()


def fact_schema() -> dict[str, Any]:
    """One fact: [sentence, object, when, kind, temporal], every string bounded."""
    return {
        "type": "array",
        "prefixItems": [
            {"type": "string", "minLength": 8, "maxLength": 200},
            {"type": "string", "maxLength": 60},
            {"type": "string", "maxLength": 40},
            {"type": "string", "enum": list(KINDS)},
            {"type": "string", "enum": list(TEMPORALS)},
        ],
        "minItems": 5,
        "maxItems": 5,
    }


def output_schema(labels: list[str], max_facts: int) -> dict[str, Any]:
    """``{"messages": [[label, [fact, ...]], ...]}``, one pair per message, each label fixed by the grammar."""
    pairs = [
        {
            "type": "array",
            "prefixItems": [{"const": label}, {"type": "array", "items": fact_schema(), "maxItems": max_facts}],
            "minItems": 2,
            "maxItems": 2,
        }
        for label in labels
    ]
    messages = {"type": "array", "prefixItems": pairs, "minItems": len(pairs), "maxItems": len(pairs)}
    return {"type": "object", "properties": {"messages": messages}, "required": ["messages"]}


def is_keyed(data: Any) -> bool:
    """Whether ``data`` is the keyed output (per message an object), not the compact one."""
    messages = data.get("messages") if isinstance(data, dict) else None
    return isinstance(messages, list) and any(isinstance(entry, dict) for entry in messages)


def to_keyed(data: Any, labels: list[str], speakers: Speakers) -> dict[str, Any]:
    """The compact output as the keyed one (``ExtractionOut``'s shape), subject and relation derived. Shapes the
    grammar rules out (a label that is not the message's, a fact of the wrong length) are left for validation to
    reject, with the model shown its error."""
    if not isinstance(data, dict) or not isinstance(data.get("messages"), list):
        return data if isinstance(data, dict) else {"not an object": data}
    entries = []
    for n, pair in enumerate(data["messages"], start=1):
        if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[1], list)):
            entries.append({"m": n, "facts": pair})
            continue
        label, raw_facts = pair
        number = labels.index(label) + 1 if label in labels else n
        facts = []
        for raw in raw_facts:
            if not (isinstance(raw, list) and len(raw) == 5 and all(isinstance(x, str) for x in raw)):
                facts.append(raw)
                continue
            sentence, obj, when, kind, temporal = raw
            subject = subject_of(sentence, speakers)
            relation = relation_of(sentence, subject, obj)
            facts.append(
                {
                    "subject": subject,
                    "fact": sentence,
                    "relation": relation,
                    "object": obj,
                    "when": when,
                    "kind": kind,
                    "temporal": temporal,
                }
            )
        entries.append({"m": number, "facts": facts})
    return {"messages": entries}
