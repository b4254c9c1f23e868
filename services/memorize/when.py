"""When a statement happened, from the words that say so ("yesterday", "last week", "in 2020") and when it was said.

A small model is bad at calendar arithmetic, so extraction only copies the time words out of the message and this
module turns them into an absolute day or range. Points ("yesterday", "last Friday", "two days ago", "May 7") go to
``dateparser``; periods ("last week", "next month", "this weekend", "3 years ago") are ranges, which ``dateparser``
does not return, so they are read here: a week runs Monday to Sunday, "N years ago" is that calendar year.

Most time words date an event or a period something was true in ("last weekend", "in 2019"): it happened then.
Words that say a state stopped ("until June", "till last Friday", "from 2019 to 2021") give a ``When`` with
``ended``: the state held up to and including ``end`` and not after (``services.memorize.builder`` makes that the
thesis's ``t_invalid``).
"""

from __future__ import annotations

import calendar
import re
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from typing import Any

import dateparser

from services.memorize.chunking import sentences

_NUMBERS = {
    "a": 1,
    "an": 1,
    "one": 1,
    "two": 2,
    "three": 3,
    "four": 4,
    "five": 5,
    "six": 6,
    "seven": 7,
    "eight": 8,
    "nine": 9,
    "ten": 10,
    "a couple of": 2,
    "couple of": 2,
    "a few": 3,
    "few": 3,
}
_NUM = r"(\d+|a couple of|couple of|a few|few|an?|one|two|three|four|five|six|seven|eight|nine|ten)"
_PERIOD = re.compile(r"\b(last|past|previous|this|next|coming)\s+(week|weekend|month|year)\b")
_AGO = re.compile(rf"\b{_NUM}\s+(day|week|month|year)s?\s+ago\b")
_FOR = re.compile(rf"\b(?:for|since)\s+(?:the\s+(?:last|past)\s+)?{_NUM}\s+(day|week|month|year)s?\b")
_YEAR = re.compile(r"^(?:in|during|since|back in)?\s*((?:19|20)\d\d)$")
_MONTH = re.compile(r"^(?:in|during|since|last|this|next)?\s*(" + "|".join(calendar.month_name[1:]).lower() + r")$")
_MONTH_YEAR = re.compile(
    r"^(?:in|during|since|back in)?\s*(" + "|".join(calendar.month_name[1:]).lower() + r")\s+(?:of\s+)?((?:19|20)\d\d)$"
)
_UNTIL = re.compile(r"^(?:up\s+)?(?:until|till|til|up to)\s+(.+)$")
_RANGE = re.compile(r"^(?:from|between)\s+(.+?)\s+(?:to|until|till|and|through)\s+(.+)$")
_VAGUE = re.compile(r"\b(recently|lately|the other day|soon|someday|sometime|always|ever|now|these days)\b")


_WEEKDAY = r"(?:monday|tuesday|wednesday|thursday|friday|saturday|sunday|mon|tue|tues|wed|thu|thur|thurs|fri|sat|sun)"
_MONTH_NAME = "(?:" + "|".join(calendar.month_name[1:]).lower() + ")"
_YEAR_WORD = r"(?:19|20)\d\d"
#: "May 7", "May 7th", "April 28, 1978": a day, with its year when one follows
_MONTH_DAY = rf"{_MONTH_NAME} \d{{1,2}}(?:st|nd|rd|th)?(?:,? {_YEAR_WORD})?"
#: a time as it occurs in running text, alone or after "until", "since", "from ... to" (longest alternatives first)
_DATE = (
    r"(?:the day before yesterday|yesterday|today|tonight|tomorrow|last night|this morning|"
    rf"(?:last|past|previous|this|next|coming) (?:week(?:end)?|month|year|{_WEEKDAY}|summer|winter|spring|fall)|"
    rf"{_NUM} (?:day|week|month|year)s? ago|"
    rf"{_MONTH_DAY}|"
    rf"{_MONTH_NAME}(?: (?:of )?{_YEAR_WORD})?|"
    rf"{_YEAR_WORD}|"
    rf"(?:last |next |this |on )?{_WEEKDAY})"
)
#: Time words in running text, for a fact whose model gave none or gave words the message does not say. A range
#: ("from 2019 to 2021") and an end ("until June", "till last Friday") say the state stopped; ``resolve`` reads
#: them as it reads the model's words (``When.ended``, ``When.open_start``), so both paths agree.
_IN_TEXT = re.compile(
    r"\b(?:"
    rf"(?:from|between) {_DATE} (?:to|until|till|through|and) {_DATE}|"
    rf"(?:up until|until|till|up to) {_DATE}|"
    rf"(?:since|back in) {_DATE}|"
    rf"in (?:{_YEAR_WORD}|{_MONTH_NAME}(?: {_YEAR_WORD})?)|"
    r"the day before yesterday|yesterday|today|tonight|tomorrow|last night|this morning|"
    rf"(?:last|past|previous|this|next|coming) (?:week(?:end)?|month|year|{_WEEKDAY}|summer|winter|spring|fall)|"
    rf"{_NUM} (?:day|week|month|year)s? ago|"
    rf"(?:on|last|next|this) {_WEEKDAY}|"
    rf"{_MONTH_DAY}"
    r")\b",
    re.IGNORECASE,
)
# a comma between a day and its year is not a clause's end: "born April 28, 1978" split there read "April 28" of
# the year it was said in (a HotpotQA passage's singer became "28 April 2023")
_CLAUSE = re.compile(rf"(?<!\d),\s+|,\s+(?!{_YEAR_WORD}\b)|[;:]\s+|\s+-\s+")
#: English ways of speaking of what is to come; "looking forward to the wedding in June", said in March, is this June
_FUTURE = re.compile(
    r"\b(will|'ll|going to|gonna|plan|planning|hope to|want to|next|upcoming|soon|training for|looking forward|"
    r"look forward|can'?t wait|cannot wait|about to|scheduled|intend to|intends to)\b",
    re.I,
)


def time_words(text: str) -> list[tuple[str, str]]:
    """Every time phrase in ``text`` with what it dates: its clause ("I'm still in Munich, training for the
    marathon in September" dates the training, not Munich), or its whole sentence when the clause is only an
    opening ("Last week, I won my first tournament")."""
    found: list[tuple[str, str]] = []
    for sentence in sentences(text):
        for clause in _CLAUSE.split(sentence):
            for match in _IN_TEXT.finditer(clause):
                rest = clause[: match.start()] + clause[match.end() :]
                found.append((match.group(0), sentence if len(rest.split()) <= 3 else clause))
    return found


def sounds_future(text: str) -> bool:
    """Whether ``text`` speaks of what is still to come ("I'm training for the marathon in September")."""
    return _FUTURE.search(text) is not None


@dataclass(frozen=True)
class When:
    """A day (``start == end``) or a range of days, inclusive, and the words it was read from."""

    start: date
    end: date
    text: str
    #: the words say the state stopped after ``end`` ("until June", "from 2019 to 2021"), not only that it
    #: happened or held then ("last weekend", "in 2019", "since 2019")
    ended: bool = False
    #: the words give no start ("until June"): ``start`` is only the start of the period named as the end
    open_start: bool = False

    def describe(self) -> str:
        """Human form for thesis text: "7 May 2023", "29 May - 4 June 2023", "May 2023", "2022", "2019 - 2021",
        "until June 2023"."""
        if self.open_start:
            return f"until {When(self.start, self.end, self.text).describe()}"
        if (self.start.month, self.start.day, self.end.month, self.end.day) == (1, 1, 12, 31) and (
            self.start.year < self.end.year
        ):
            return f"{self.start.year} - {self.end.year}"
        if self.start == self.end:
            return _day(self.start)
        if (self.start.month, self.start.day, self.end.month, self.end.day) == (1, 1, 12, 31) and (
            self.start.year == self.end.year
        ):
            return str(self.start.year)
        last = calendar.monthrange(self.start.year, self.start.month)[1]
        if self.start.day == 1 and self.end == self.start.replace(day=last):
            return f"{calendar.month_name[self.start.month]} {self.start.year}"
        return f"{_day(self.start)} - {_day(self.end)}"


def _day(d: date) -> str:
    return f"{d.day} {calendar.month_name[d.month]} {d.year}"


def _week(d: date) -> tuple[date, date]:
    monday = d - timedelta(days=d.weekday())
    return monday, monday + timedelta(days=6)


def _month(year: int, month: int) -> tuple[date, date]:
    while month < 1:
        year, month = year - 1, month + 12
    while month > 12:
        year, month = year + 1, month - 12
    return date(year, month, 1), date(year, month, calendar.monthrange(year, month)[1])


def _period(which: str, unit: str, said: date) -> tuple[date, date]:
    step = {"last": -1, "past": -1, "previous": -1, "this": 0, "next": 1, "coming": 1}[which]
    if unit == "year":
        year = said.year + step
        return date(year, 1, 1), date(year, 12, 31)
    if unit == "month":
        return _month(said.year, said.month + step)
    if unit == "week":
        return _week(said + timedelta(weeks=step))
    # weekend: "last weekend" is the one before the week said in; "this"/"next" the one ahead
    saturday = said + timedelta(days=5 - said.weekday())
    if step < 0:
        saturday -= timedelta(weeks=1)
    elif step > 0 and said.weekday() >= 5:
        saturday += timedelta(weeks=1)
    return saturday, saturday + timedelta(days=1)


def _ago(count: int, unit: str, said: date) -> tuple[date, date]:
    if unit == "year":
        return date(said.year - count, 1, 1), date(said.year - count, 12, 31)
    if unit == "month":
        return _month(said.year, said.month - count)
    if unit == "week":
        return _week(said - timedelta(weeks=count))
    day = said - timedelta(days=count)
    return day, day


def _span_start(count: int, unit: str, said: date) -> date:
    days = {"day": 1, "week": 7, "month": 30, "year": 365}[unit] * count
    if unit == "year":
        try:
            return said.replace(year=said.year - count)
        except ValueError:  # 29 February
            return said.replace(year=said.year - count, day=28)
    return said - timedelta(days=days)


def resolve(words: str, said_at: datetime, future: bool = False) -> When | None:
    """The day or range ``words`` refer to, said at ``said_at``; None if they name no resolvable time.
    ``future``: the statement is about what is to come, so a bare month or weekday is the next one."""
    text = " ".join(words.lower().replace(",", " ").split()).strip(" .!?")
    if not text or (_VAGUE.search(text) and not re.search(r"\d", text)):
        return None
    said = said_at.date()
    if match := _RANGE.match(text):
        first, last = resolve(match.group(1), said_at, future), resolve(match.group(2), said_at, future)
        if first is None or last is None or first.start > last.end:
            return None
        return When(first.start, last.end, words.strip(), ended=True)
    if match := _UNTIL.match(text):
        rest = match.group(1)
        if month_match := _MONTH.match(rest):
            # "until June": the June of the year it was said in ("I'm in Berlin until June", "I lived there
            # until June"), the next one for a plan said after it
            month = [m.lower() for m in calendar.month_name].index(month_match.group(1))
            bound: When | None = When(*_month(said.year + (future and month < said.month), month), rest)
        else:
            bound = resolve(rest, said_at, future)
        if bound is None:
            return None
        return When(bound.start, bound.end, words.strip(), ended=True, open_start=True)
    found: tuple[date, date] | None = None
    if match := _PERIOD.search(text):
        found = _period(match.group(1), match.group(2), said)
    elif match := _AGO.search(text):
        found = _ago(_NUMBERS.get(match.group(1)) or int(match.group(1)), match.group(2), said)
    elif match := _FOR.search(text):
        found = (_span_start(_NUMBERS.get(match.group(1)) or int(match.group(1)), match.group(2), said), said)
    elif match := _YEAR.match(text):
        year = int(match.group(1))
        found = (date(year, 1, 1), date(year, 12, 31))
    elif match := _MONTH_YEAR.match(text):
        found = _month(int(match.group(2)), [m.lower() for m in calendar.month_name].index(match.group(1)))
    elif match := _MONTH.match(text):
        month = [m.lower() for m in calendar.month_name].index(match.group(1))
        if future or text.startswith("next"):
            year = said.year + 1 if month < said.month else said.year
        else:
            year = said.year - 1 if month > said.month else said.year
        found = _month(year, month)
    else:
        found = _point(text, said_at, future)
    if found is None or found[0] > found[1]:
        return None
    return When(found[0], found[1], words.strip())


def _point(text: str, said_at: datetime, future: bool) -> tuple[date, date] | None:
    base = said_at.replace(tzinfo=None)
    future = future or bool(re.search(r"\b(next|coming|tomorrow|upcoming|this)\b", text))
    settings: dict[str, Any] = {
        "RELATIVE_BASE": base,
        "PREFER_DATES_FROM": "future" if future else "past",
        "REQUIRE_PARTS": [],
    }
    for candidate in (text, re.sub(r"^(on|at|in|this past|since)\s+", "", text)):
        parsed = dateparser.parse(candidate, languages=["en"], settings=settings)
        if parsed is not None:
            day = parsed.date()
            # a bare weekday said in the past tense means the last one, never today
            return day, day
    return None


def is_time_phrase(text: str) -> bool:
    """Whether ``text`` is nothing but a time ("February", "last week", "May 7", "2023"), alone or after "in" or
    "on": a fact's time, which its dates carry, never an entity of the graph."""
    text = " ".join(text.split())
    return bool(text) and any(
        any(phrase.casefold() == candidate.casefold() for phrase, _ in time_words(candidate))
        for candidate in (text, f"in {text}", f"on {text}")
    )
