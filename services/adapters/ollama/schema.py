"""JSON schemas as Ollama's grammar converter can take them.

Ollama (checked with v0.17.4) turns a ``format`` schema into a llama.cpp grammar; a ``pattern`` holding ``\\d``
comes out as an escape the grammar parser rejects ("unknown escape at \\d"), and the runner then crashes
(SIGSEGV in the sampler): the request fails with a 500 after the whole prompt was evaluated. So ``\\d`` and ``\\w``
become character classes, and a pattern with any other backslash class is dropped: the task still validates the
output against its own model, so a dropped pattern loosens decoding, never the contract.
"""

from __future__ import annotations

from typing import Any

_CLASSES = {"d": "0-9", "w": "A-Za-z0-9_"}
_PLAIN_ESCAPES = set(".^$*+?()[]{}|\\/-")


def portable_pattern(pattern: str) -> str | None:
    """``pattern`` with ``\\d``/``\\w`` spelled as classes; None if it holds an escape we do not translate."""
    out: list[str] = []
    in_class = False
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            if i + 1 >= len(pattern):
                return None
            escaped = pattern[i + 1]
            if escaped in _CLASSES:
                out.append(_CLASSES[escaped] if in_class else f"[{_CLASSES[escaped]}]")
            elif escaped in _PLAIN_ESCAPES:
                out.append(char + escaped)
            else:
                return None
            i += 2
            continue
        if char == "[" and not in_class:
            in_class = True
        elif char == "]" and in_class:
            in_class = False
        out.append(char)
        i += 1
    return "".join(out)


def ollama_schema(schema: Any) -> Any:
    """A copy of ``schema`` whose patterns Ollama's grammar converter handles (see the module docstring)."""
    if isinstance(schema, list):
        return [ollama_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "pattern" and isinstance(value, str):
            portable = portable_pattern(value)
            if portable is not None:
                out[key] = portable
            continue
        out[key] = ollama_schema(value)  # a property called "pattern" holds a schema, not a string: kept
    return out
