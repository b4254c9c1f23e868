"""Hold a user's events back until they fill an extraction batch, or have waited long enough.

Users' messages arrive interleaved: a take of 64 records from 20 chatting users holds about three per user, and
memorize would spend one extraction call on each user's three. Holding a user's partial batch over the next takes
(unacked, so nothing is lost if the worker dies) lets the batch fill: one call per ``batch`` messages. A user's
events are released together and in order, when there are ``batch`` of them, when the oldest has waited
``max_hold_s``, or when too many are held in all (the oldest users first).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Generic, TypeVar

E = TypeVar("E")


@dataclass
class _Held(Generic[E]):
    since: float
    events: list[E] = field(default_factory=list)


class Holdback(Generic[E]):
    def __init__(self, batch: int, max_hold_s: float, max_held: int) -> None:
        self.batch = max(1, batch)
        self.max_hold_s = max(0.0, max_hold_s)
        self.max_held = max(self.batch, max_held)
        self._users: OrderedDict[bytes | None, _Held[E]] = OrderedDict()
        self.held = 0

    def add(self, key: bytes | None, event: E, now: float) -> None:
        held = self._users.get(key)
        if held is None:
            held = self._users[key] = _Held(since=now)
        held.events.append(event)
        self.held += 1

    def release(self, now: float) -> list[E]:
        """Events to process now, each user's in arrival order; the rest stay held."""
        out: list[E] = []
        for key in list(self._users):
            held = self._users[key]
            full = len(held.events) >= self.batch
            if full or now - held.since >= self.max_hold_s or self.held > self.max_held:
                out.extend(held.events)
                self.held -= len(held.events)
                del self._users[key]
        return out

    def wait_s(self, now: float) -> float | None:
        """How long until the oldest held user is due (None: nothing held)."""
        if not self._users:
            return None
        oldest = min(h.since for h in self._users.values())
        return max(0.0, oldest + self.max_hold_s - now)
