"""Holding interleaved users' events until each user's batch is full (or has waited long enough)."""

from __future__ import annotations

from streams.holdback import Holdback


def test_a_full_batch_is_released_at_once_and_partial_ones_wait() -> None:
    hold: Holdback[str] = Holdback(batch=3, max_hold_s=5.0, max_held=100)
    for n in range(3):
        hold.add(b"anna", f"a{n}", now=0.0)
    for n in range(2):
        hold.add(b"ben", f"b{n}", now=0.0)
    assert hold.release(now=1.0) == ["a0", "a1", "a2"]
    assert hold.held == 2 and hold.wait_s(now=1.0) == 4.0


def test_a_partial_batch_goes_when_its_oldest_event_waited_max_hold() -> None:
    hold: Holdback[str] = Holdback(batch=8, max_hold_s=5.0, max_held=100)
    hold.add(b"ben", "b0", now=0.0)
    hold.add(b"ben", "b1", now=4.0)
    assert hold.release(now=4.9) == []
    assert hold.release(now=5.0) == ["b0", "b1"]  # together and in order
    assert hold.wait_s(now=5.0) is None


def test_too_many_held_releases_the_oldest_users_first() -> None:
    hold: Holdback[str] = Holdback(batch=8, max_hold_s=60.0, max_held=8)
    for user in range(5):
        for n in range(2):
            hold.add(f"u{user}".encode(), f"u{user}-{n}", now=float(user))
    released = hold.release(now=5.0)
    assert released == ["u0-0", "u0-1"] and hold.held == 8


def test_interleaved_users_fill_their_batches() -> None:
    hold: Holdback[str] = Holdback(batch=8, max_hold_s=60.0, max_held=1000)
    batches = []
    for n in range(8):  # 20 users, one message each per round, as a platform delivers them
        for user in range(20):
            hold.add(f"u{user}".encode(), f"u{user}-{n}", now=float(n))
        released = hold.release(now=float(n))
        if released:
            batches.append(released)
    assert len(batches) == 1 and len(batches[0]) == 160
