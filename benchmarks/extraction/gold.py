"""The labelled extraction set: gold facts per LoCoMo turn (tests/fixtures/extraction_gold/*.json, our own words)
joined with the turns themselves, read from the shared LoCoMo file (its licence keeps its text out of this repo)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import date, datetime
from pathlib import Path
from typing import Any

from schemas.events import ChatMessage
from services.ingest.locomo import _turn_text, parse_session_time

GOLD_DIR = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "extraction_gold"
LOCOMO = Path("../shared/data/locomo/locomo_dev7.json")


@dataclass(frozen=True)
class GoldFact:
    subject: str
    text: str
    start: date | None
    end: date | None
    when_text: str | None


@dataclass
class Turn:
    sample_id: str
    session: int
    dia_id: str
    speaker: str
    text: str
    time: datetime
    facts: list[GoldFact] = field(default_factory=list)

    @property
    def event_id(self) -> str:
        return f"{self.sample_id}:{self.dia_id}"

    def message(self, user_id: str, ingest_time: datetime) -> ChatMessage:
        return ChatMessage(
            event_id=self.event_id,
            user_id=user_id,
            speaker=self.speaker,
            text=self.text,
            conversation_id=f"{self.sample_id}:s{self.session}",
            event_time=self.time,
            ingest_time=ingest_time,
        )


def _fact(raw: dict[str, Any]) -> GoldFact:
    when = raw.get("when") or None
    return GoldFact(
        subject=str(raw["subject"]),
        text=str(raw["fact"]),
        start=date.fromisoformat(when["start"]) if when else None,
        end=date.fromisoformat(when["end"]) if when else None,
        when_text=raw.get("when_text"),
    )


def load(locomo: Path = LOCOMO, gold_dir: Path = GOLD_DIR, samples: list[str] | None = None) -> list[Turn]:
    """Every labelled turn, in conversation order, with its text and its session's time."""
    data = {s["sample_id"]: s["conversation"] for s in json.loads(locomo.read_text())}
    turns: list[Turn] = []
    for path in sorted(gold_dir.glob("*.json")):
        gold = json.loads(path.read_text())
        sample = gold["sample_id"]
        if samples and sample not in samples:
            continue
        conversation = data[sample]
        by_id = {}
        for session in gold["sessions"]:
            when = parse_session_time(conversation[f"session_{session}_date_time"])
            for raw in conversation[f"session_{session}"]:
                by_id[raw["dia_id"]] = (session, raw, when)
        for labelled in gold["turns"]:
            session, raw, when = by_id[labelled["dia_id"]]
            if raw["speaker"] != labelled["speaker"]:
                raise ValueError(f"{path.name} {labelled['dia_id']}: speaker {labelled['speaker']} != {raw['speaker']}")
            turns.append(
                Turn(
                    sample,
                    session,
                    labelled["dia_id"],
                    raw["speaker"],
                    _turn_text(raw),
                    when,
                    [_fact(f) for f in labelled["facts"]],
                )
            )
    return turns


def subset(turns: list[Turn], per_sample: int) -> list[Turn]:
    """The first ``per_sample`` turns of each conversation: the fixed subset on which design variants are compared."""
    seen: dict[str, int] = {}
    picked = []
    for turn in turns:
        seen[turn.sample_id] = seen.get(turn.sample_id, 0) + 1
        if seen[turn.sample_id] <= per_sample:
            picked.append(turn)
    return picked
