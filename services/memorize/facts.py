"""What extraction takes and gives: the items of a micro-batch, and the checked facts found in each.

Kept apart from the extraction task so the checks (``attribution``), entity resolution, the builder and forgetting
read these types without importing the task, and the task imports the checks without a cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from services.memorize.when import When


@dataclass(frozen=True)
class Item:
    """One message or document chunk to extract from. ``speaker`` is a chat speaker or a document title."""

    speaker: str | None
    text: str
    time: datetime
    document: bool = False


@dataclass(frozen=True)
class ExtractionInput:
    items: list[Item]
    #: everyone taking part in the conversation, as far as memorize knows: resolves "you" and misattribution
    participants: tuple[str, ...] = ()
    #: the first item asked for: the items before it are shown (the prompt stays the same) but were answered by an
    #: earlier call that stopped at a repeated fact (``services.memorize.repeats``)
    start: int = 0
    #: the fact sentences those earlier calls wrote: writing one again stops this call too
    said: tuple[str, ...] = ()


@dataclass(frozen=True)
class Alias:
    """A name a fact said, resolved to a known object of the same user (``services.memorize.entities``)."""

    said: str  # the name as the fact said it ("Mel")
    canonical: str  # the id of the object it was merged into (Melanie's)
    method: str  # "normalized": equal after a light normalisation; "confirmed": the model said so; "alias": known
    name_score: float = 0.0  # rapidfuzz WRatio of the two names, 0-100
    similarity: float = 0.0  # cosine of the two names' vectors
    verdict: str = ""  # the model's verdict, when it was asked


@dataclass
class Fact:
    """One checked fact: the thesis text (names, no pronouns), its subject and object, and when it happened.

    ``subject_alias``/``object_alias``: set when entity resolution attached the subject or object to a known
    object under another name (the fact keeps its own words; ``subject``/``object`` name the canonical object)."""

    subject: str
    text: str
    relation: str
    object: str
    kind: str
    temporal: str
    when: When | None = None
    #: time words the message says of this fact that name no time ``resolve`` can place ("since I was 12")
    unresolved: str = ""
    #: the sentence bound ended it mid-sentence (``compact.was_cut``): kept as written, marked on the thesis, counted
    cut: bool = False
    subject_alias: Alias | None = None
    object_alias: Alias | None = None


@dataclass
class ItemFacts:
    """What extraction found in one item. ``answered`` False: the model gave no entry for it (re-ask it)."""

    facts: list[Fact] = field(default_factory=list)
    answered: bool = True
    dropped: list[str] = field(default_factory=list)  # reasons for facts removed by the checks, for metrics
