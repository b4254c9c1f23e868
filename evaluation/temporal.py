"""Dates in a context: for a question whose answer is a date ("When did Caroline go to the support group?" ->
"7 May 2023"), does the memory retrieved for it carry that date?

A thesis "has the date" when a date it carries lies within the gold answer's date, at the answer's granularity: a
day, a week ("the week before 9 June 2023" is 2-8 June), a weekend, a month or a year; a thesis's period ("last
week") counts when it lies within the answer's or, if at most a week long, contains it. Two places are scored
apart: ``t_valid`` (the date the reader sees in front of every thesis, what as-of and invalidation order use) and
the thesis's words (the time extraction resolved and wrote into the text). Answers that are durations ("4 years",
"10 years ago") name no date: ``gold_span`` gives None and they are not scored.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import date, timedelta

from services.domain import Triplet, Vertex, VertexKind

_MONTHS = {m: n for n, m in enumerate(
    ["january", "february", "march", "april", "may", "june", "july", "august", "september", "october",
     "november", "december"], start=1)}  # fmt: skip
_WEEKDAYS = ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]
_DAY_MONTH_YEAR = re.compile(r"(\d{1,2})\s+([A-Za-z]+),?\s+(\d{4})")
_MONTH_YEAR = re.compile(r"^([A-Za-z]+),?\s+(\d{4})$")
_ISO = re.compile(r"\b(\d{4})-(\d{2})-(\d{2})\b")


@dataclass(frozen=True)
class Span:
    """Days ``first``..``last`` inclusive."""

    first: date
    last: date

    @property
    def days(self) -> int:
        return (self.last - self.first).days + 1

    def within(self, other: Span) -> bool:
        return other.first <= self.first and self.last <= other.last


def _day(text: str) -> date | None:
    m = _DAY_MONTH_YEAR.search(text)
    if not m or m.group(2).casefold() not in _MONTHS:
        return None
    return date(int(m.group(3)), _MONTHS[m.group(2).casefold()], int(m.group(1)))


def _month(year: int, month: int) -> Span:
    nxt = date(year + (month == 12), month % 12 + 1, 1)
    return Span(date(year, month, 1), nxt - timedelta(days=1))


def gold_span(answer: str) -> Span | None:
    """The date a LoCoMo category-2 answer names, or None for a duration or a date without a year."""
    text = " ".join(str(answer).split()).strip().rstrip(".")
    low = text.casefold()
    anchor = _day(text)
    if anchor is not None and " before " in f" {low} ":
        head = low.split(" before ")[0]
        last = anchor - timedelta(days=1)
        if head.endswith("week"):
            # "the week before 9 June" (a Friday): the annotators' "last week", the calendar week before or the
            # seven days before: both are in the span
            return Span(anchor - timedelta(days=anchor.weekday() + 7), last)
        if head.endswith(("weekend", "weekends")):
            count = 2 if head.startswith("two") else 1
            saturday = anchor - timedelta(days=(anchor.weekday() - 5) % 7 or 7)
            saturday -= timedelta(days=7 * (count - 1))
            return Span(saturday, saturday + timedelta(days=1))
        for n, name in enumerate(_WEEKDAYS):
            if head.endswith(name):
                back = (anchor.weekday() - n) % 7 or 7
                return Span(anchor - timedelta(days=back), anchor - timedelta(days=back))
        return None
    if anchor is not None and low.startswith("the week of"):
        monday = anchor - timedelta(days=anchor.weekday())
        return Span(monday, monday + timedelta(days=6))
    if anchor is not None:
        return Span(anchor, anchor)
    m = _MONTH_YEAR.match(text)
    if m and m.group(1).casefold() in _MONTHS:
        return _month(int(m.group(2)), _MONTHS[m.group(1).casefold()])
    m = re.fullmatch(r"(?:since |in )?(\d{4})", low)
    if m:
        return Span(date(int(m.group(1)), 1, 1), date(int(m.group(1)), 12, 31))
    return None


def hits(spans: list[Span], gold: Span) -> bool:
    """A span lies within the gold date, or (at most a week long) contains it."""
    return any(s.within(gold) or (gold.within(s) and s.days <= 7) for s in spans)


def valid_spans(thesis: Vertex) -> list[Span]:
    """The day a thesis is valid from (what the reader sees in front of it)."""
    return [Span(thesis.t_valid.date(), thesis.t_valid.date())] if thesis.t_valid else []


def text_spans(thesis: Vertex) -> list[Span]:
    """The dates in a thesis's words: the period extraction resolved (its props) and any dates written out."""
    spans: list[Span] = []
    start, end = thesis.props.get("when_start"), thesis.props.get("when_end")
    if start and end:
        spans.append(Span(date.fromisoformat(start), date.fromisoformat(end)))
    for m in _ISO.finditer(thesis.name):
        day = date(int(m.group(1)), int(m.group(2)), int(m.group(3)))
        spans.append(Span(day, day))
    for m in _DAY_MONTH_YEAR.finditer(thesis.name):
        if m.group(2).casefold() in _MONTHS:
            day = date(int(m.group(3)), _MONTHS[m.group(2).casefold()], int(m.group(1)))
            spans.append(Span(day, day))
    return spans


def theses_of(triplets: Iterable[Triplet]) -> list[Vertex]:
    """The thesis vertices a context shows, each once."""
    found: dict[str, Vertex] = {}
    for t in triplets:
        for v in (t.start, t.end):
            if v.kind is VertexKind.THESIS:
                found.setdefault(v.id, v)
    return list(found.values())


def dated(theses: Iterable[Vertex], gold: Span, evidence: set[str]) -> dict[str, bool]:
    """Which of the ways of carrying the date the theses have: any of them by ``t_valid`` or by their words, and
    one derived from the question's evidence turns (``evidence``: their ids) by either: the answer's own thesis
    with its date, not a coincidence of another thesis of the same month."""
    theses = list(theses)
    by_valid = {t.id for t in theses if hits(valid_spans(t), gold)}
    by_text = {t.id for t in theses if hits(text_spans(t), gold)}
    return {
        "date_t_valid": bool(by_valid),
        "date_text": bool(by_text),
        "date_evidence": bool((by_valid | by_text) & evidence),
        "date_evidence_t_valid": bool(by_valid & evidence),
    }
