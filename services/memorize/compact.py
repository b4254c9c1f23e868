"""The compact extraction output: fewer keys, and the fields the sentence already says read off it in code.

The keyed JSON (``{"m": 2, "speaker": ..., "starts": ..., "facts": [{"subject", "fact", "relation", ...}]}``)
spends about a third of its generated tokens on subject, relation and message keys, which repeat words already
written; generated tokens are the cost of extraction on a CPU (docs/benchmarks.md, "Model time"). Here the model
writes per message ``{"m": label, "facts": [{"fact", "object", "when", "kind", "temporal"}, ...]}`` and the code
derives:

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
#: the longest subject a fact may have (``FactOut``): a derived one is cut to it here, at a word, since a model
#: shown an error about a field it does not write cannot mend it (a batch of 2Wiki passages was rejected three
#: times over "Infante Antonio Pascual Francisco Javier Juan Nepomuceno Aniello Raimundo Silvestre of Spain")
MAX_SUBJECT = 60
#: a fact's sentence, in characters: the grammar stops the model there, mid-sentence if it writes on (a HotpotQA
#: build had 11 of 209 theses visibly cut at 200: long encyclopaedic sentences); such a fact is kept as written,
#: marked and counted (``was_cut``)
MAX_FACT = 200
_SENTENCE_END = (".", "!", "?", '"', "'", ")", "]")


def was_cut(fact: str) -> bool:
    """Whether the sentence bound, not the model, ended ``fact`` (it fills the bound and ends in no full stop)."""
    return len(fact) >= MAX_FACT - 1 and not fact.endswith(_SENTENCE_END)


def subject_of(sentence: str, speakers: Speakers) -> str:
    """The person a fact sentence is about: a participant whose name opens it, else its leading capitalised
    words (a name); "I" and "you" as they are (the checks know whom they mean); "it" when it opens with no name.
    At most ``MAX_SUBJECT`` characters, cut at a word."""
    return _fit(_subject_of(sentence, speakers), MAX_SUBJECT)


def _fit(text: str, limit: int) -> str:
    """``text`` cut to whole words within ``limit`` characters (a first word longer than that, to its start)."""
    if len(text) <= limit:
        return text
    cut = text[: limit + 1].rsplit(" ", 1)[0] if " " in text[: limit + 1] else ""
    return cut.strip() or text[:limit]


def _subject_of(sentence: str, speakers: Speakers) -> str:
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


def fact_schema(lean: bool = False) -> dict[str, Any]:
    """One fact: its sentence, object, time words and labels, every string bounded. ``lean``: ``when`` and
    ``kind`` come last and may be left out (then "" and FACT): in a whole run 91% of the facts had no time words and
    97% were FACT, and those fields with their keys were a fifth of the generated text. A grammar puts a schema's
    required properties first, so the order here is the order the model writes."""
    properties = {
        "fact": {"type": "string", "minLength": 8, "maxLength": MAX_FACT},
        "object": {"type": "string", "maxLength": 60},
        "when": {"type": "string", "maxLength": 40},
        "kind": {"type": "string", "enum": list(KINDS)},
        "temporal": {"type": "string", "enum": list(TEMPORALS)},
    }
    if lean:
        order = ("fact", "object", "temporal", "when", "kind")
        return {"type": "object", "properties": {k: properties[k] for k in order}, "required": list(order[:3])}
    return {"type": "object", "properties": properties, "required": list(properties)}


def output_schema(labels: list[str], max_facts: int, lean: bool = False) -> dict[str, Any]:
    """``{"messages": [{"m": label, "facts": [...]}, ...]}``, one entry per message, each label fixed by the grammar."""
    entries = [
        {
            "type": "object",
            "properties": {
                "m": {"const": label},
                "facts": {"type": "array", "items": fact_schema(lean), "maxItems": max_facts},
            },
            "required": ["m", "facts"],
        }
        for label in labels
    ]
    messages = {"type": "array", "prefixItems": entries, "minItems": len(entries), "maxItems": len(entries)}
    return {"type": "object", "properties": {"messages": messages}, "required": ["messages"]}


def is_compact(data: Any) -> bool:
    """Whether ``data`` is the compact output (each message labelled by a string), not the keyed one (numbered)."""
    messages = data.get("messages") if isinstance(data, dict) else None
    return isinstance(messages, list) and any(
        isinstance(entry, dict) and isinstance(entry.get("m"), str) for entry in messages
    )


def to_keyed(data: dict[str, Any], labels: list[str], speakers: Speakers) -> dict[str, Any]:
    """The compact output as the keyed one (``ExtractionOut``'s shape): the label becomes the message's number,
    subject and relation are derived. Shapes the grammar rules out are left for validation to reject (the model is
    then shown its error)."""
    entries = []
    for n, entry in enumerate(data["messages"], start=1):
        if not isinstance(entry, dict):
            entries.append(entry)
            continue
        label = entry.get("m")
        number = labels.index(label) + 1 if label in labels else n
        facts = []
        for raw in entry.get("facts") or []:
            if isinstance(raw, dict) and isinstance(raw.get("fact"), str) and isinstance(raw.get("object", ""), str):
                subject = subject_of(raw["fact"], speakers)
                raw = {**raw, "subject": subject, "relation": relation_of(raw["fact"], subject, raw.get("object", ""))}
            facts.append(raw)
        entries.append({**entry, "m": number, "facts": facts})
    return {**data, "messages": entries}
