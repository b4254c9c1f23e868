"""A question's lines laid out along its chain, without a call (``QAConfig.chain_context``).

"Where was the performer of song Changed It born?" has its answer two hops from the name it gives: the line about
Changed It names Nicki Minaj, and Nicki Minaj's line says where she was born. Retrieval by the question's words
finds both lines, among others that share its words ("William Axt was born in New York City"), and a 1.5B model
given them all at once took the line nearest the question's words (2Wiki, 13 of 14 chained questions answered from
one call, each called "sufficient"; docs/evaluation.md). A ``Chain`` sorts the lines by what they are about: those
about what the question names, those about what those lines name (the bridge, or the things an answer named), the
rest; the fast engine reads them in that order (``FastQA``).

What a line is "about": the object vertices at its ends, those its statement or message links to (one graph read
for all the lines), and those of them whose name its text says. The text matters: extraction links a statement to
what it took as its objects, and on the 2Wiki memory "Changed It is a song by Nicki Minaj" was linked to Changed It
and "song", not to Nicki Minaj, whose own lines linked to her.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from services.domain import EdgeKind, Triplet, VertexKind
from services.ports import GraphStore

#: names listed in a heading at most (a message may name a dozen things)
HEADING_NAMES = 4


@dataclass(frozen=True)
class Section:
    heading: str
    lines: list[Triplet]
    part: str = ""  # "named" (what the question names), "bridge" (what those lines name), "rest"; "": no chain
    names: tuple[str, ...] = ()  # the names its lines are about (of the named and the bridge parts)


async def line_objects(graph: GraphStore, user_id: str, lines: Sequence[Triplet]) -> dict[str, dict[str, str]]:
    """Each line's object vertices (id -> name): its object ends, and the objects its statement or message links
    to, in one read."""
    out: dict[str, dict[str, str]] = {t.id: {} for t in lines}
    holders: dict[str, list[str]] = {}  # a thesis or message vertex -> the lines that show it
    for t in lines:
        for v in (t.start, t.end):
            if v.kind is VertexKind.OBJECT:
                out[t.id][v.id] = v.name
            else:
                holders.setdefault(v.id, []).append(t.id)
    if holders:
        found = await graph.neighbors(
            user_id, sorted(holders), edge_kinds=[EdgeKind.THESIS, EdgeKind.EPISODIC], far_kinds=[VertexKind.OBJECT]
        )
        for n in found:
            obj, other = (n.start, n.end) if n.start.kind is VertexKind.OBJECT else (n.end, n.start)
            for line_id in holders.get(other.id, []):
                out[line_id].setdefault(obj.id, obj.name)
    return out


class Names:
    """Where the known names are said in a text. A name of several words is found whatever its case (a question
    writes "Joanna Elisabeth Of Holstein-Gottorp"); a one-word name only as written and not opening a sentence
    (extraction leaves objects such as "In" and "Born"); a name said only inside a longer one ("Mary" in "Mary of
    Burgundy") is not said."""

    def __init__(self, known: dict[str, str]) -> None:
        self.patterns = {
            v: re.compile(rf"(?<![\w'-]){re.escape(n)}(?![\w-])", 0 if " " not in n else re.IGNORECASE)
            for v, n in known.items()
            if n[:1].isupper()  # a name, not a common noun ("song" is in every other line and chains nothing)
        }
        self.one_word = {v for v, n in known.items() if " " not in n}

    def said(self, text: str) -> set[str]:
        return {v for _, _, v in self.spans(text)}

    def spans(self, text: str) -> list[tuple[int, int, str]]:
        """Where each known name is said in ``text``: (start, end, vertex id), a name inside a longer one left out."""
        spans: list[tuple[int, int, str]] = []
        for v, pattern in self.patterns.items():
            for m in pattern.finditer(text):
                if v in self.one_word and _opens_sentence(text, m.start()):
                    continue
                spans.append((m.start(), m.end(), v))
        return [(a, b, v) for a, b, v in spans if not any(x <= a and b <= y and (y - x) > (b - a) for x, y, _ in spans)]


def _opens_sentence(text: str, at: int) -> bool:
    before = text[:at].rstrip(" \"'(")
    return not before or before[-1] in ".!?:\n" or before.endswith(")")


class Chain:
    """The lines found for a question and what each is about: laid out along the question's chain."""

    def __init__(self, question: str) -> None:
        self.question = question
        self.lines: list[Triplet] = []  # best first
        self.known: dict[str, str] = {}  # every linked object: id -> name
        self.linked: dict[str, dict[str, str]] = {}
        self.names = Names({})
        self.asked: set[str] = set()
        self.asked_at: list[tuple[int, int]] = []  # where the question says them (``qa.hops`` cuts there)
        self.said: dict[str, set[str]] = {}  # line id -> the known things its text names
        self.about: dict[str, set[str]] = {}  # line id -> those and its linked ones

    def add(self, lines: Sequence[Triplet], linked: dict[str, dict[str, str]]) -> None:
        """More lines (after those already held), with their linked objects (``line_objects``)."""
        held = {t.id for t in self.lines}
        self.lines += [t for t in lines if t.id not in held]
        self.linked |= linked
        self.known |= {v: n for objects in linked.values() for v, n in objects.items()}
        self.names = Names(self.known)
        self.said = {t.id: self.names.said(t.context) for t in self.lines}
        self.about = {t.id: self.said[t.id] | self.linked[t.id].keys() for t in self.lines}
        spans = self.names.spans(self.question)
        self.asked = {v for _, _, v in spans}
        self.asked_at = [(a, b) for a, b, _ in spans]

    def named_by(self, text: str) -> dict[str, str]:
        """The known things ``text`` (an answer) names, but for those the question names, in the order said: id ->
        name."""
        return {v: self.known[v] for _, _, v in sorted(self.names.spans(text)) if v not in self.asked}

    def sections(self, limit: int, follow: Collection[str] | None = None) -> list[Section]:
        """The lines in up to three groups, ``limit`` lines in all: those about a thing the question names, those
        about ``follow`` (default: the things the first group's lines name: the bridge), the rest; each group in
        the retrieval's order. One untitled group when no line is about a thing the question names: there is no
        chain to lay out."""
        first = [t for t in self.lines if self.about[t.id] & self.asked]
        if not first:
            return [Section(heading="", lines=self.lines[:limit])]
        # the bridge: what the first lines' words name (a link alone may be extraction's stray object)
        bridge = set(follow) if follow is not None else {v for t in first for v in self.said[t.id]}
        bridge -= self.asked
        taken = {t.id for t in first}
        second = [t for t in self.lines if t.id not in taken and self.about[t.id] & bridge]
        taken |= {t.id for t in second}
        rest = [t for t in self.lines if t.id not in taken]
        out: list[Section] = []
        left = limit
        for part, group, subjects in (("named", first, self.asked), ("bridge", second, bridge), ("rest", rest, set())):
            kept = group[:left]
            if kept:
                subject = list(dict.fromkeys(self.known[v] for t in kept for v in sorted(self.about[t.id] & subjects)))
                heading = {
                    "named": f"About {_listed(subject)}:",
                    "bridge": f"About {_listed(subject)} (named above):",
                    "rest": "Other lines:",
                }[part]
                out.append(Section(heading=heading, lines=kept, part=part, names=tuple(subject)))
            left -= len(kept)
        return out


def _listed(names: list[str]) -> str:
    return ", ".join(names[:HEADING_NAMES]) + (", ..." if len(names) > HEADING_NAMES else "")
