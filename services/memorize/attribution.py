"""Deterministic checks of a model's fact against the message it came from: who it is about, and whether the
message says it at all.

A small model writes "I" where it should write the speaker's name, gives the second speaker's first-person fact to
the first speaker, and fills slots with words that are not in the message ("unknown", a name from the prompt's
example). Each of these is decidable from the message text alone, so it is checked here, not asked of the model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from services.memorize.chunking import sentences
from services.memorize.facts import ExtractionInput, Item
from services.memorize.when import is_time_phrase

_FIRST = {"i", "me", "my", "mine", "myself", "speaker", "the speaker"}
_SECOND = {"you", "your", "yours", "yourself", "listener"}
# a document's own name for itself: the input labels a chunk "document" and a small model makes that the subject
# ("document has the potential to revolutionize transportation"); the title is what it means
_DOCUMENT = re.compile(r"^(?:the |this )?(?:document|text|essay|article|passage)\b", re.IGNORECASE)
_NOTHING = {"", "unknown", "none", "n/a", "na", "null", "nothing", "something", "someone", "it", "this", "that"}
_WORD = re.compile(r"[a-z0-9]+")
# words that carry no content: a fact must share something beyond these (and names) with its message
_STOP = frozenset(
    re.findall(
        r"\S+",
        """
    a an the and or but of to in on at for with from by as is are was were be been being am do does did have
    has had having will would can could should may might must shall not no yes very really so too also just
    about into over after before than then there here this that these those it its they them their he him
    his she her we us our you your i me my mine who whom which what when where why how all any some more most
    much many such own same other again once only each both few lot lots get got go going went like love loves
    loved feel feels felt make made thing things time times way one day days new good great nice
""",
    )
)
# contractions first, then plain words: "I'm" must not become "Anna'm"
_FIRST_FORMS = [
    (re.compile(r"\bI'm\b|\bI am\b"), "{name} is"),
    (re.compile(r"\bI've\b"), "{name} has"),
    (re.compile(r"\bI'll\b"), "{name} will"),
    (re.compile(r"\bI'd\b"), "{name} would"),
    (re.compile(r"\bI\b"), "{name}"),
    (re.compile(r"\b[Mm]yself\b"), "{name}"),
    (re.compile(r"\b[Mm]y\b"), "{name}'s"),
    (re.compile(r"\b[Mm]ine\b"), "{name}'s"),
    (re.compile(r"\bme\b(?!-)"), "{name}"),  # not "me-time"
]
_SECOND_FORMS = [
    (re.compile(r"\b[Yy]ou're\b|\b[Yy]ou are\b"), "{name} is"),
    (re.compile(r"\b[Yy]ou've\b"), "{name} has"),
    (re.compile(r"\b[Yy]ou'll\b"), "{name} will"),
    (re.compile(r"\b[Yy]ourself\b"), "{name}"),
    (re.compile(r"\b[Yy]our\b"), "{name}'s"),
    (re.compile(r"\b[Yy]ours\b"), "{name}'s"),
    (re.compile(r"\b[Yy]ou\b"), "{name}"),
]
#: possessives in an entity name ("my mom"): whose it is, so two speakers' mothers stay two objects
_FIRST_POSSESSIVE = [form for form in _FIRST_FORMS if form[1] == "{name}'s"]
_SECOND_POSSESSIVE = [form for form in _SECOND_FORMS if form[1] == "{name}'s"]
_OTHER_PRONOUNS = {"it", "they", "he", "she", "we", "them", "this", "that", "someone", "people", "everyone"}
_GREETING = re.compile(r"\b(hey|hi|hello|wow|oh|thanks|thank you|congrats|yeah|yes|no|aw+)\s*$", re.IGNORECASE)
_SPEECH_ACT = re.compile(
    r"^\S+(?: \S+)? (?:thanks?|thanked|congratulat\w*|compliment\w*|asks?|asked|greet\w*|apologi\w*|wish\w*|"
    r"grateful|thankful|appreciat\w*|encourag\w*|prais\w*|admir\w*|impressed|proud)\b",
    re.IGNORECASE,
)
# Praise of the person spoken to ("You'd be a great counselor!", "you're so brave"): the speaker's reaction in the
# conversation, not something about either person's life to remember.
_PRAISE = re.compile(
    r"\b(?:great|amazing|awesome|wonderful|lovely|kind|brave|strong|proud|lucky|inspir\w*|impress\w*|talented|"
    r"caring|incredible|fantastic|sweet|cool|beautiful|courag\w*|admir\w*|good job|awesome job)\b",
    re.IGNORECASE,
)
_FIRST_IN_TEXT = re.compile(r"\b(i|me|my|mine|myself|i'm|i've|i'll|i'd)\b", re.IGNORECASE)
_SECOND_IN_TEXT = re.compile(r"\b(you|your|yours|yourself|you're|you've|you'll)\b", re.IGNORECASE)


@dataclass(frozen=True)
class Speakers:
    """The people of the conversation, as far as memorize knows them."""

    names: tuple[str, ...]

    @classmethod
    def of(cls, inputs: ExtractionInput) -> Speakers:
        names = dict.fromkeys(
            [*inputs.participants, *(i.speaker for i in inputs.items if i.speaker and not i.document)]
        )
        return cls(tuple(n for n in names if n))

    def addressee(self, speaker: str | None) -> str | None:
        """The one other person, in a conversation of two; None when it cannot be known."""
        others = [n for n in self.names if n != speaker]
        return others[0] if speaker in self.names and len(others) == 1 else None

    def find(self, name: str) -> str | None:
        key = name.strip().casefold()
        return next((n for n in self.names if n.casefold() == key or n.split()[0].casefold() == key), None)


def _rewrite(text: str, forms: list[tuple[re.Pattern[str], str]], name: str) -> str:
    for pattern, replacement in forms:
        text = pattern.sub(replacement.format(name=name), text)
    return text


def _content(text: str) -> set[str]:
    return {w[:4] for w in _WORD.findall(text.casefold()) if w not in _STOP and len(w) > 2}


def check_fact(
    subject: str, fact: str, relation: str, obj: str, item: Item, speakers: Speakers
) -> tuple[str, str, str] | str:
    """``(subject, fact text, object)`` fixed where the message decides it, or the reason to drop the fact."""
    speaker = None if item.document else item.speaker
    addressee = speakers.addressee(speaker)
    subject = subject.strip()
    text = " ".join(fact.split())
    key = subject.casefold()
    if item.document and _DOCUMENT.fullmatch(subject):
        if not item.speaker:
            return "subject_pronoun"
        text = _DOCUMENT.sub(lambda _: item.speaker or "", text, count=1)
        subject = item.speaker
    elif key in _FIRST:
        if speaker is None:
            return "subject_pronoun"
        subject = speaker
    elif key in _SECOND:
        if addressee is None:
            return "subject_pronoun"
        subject = addressee
    if speaker:
        text = _rewrite(text, _FIRST_FORMS, speaker)
        subject, obj = (_rewrite(name, _FIRST_POSSESSIVE, speaker) for name in (subject, obj))
    if addressee:
        text = _rewrite(text, _SECOND_FORMS, addressee)
        subject, obj = (_rewrite(name, _SECOND_POSSESSIVE, addressee) for name in (subject, obj))
    if key in _OTHER_PRONOUNS:
        return "subject_pronoun"
    named = speakers.find(subject)
    if speaker and named and named != speaker:
        # A fact about the other person needs the sentence it comes from to speak of them ("you", or their name
        # other than as a greeting); otherwise it is the speaker's own first-person statement, misattributed.
        sentence = _source_sentence(text, subject, item.text, speakers)
        if _SECOND_IN_TEXT.search(sentence) is None and not _mentions(sentence, named):
            if not text.startswith(named):
                return "misattributed"
            text = speaker + text[len(named) :]
            subject = speaker
    elif named:
        subject = named
    obj = " ".join(obj.split())
    if obj.casefold() in _NOTHING or not (_content(obj) & (_content(item.text) | _content(text))):
        obj = ""  # an object the message does not name would be a hallucinated entity
    elif is_time_phrase(obj):
        obj = ""  # "Anna quit Siemens in February": February is when, which the thesis's dates carry, not a thing
    if _SPEECH_ACT.match(text) and (any(n != subject and n in text for n in speakers.names) or text.count(subject) > 1):
        # "Anna thanks Ben", "Ben asked Anna about ...", or a pronoun rewritten into "Ben asked Ben": the
        # conversation, not a memory
        return "speech_act"
    if addressee and _is_praise(text, subject, addressee, item.text, speakers):
        return "compliment"
    if grounding(text, subject, item.text, speakers) < MIN_GROUNDING:
        return "ungrounded"
    statements = " ".join(s for s in sentences(item.text) if not s.rstrip().endswith("?"))
    if grounding(text, subject, statements, speakers) < MIN_GROUNDING:
        return "from_question"  # "Didn't you work at Siemens?" asks; the answer, if any, is the fact
    return subject, text, obj


def _is_praise(fact: str, subject: str, addressee: str, message: str, speakers: Speakers) -> bool:
    """Whether ``fact`` is the speaker praising the person spoken to: its words are praise, it comes from a
    sentence that says "you", and it is about them, names them, or (the model's slip) gives the speaker the
    praise of a sentence that says nothing of the speaker ("You have such a caring heart")."""
    sentence = _source_sentence(fact, subject, message, speakers)
    if _SECOND_IN_TEXT.search(sentence) is None or _PRAISE.search(fact) is None:
        return False
    return subject == addressee or addressee in fact or _FIRST_IN_TEXT.search(sentence) is None


def _source_sentence(fact: str, subject: str, message: str, speakers: Speakers) -> str:
    """The sentence of ``message`` that says most of ``fact``."""
    return max(sentences(message), key=lambda sentence: grounding(fact, subject, sentence, speakers))


def _mentions(sentence: str, name: str) -> bool:
    """Whether ``sentence`` names ``name`` other than by addressing them ("Hey Mel!", "Wow, Caroline!")."""
    for match in re.finditer(rf"\b{re.escape(name)}\b", sentence, re.IGNORECASE):
        before, after = sentence[: match.start()].rstrip(), sentence[match.end() :].lstrip()
        vocative = (not before or before[-1] in ",.!?" or _GREETING.search(before)) and (
            not after or after[0] in ",.!?"
        )
        if not vocative:
            return True
    return False


#: Share of a fact's content words (names aside) that must occur in its message. A small model pads quiet
#: messages with the neighbours' facts; those share a word or two with the message, not half of their own.
MIN_GROUNDING = 0.5


def grounding(fact: str, subject: str, message: str, speakers: Speakers) -> float:
    """How much of ``fact`` (beyond names) ``message`` says: 0 to 1."""
    people = {w for n in speakers.names for w in _content(n)} | _content(subject)
    words = _content(fact) - people
    if not words:
        return 0.0
    return len(words & _content(message)) / len(words)
