"""Pick the loader for a conversation file."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from schemas.events import ChatMessage
from services.ingest.jsonl import JsonlError, jsonl_messages
from services.ingest.locomo import LocomoError, is_locomo, locomo_messages

Format = Literal["auto", "locomo", "jsonl"]


class LoaderError(ValueError):
    """The file is not a conversation we can read; the message says where and why."""


def detect_format(path: Path) -> Literal["locomo", "jsonl"]:
    if path.suffix.lower() in {".jsonl", ".ndjson"}:
        return "jsonl"
    with path.open(encoding="utf-8") as handle:
        head = handle.read(4096).lstrip()
    # a JSON array, or a single object spread over several lines, is LoCoMo; an object per line is JSONL
    if head.startswith("["):
        return "locomo"
    first_line = head.split("\n", 1)[0]
    try:
        json.loads(first_line)
    except json.JSONDecodeError:
        return "locomo"
    return "jsonl"


def load_conversation(
    path: Path | str,
    user_id: str,
    fmt: Format = "auto",
    conversation_id: str | None = None,
    samples: set[str] | None = None,
) -> list[ChatMessage]:
    """All chat messages of the file, in conversation order, validated."""
    path = Path(path)
    if not path.is_file():
        raise LoaderError(f"{path}: no such file")
    kind = detect_format(path) if fmt == "auto" else fmt
    try:
        if kind == "jsonl":
            with path.open(encoding="utf-8") as handle:
                messages: Iterator[ChatMessage] = jsonl_messages(
                    handle, user_id, conversation_id or path.stem, source=str(path)
                )
                return list(messages)
        data = json.loads(path.read_text(encoding="utf-8"))
        if not is_locomo(data):
            raise LoaderError(f"{path}: not a LoCoMo file (no 'conversation' object)")
        return list(locomo_messages(data, user_id, samples))
    except (JsonlError, LocomoError) as exc:
        raise LoaderError(str(exc)) from exc
    except json.JSONDecodeError as exc:
        raise LoaderError(f"{path}: not valid JSON: {exc.msg} at line {exc.lineno}") from exc
    except UnicodeDecodeError as exc:
        raise LoaderError(f"{path}: not UTF-8 text") from exc
