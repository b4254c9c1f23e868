"""A question's first link asked on its own, found from its words without a call (``QAConfig.first_link``).

"Where was the father of Emilio Azcárraga Milmo born?" names the son; its answer is the father's birthplace. Given
the son's lines, a 1.5B model answered with the son's own birthplace (2Wiki, seed 1), and its answer named nothing
further, so reading along the chain (``qa.chain``) had no next link to follow. The question's words say where the
chain goes: "the father of <name>" is a link. ``split`` cuts such a question in two: the link as a question of its
own ("Who or what is the father of Emilio Azcárraga Milmo?"), and the rest, with the link's answer in its place
("Where was Emilio Azcárraga Vidaurreta born?"). A question that is only the link ("Who is X's uncle?") is not cut.

The link is found by English syntax alone: "the <relation> of [film|song|...] <name>", "the <thing> that <verb>s
<name>", and "<name>'s <relation>"; the innermost when links nest ("the spouse of the director of film X").
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

#: "the director of film ", "the company that published ", "the father of ": a link ending right before a name
_LINK_BEFORE = re.compile(
    r"\bthe ((?:[a-z][a-z-]* ){1,3}?)(?:of|(?:that|who|which) [a-z]+) (?:(?:the |a )?[a-z][a-z-]* )?$"
)
#: "'s husband", "'s paternal grandfather is from": the words after a possessive
_POSSESSIVE = re.compile(r"^['’]s ((?:[a-z][a-z-]*)(?: [a-z][a-z-]*)*)\s*\?*\s*$")
#: words that end a relation's name ("X's husband is from", "X's mother did ...")
_AUX = frozenset({"is", "was", "are", "were", "did", "does", "do", "has", "had", "have", "be", "been"})
#: an opening that asks something of what follows: "Where was ", "When did ", "Which country "
_WH_AUX = re.compile(r"^\s*(?:where|when|why|how|what|which)(?: [a-z]+)? (is|was|are|were|did|does|do)\s*$", re.I)
_DO = frozenset({"did", "does", "do"})
#: an opening that asks a property of what follows: "What nationality is ", "What is the place of birth of "
_ASKS_OF = re.compile(r"^\s*(?:what|which) (?:[a-z]+ (?:is|was)|(?:is|was) the [a-z ]+ of) $", re.IGNORECASE)
#: a question that asks for the link itself ("Who is ...?"): nothing is left once the link is answered
_ONLY_LINK = re.compile(r"^\s*(?:who|what|whom)(?: (?:is|was|are|were))?\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Hop:
    """The question's first link (``span``, its words in the question) and the question around it."""

    question: str
    start: int
    end: int

    @property
    def span(self) -> str:
        return self.question[self.start : self.end]

    @property
    def ask(self) -> str:
        """The link as a question of its own."""
        return f"Who or what is {self.span}?"

    def then(self, name: str) -> str:
        """The rest of the question, with the link's answer in its place."""
        return f"{self.question[: self.start]}{name}{self.question[self.end :]}"


def split(question: str, names: Iterable[tuple[int, int]]) -> Hop | None:
    """The question's innermost link to one of ``names`` (their spans in the question), or None: no link, or the
    question asks for the link itself."""
    hops = [h for a, b in sorted(names) if (h := _link(question, a, b)) is not None]
    if not hops:
        return None
    hop = min(hops, key=lambda h: h.end - h.start)  # the innermost: the other links are answered after it
    before, after = question[: hop.start], question[hop.end :]
    if _ONLY_LINK.match(before) and not after.strip(" ?"):
        return None
    return hop


def _link(question: str, start: int, end: int) -> Hop | None:
    before = _LINK_BEFORE.search(question[:start])
    if before is not None and not question[end:].startswith(("'s", "’s")):
        return Hop(question, before.start(), end)
    after = _POSSESSIVE.match(question[end:])
    if after is None:
        return None
    relation, *rest = after.group(1).split()
    opening = question[:start]
    if not rest:
        # "What nationality is X's husband?", "What is the place of birth of X's father?"; not "What damages have
        # happened to John's car?" (what is asked of X's thing is not a property of a named one)
        return Hop(question, start, end + 3 + len(relation)) if _ASKS_OF.match(opening) else None
    # "Where was X's husband born?", "Where did X's mother die?", "Which country X's father is from?": a verb after
    # a one-word relation; a longer tail is a clause about X's thing ("When did X's family go on a roadtrip?")
    verb = rest[0]
    passive = verb == "born" or verb.endswith("ed")
    aux = _WH_AUX.match(opening)
    if (aux and len(rest) <= 2 and (passive or aux.group(1).lower() in _DO)) or (verb in _AUX and len(rest) == 2):
        return Hop(question, start, end + 3 + len(relation))
    return None
