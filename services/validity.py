"""The times a thesis or relation edge did not hold between its first ``t_valid`` and now: its gaps.

A thesis or edge that ended (``t_invalid``) and is stated again later holds again from the restatement: its
``t_invalid`` is cleared, and the time in between is kept as a gap in its props (``GAPS``: JSON
``[[from, to, by], ...]``, UTC ISO-8601, ``from`` inclusive, ``to`` exclusive, ``by`` the thesis whose invalidation
began it, if one did), so that ``as_of`` a time in the gap sees it ended. Props are persisted whole by both stores
and rewritten whole by forgetting, so no store needs a new column for them.
"""

from __future__ import annotations

import json
from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime

GAPS = "gaps"

Interval = tuple[datetime, datetime | None]
_OPEN = datetime.max.replace(tzinfo=UTC)


@dataclass(frozen=True, order=True)
class Gap:
    start: datetime
    end: datetime
    #: the thesis whose invalidation began the gap ("" if none did: the end its staters' own words gave)
    by: str = ""


def _text(value: datetime) -> str:
    aware = value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    return aware.isoformat(timespec="microseconds")


def gaps(props: Mapping[str, str]) -> list[Gap]:
    """The gaps recorded in ``props``, oldest first."""
    raw = props.get(GAPS)
    if not raw:
        return []
    return [
        Gap(datetime.fromisoformat(e[0]), datetime.fromisoformat(e[1]), e[2] if len(e) > 2 else "")
        for e in json.loads(raw)
    ]


def in_gap(props: Mapping[str, str], when: datetime) -> bool:
    return GAPS in props and any(gap.start <= when < gap.end for gap in gaps(props))


def with_gaps(props: Mapping[str, str], found: Iterable[Gap]) -> dict[str, str]:
    """``props`` with exactly the gaps ``found`` (none: no ``GAPS`` key); empty gaps are dropped."""
    kept = sorted({(_text(gap.start), _text(gap.end), gap.by) for gap in found if gap.start < gap.end})
    out = {k: v for k, v in props.items() if k != GAPS}
    if kept:
        out[GAPS] = json.dumps([list(gap) for gap in kept], separators=(",", ":"), ensure_ascii=False)
    return out


def reopened(props: Mapping[str, str], ended: datetime, restated: datetime, by: str | None) -> dict[str, str]:
    """The props of a thesis or edge that ended at ``ended`` (invalidated ``by``) and holds again from
    ``restated``."""
    return with_gaps(props, [*gaps(props), Gap(ended, restated, by or "")])


def without_gaps_by(props: Mapping[str, str], removed: Container[str]) -> dict[str, str] | None:
    """``props`` without the gaps that ``removed`` theses began (forgotten: as if never said); None if none."""
    found = gaps(props)
    kept = [gap for gap in found if not (gap.by and gap.by in removed)]
    return None if len(kept) == len(found) else with_gaps(props, kept)


def held(t_valid: datetime | None, t_invalid: datetime | None, props: Mapping[str, str]) -> list[Interval]:
    """The intervals a thesis or edge held in: from ``t_valid`` to ``t_invalid`` (None: still), less its gaps."""
    if t_valid is None:
        return []
    found: list[Interval] = []
    start = t_valid
    for gap in gaps(props):
        if gap.start > start:
            found.append((start, gap.start))
        start = max(start, gap.end)
    if t_invalid is None or t_invalid > start:
        found.append((start, t_invalid))
    return found


def holes(intervals: Iterable[Interval]) -> list[Gap]:
    """The gaps in the union of ``intervals`` (``[start, end)``, ``end`` None: still holds), from the first start
    on: a relation edge holds exactly while one of the theses stating it does."""
    found: list[Gap] = []
    reach: datetime | None = None  # where the union so far ends
    for start, end in sorted(intervals, key=lambda interval: interval[0]):
        stop = _OPEN if end is None else end
        if reach is not None and start > reach:
            found.append(Gap(reach, start))
        reach = stop if reach is None else max(reach, stop)
    return found
