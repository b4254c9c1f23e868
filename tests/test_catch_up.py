"""The catch-up estimate a user reads to know when memory is current: a backlog shows, then drains to zero."""

from __future__ import annotations

from streams.lag import CatchUpEstimator


def test_a_backlog_is_visible_then_drains() -> None:
    estimator = CatchUpEstimator()
    first = estimator.update("chat", committed=0, backlog=100, now=0.0)
    assert first.backlog == 100 and first.seconds is None  # no rate yet: not "0 s", unknown
    draining = estimator.update("chat", committed=40, backlog=60, now=10.0)  # 4 records/s
    assert draining.rate_per_s == 4.0 and draining.seconds == 15.0
    stalled = estimator.update("chat", committed=40, backlog=70, now=20.0)  # nothing committed: no estimate
    assert stalled.seconds is None
    caught_up = estimator.update("chat", committed=110, backlog=0, now=25.0)
    assert caught_up.backlog == 0 and caught_up.seconds == 0.0 and caught_up.rate_per_s == 14.0


def test_topics_are_estimated_apart() -> None:
    estimator = CatchUpEstimator()
    estimator.update("chat", committed=0, backlog=10, now=0.0)
    estimator.update("docs", committed=0, backlog=10, now=0.0)
    assert estimator.update("chat", committed=10, backlog=0, now=1.0).rate_per_s == 10.0
    assert estimator.update("docs", committed=1, backlog=9, now=1.0).seconds == 9.0
