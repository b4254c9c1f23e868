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


def decide(verdict: str, new: Side, old: Side) -> Outcome:
    if verdict in ("confirms", "refutes"):
        if old.kind is not EpisodeLabel.PREDICTION:
            return Outcome.KEEP
        return Outcome.CONFIRM if verdict == "confirms" else Outcome.REFUTE
    if verdict != "updates":
        return Outcome.KEEP
    opinion = EpisodeLabel.OPINION
    if opinion in (new.kind, old.kind):
        same_holder = ids.normalize_name(new.holder) == ids.normalize_name(old.holder)
        if not (new.kind is old.kind is opinion and same_holder and new.holder):
            return Outcome.KEEP
    elif new.kind is EpisodeLabel.PREDICTION and old.kind is not EpisodeLabel.PREDICTION:
        return Outcome.KEEP
    ending = _earlier(new, old)
    if ending.temporal is TemporalLabel.ATEMPORAL:
        return Outcome.CONFLICT
    if ending.temporal is TemporalLabel.STATIC and ending.kind is EpisodeLabel.FACT and not ending.in_conflict:
        return Outcome.CONFLICT
    return Outcome.SUPERSEDE


def may_act(verdict: str, new_kind: EpisodeLabel, new_holder: str, old_kind: EpisodeLabel, old_holder: str) -> bool:
    """Whether ``decide`` could do anything but keep both on this verdict: keeping depends only on the verdict, the
    kinds and the holders (never on times or marks), so a verdict the labels keep anyway needs no confirming."""
    times = TemporalLabel.DYNAMIC  # any: no rule that keeps reads it
    new, old = Side(new_kind, times, new_holder, None), Side(old_kind, times, old_holder, None)
    return decide(verdict, new, old) is not Outcome.KEEP
