"""Repeats in the compact extraction output: a fact the model already wrote for this batch, stopped as it ends.

Greedy decoding makes the 1.5B model copy facts it has just written: in the whole run of conv-26 + conv-30 (788
turns, 100 extraction calls) 447 of 1,429 facts were exact copies of a fact written earlier in the same call (193
under the same message, 254 under another), about a quarter of all generated tokens, and memorize then dropped
them as duplicates (docs/benchmarks.md, "Repeats"). So the call is stopped as soon as a fact string equal to an
earlier one is closed (``RepeatStop``), the output is read up to that fact (``cut``), and the messages not yet
answered are asked for by a second call with the same prompt (so the engine reads nothing again: the prompt is in
its KV cache) and a schema that starts at the first of them; the facts already written are named to it
(``ExtractionInput.said``) so a copy of one of them stops it too.

Only an exact copy (casefold and whitespace aside) counts: facts that merely begin alike ("Caroline's pet is a
dog" / "... a cat") are different facts, and 16 of 982 distinct facts in that run shared 80% of their opening
with an earlier one.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import re
from collections.abc import Collection
from dataclasses import dataclass

from services.ids import normalize_text
from services.ports import StopRule

# the compact output's shapes (``services.memorize.compact``): a message entry opens ``{"m":``, a fact ``{"fact":"``
# with its sentence first; inside a JSON string every quote is escaped, so neither pattern can match there
_ENTRY = re.compile(r'\{\s*"m"\s*:')
_FACT = re.compile(r'\{\s*"fact"\s*:\s*"((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Repeat:
    """Where the first repeated fact is: its message entry's start, its own start, and its entry's number in the
    output (0: the first written)."""

    entry_at: int
    fact_at: int
    entry: int
    first_fact: bool


def _decoded(raw: str) -> str:
    try:
        return str(json.loads(f'"{raw}"'))
    except json.JSONDecodeError:
        return raw


def facts_in(text: str) -> list[str]:
    """The fact sentences written in ``text`` (an output, or the start of one), in order."""
    return [_decoded(m.group(1)) for m in _FACT.finditer(text)]


def find(text: str, said: Collection[str] = ()) -> Repeat | None:
    """The first fact of ``text`` that repeats one written before it or one of ``said``; None if none does."""
    seen = {normalize_text(s) for s in said}
    entries = [m.start() for m in _ENTRY.finditer(text)]
    previous_entry = -1
    for match in _FACT.finditer(text):
        at = match.start()
        entry = max(bisect.bisect_left(entries, at) - 1, 0)  # the last entry opened before this fact
        key = normalize_text(_decoded(match.group(1)))
        if key in seen:
            return Repeat(entries[entry] if entries else 0, at, entry, first_fact=entry != previous_entry)
        seen.add(key)
        previous_entry = entry
    return None


def cut(text: str, repeat: Repeat) -> str:
    """``text`` up to ``repeat``, closed as a whole output. A message whose first fact is the repeat (and that is not
    the first the output answers) is left out, to be asked again with nothing before it; otherwise its entry keeps
    the facts before the repeat."""
    if repeat.first_fact and repeat.entry > 0:
        return text[: repeat.entry_at].rstrip().rstrip(",") + "]}"
    return text[: repeat.fact_at].rstrip().rstrip(",") + "]}]}"


def before_repeat(text: str, said: Collection[str] = ()) -> str:
    """``text`` closed at its first repeat (as it is read), or as it is when it has none."""
    repeat = find(text, said)
    return text if repeat is None else cut(text, repeat)


class RepeatStop(StopRule):
    """Stops an extraction call once it has closed a fact string equal to an earlier one or to one of ``said``."""

    def __init__(self, said: Collection[str] = ()) -> None:
        self.said = tuple(said)
        digest = hashlib.sha256("\n".join(sorted(normalize_text(s) for s in self.said)).encode()).hexdigest()
        self.key = f"repeats:{digest[:32]}"

    def __call__(self, text: str) -> bool:
        # a fact string can only have closed if the new piece holds a quote: most pieces are skipped at once
        return '"' in text[-8:] and find(text, self.said) is not None
