"""What a judged pair of theses does, by their labels: the deterministic policy on the ``resolve`` verdict.

The model only says how NEW relates to KNOWN (``services.memorize.resolve``); what follows is decided here, from
the labels extraction gave each thesis (``EpisodeLabel``, ``TemporalLabel``) and the holder of an opinion:
- ``updates``: the one about the earlier world time ends (is invalidated by the other), unless
  - it is ATEMPORAL: it never expires; both stay, marked conflicting;
  - it is a STATIC fact not yet in conflict: a fact that cannot change was contradicted, so one of the two is
    wrong and memory cannot tell which: both stay, marked conflicting, until a later thesis contradicts one side
    again, which corrects it (that side ends, the marks go);
  - either is an OPINION: an opinion never ends a fact, nor a fact an opinion; only its holder's later opinion
    supersedes it;
  - NEW is a PREDICTION and KNOWN is not: a plan does not end what holds now;
- ``confirms`` / ``refutes`` (asked only when KNOWN is a PREDICTION): the prediction stays, linked to the thesis
  that shows it came true or not (``Mark.CONFIRMED_BY`` / ``Mark.REFUTED_BY``); a prediction that is simply
  outdated (a changed plan) is ``updates`` and ends as above;
- ``same`` / ``compatible``: nothing changes here.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from services import ids
from services.domain import EpisodeLabel, TemporalLabel


class Outcome(StrEnum):
    SUPERSEDE = "supersede"  # the earlier one is invalidated by the later
    CONFLICT = "conflict"  # both stay, marked conflicting
    CONFIRM = "confirm"
    REFUTE = "refute"
    KEEP = "keep"  # both stay as they are


@dataclass(frozen=True)
class Side:
    """What the policy reads of one thesis of a pair."""

    kind: EpisodeLabel
    temporal: TemporalLabel
    holder: str
    t_valid: datetime | None
    in_conflict: bool = False


def _earlier(new: Side, old: Side) -> Side:
    """The side that ends if one does: the one about the earlier world time (the known one on a tie)."""
    if old.t_valid is not None and new.t_valid is not None and old.t_valid > new.t_valid:
        return new
    return old


def keeps(verdict: str, new_kind: EpisodeLabel, new_holder: str, old_kind: EpisodeLabel, old_holder: str) -> bool:
    """Whether a verdict leaves both theses as they are. It reads only the verdict, the kinds and the holders (never
    times or marks), so memorize asks it before paying for a check of a verdict that would change nothing."""
    if verdict in ("confirms", "refutes"):
        return old_kind is not EpisodeLabel.PREDICTION
    if verdict != "updates":
        return True
    opinion = EpisodeLabel.OPINION
    if opinion in (new_kind, old_kind):
        same_holder = ids.normalize_name(new_holder) == ids.normalize_name(old_holder)
        return not (new_kind is old_kind is opinion and same_holder and new_holder)
    return new_kind is EpisodeLabel.PREDICTION and old_kind is not EpisodeLabel.PREDICTION


def decide(verdict: str, new: Side, old: Side) -> Outcome:
    if keeps(verdict, new.kind, new.holder, old.kind, old.holder):
        return Outcome.KEEP
    if verdict in ("confirms", "refutes"):
        return Outcome.CONFIRM if verdict == "confirms" else Outcome.REFUTE
    ending = _earlier(new, old)
    if ending.temporal is TemporalLabel.ATEMPORAL:
        return Outcome.CONFLICT
    if ending.temporal is TemporalLabel.STATIC and ending.kind is EpisodeLabel.FACT and not ending.in_conflict:
        return Outcome.CONFLICT
    return Outcome.SUPERSEDE
