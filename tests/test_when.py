"""Time words -> absolute days and ranges, relative to when they were said."""

from __future__ import annotations

from datetime import UTC, date, datetime

import pytest

from services.memorize.when import resolve, sounds_future

MON = datetime(2023, 5, 8, 13, 56, tzinfo=UTC)  # Monday 8 May 2023
FRI = datetime(2023, 1, 20, 18, 0, tzinfo=UTC)  # Friday 20 January 2023
SUN = datetime(2022, 1, 23, 9, 0, tzinfo=UTC)  # Sunday 23 January 2022


@pytest.mark.parametrize(
    ("words", "said", "start", "end", "shown"),
    [
        ("yesterday", MON, date(2023, 5, 7), date(2023, 5, 7), "7 May 2023"),
        ("today", MON, date(2023, 5, 8), date(2023, 5, 8), "8 May 2023"),
        ("tomorrow", FRI, date(2023, 1, 21), date(2023, 1, 21), "21 January 2023"),
        ("two days ago", FRI, date(2023, 1, 18), date(2023, 1, 18), "18 January 2023"),
        ("last Friday", SUN, date(2022, 1, 21), date(2022, 1, 21), "21 January 2022"),
        ("next Fri", FRI, date(2023, 1, 27), date(2023, 1, 27), "27 January 2023"),
        ("last week", MON, date(2023, 5, 1), date(2023, 5, 7), "1 May 2023 - 7 May 2023"),
        ("this week", FRI, date(2023, 1, 16), date(2023, 1, 22), "16 January 2023 - 22 January 2023"),
        ("last weekend", datetime(2023, 5, 12, tzinfo=UTC), date(2023, 5, 6), date(2023, 5, 7), None),
        ("this weekend", FRI, date(2023, 1, 21), date(2023, 1, 22), None),
        ("next month", MON, date(2023, 6, 1), date(2023, 6, 30), "June 2023"),
        ("last month", datetime(2023, 1, 1, tzinfo=UTC), date(2022, 12, 1), date(2022, 12, 31), "December 2022"),
        ("last year", MON, date(2022, 1, 1), date(2022, 12, 31), "2022"),
        ("three years ago", MON, date(2020, 1, 1), date(2020, 12, 31), "2020"),
        ("a couple of weeks ago", MON, date(2023, 4, 24), date(2023, 4, 30), None),
        ("in 2019", MON, date(2019, 1, 1), date(2019, 12, 31), "2019"),
        ("in March", MON, date(2023, 3, 1), date(2023, 3, 31), "March 2023"),
        ("in August", MON, date(2022, 8, 1), date(2022, 8, 31), "August 2022"),  # said in May: last August
        ("for 3 years now", SUN, date(2019, 1, 23), date(2022, 1, 23), None),
        ("on May 2", MON, date(2023, 5, 2), date(2023, 5, 2), "2 May 2023"),
    ],
)
def test_resolves(words: str, said: datetime, start: date, end: date, shown: str | None) -> None:
    when = resolve(words, said)
    assert when is not None, words
    assert (when.start, when.end) == (start, end)
    assert when.text == words
    if shown is not None:
        assert when.describe() == shown


@pytest.mark.parametrize("words", ["recently", "lately", "the other day", "", "soon", "someday", "blue"])
def test_vague_or_no_time_resolves_to_nothing(words: str) -> None:
    assert resolve(words, MON) is None


def test_a_bare_month_or_weekday_of_a_plan_is_the_next_one() -> None:
    said = datetime(2024, 3, 2, tzinfo=UTC)  # a Saturday
    later = resolve("in September", said, future=True)
    earlier = resolve("in September", said)
    assert later is not None and (later.start, later.end) == (date(2024, 9, 1), date(2024, 9, 30))
    assert earlier is not None and earlier.start == date(2023, 9, 1)
    friday = resolve("on Friday", said, future=True)
    assert friday is not None and friday.start == date(2024, 3, 8)


@pytest.mark.parametrize(
    ("text", "future"),
    [
        ("I'm looking forward to my sister's wedding in June.", True),
        ("I can't wait for the concert in August.", True),
        ("The school play is scheduled for Friday.", True),
        ("I'm about to leave for Rome.", True),
        ("I went to my sister's wedding in June.", False),
        ("We looked at the photos from June.", False),
    ],
)
def test_future_is_read_from_how_a_statement_speaks(text: str, future: bool) -> None:
    assert sounds_future(text) is future


SAID = datetime(2023, 5, 12, 15, 0, tzinfo=UTC)  # Friday 12 May 2023
AUG = datetime(2023, 8, 20, tzinfo=UTC)


@pytest.mark.parametrize(
    ("words", "said", "start", "end", "ended", "open_start", "shown"),
    [
        # an event or a period it held in: it happened then, nothing says it stopped
        ("last weekend", SAID, date(2023, 5, 6), date(2023, 5, 7), False, False, "6 May 2023 - 7 May 2023"),
        ("since 2019", SAID, date(2019, 1, 1), date(2019, 12, 31), False, False, "2019"),
        # a state that stopped
        ("from 2019 to 2021", SAID, date(2019, 1, 1), date(2021, 12, 31), True, False, "2019 - 2021"),
        ("between March and April", SAID, date(2023, 3, 1), date(2023, 4, 30), True, False, None),
        ("until June", SAID, date(2023, 6, 1), date(2023, 6, 30), True, True, "until June 2023"),
        ("until June", AUG, date(2023, 6, 1), date(2023, 6, 30), True, True, "until June 2023"),
        ("till last Friday", SAID, date(2023, 5, 5), date(2023, 5, 5), True, True, "until 5 May 2023"),
    ],
)
def test_words_that_say_a_state_stopped_are_ended(
    words: str, said: datetime, start: date, end: date, ended: bool, open_start: bool, shown: str | None
) -> None:
    when = resolve(words, said)
    assert when is not None, words
    assert (when.start, when.end, when.ended, when.open_start) == (start, end, ended, open_start)
    if shown is not None:
        assert when.describe() == shown


def test_until_a_month_of_a_plan_said_after_it_is_next_year() -> None:
    when = resolve("until February", AUG, future=True)
    assert when is not None and (when.start, when.end) == (date(2024, 2, 1), date(2024, 2, 29))


@pytest.mark.parametrize("words", ["since I was 12", "from 2021 to 2019", "until then", "from blue to green"])
def test_unresolvable_or_backwards_ranges_resolve_to_nothing(words: str) -> None:
    assert resolve(words, SAID) is None
