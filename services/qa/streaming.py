"""Answer text out of a JSON answer still being written: what a streaming listener shows while the model decodes.

An answer task puts its ``answer`` string first in its schema, so the text streams from the first tokens on;
``streamed`` turns a listener of answer text into the ``on_text`` a task's call takes (the whole output so far).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

_ANSWER_KEY = re.compile(r'"answer"\s*:\s*"')
#: an escape cut off at the end: a lone backslash, or \u with fewer than four hex digits
_CUT_ESCAPE = re.compile(r"\\(?:u[0-9a-fA-F]{0,3})?$")
#: a high surrogate escape whose low half has not come yet (an emoji written as two \u escapes)
_HALF_PAIR = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}$")


def answer_text_so_far(partial_json: str) -> str:
    """The ``answer`` string of a JSON object as far as it is written ("" before it starts). Escapes are decoded;
    one cut off at the end waits for its next piece, so the text only ever grows."""
    found = _ANSWER_KEY.search(partial_json)
    if found is None:
        return ""
    body: list[str] = []
    escaped = False
    for char in partial_json[found.end() :]:
        if char == '"' and not escaped:
            break
        body.append(char)
        escaped = char == "\\" and not escaped
    raw = "".join(body)
    for cut in (_CUT_ESCAPE, _HALF_PAIR):
        raw = _without_cut(raw, cut)
    try:
        text: str = json.loads(f'"{raw}"')
    except json.JSONDecodeError:
        return ""  # not the answer string of a JSON object (a model that wrote something else)
    return text


def _without_cut(raw: str, cut: re.Pattern[str]) -> str:
    """``raw`` without an escape ``cut`` matches at its end, unless that backslash is itself escaped."""
    match = cut.search(raw)
    if match is None:
        return raw
    before = raw[: match.start()]
    escaped = (len(before) - len(before.rstrip("\\"))) % 2 == 1
    return raw if escaped else before


def streamed(on_text: Callable[[str], None] | None) -> Callable[[str], None] | None:
    """The ``on_text`` of a JSON answer call: passes ``on_text`` the answer text so far, each change once."""
    if on_text is None:
        return None
    last = ""

    def listen(partial_json: str) -> None:
        nonlocal last
        text = answer_text_so_far(partial_json)
        if text != last or not partial_json:  # a retry starts from "" again: the listener is told
            last = text
            on_text(text)

    return listen
