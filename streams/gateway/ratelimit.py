"""Per-credential rate limits on writes and questions: a token bucket per credential and kind, in the gateway
process (each gateway process counts on its own).

A bucket holds at most a minute's allowance and refills continuously. A request is let through while the bucket
holds at least one token and takes what it costs (a batch of messages may take the bucket below zero, so any batch
the body limit allows can pass); a request that finds less gets 429 with ``Retry-After``: the seconds until there
is one again.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import HTTPException
from prometheus_client import Counter

RATE_LIMITED = Counter("memstream_gateway_rate_limited_total", "Requests refused by a rate limit", ["kind"])

#: buckets kept at most; the fullest (idle) go first
MAX_BUCKETS = 100_000


@dataclass
class _Bucket:
    tokens: float
    at: float


class RateLimiter:
    """``per_min`` maps a kind (``write``, ``question``) to its allowance a minute; 0 or absent: no limit."""

    def __init__(self, per_min: dict[str, int], clock: Callable[[], float] = time.monotonic) -> None:
        self.per_min = per_min
        self.clock = clock
        self._buckets: dict[tuple[str, str], _Bucket] = {}

    def take(self, credential: str, kind: str, cost: int = 1) -> None:
        """Count ``cost`` against the credential's bucket, or raise a 429 ``HTTPException``."""
        allowance = self.per_min.get(kind, 0)
        if allowance <= 0:
            return
        rate, now = allowance / 60.0, self.clock()
        bucket = self._buckets.get((credential, kind))
        if bucket is None:
            if len(self._buckets) >= MAX_BUCKETS:
                self._buckets.clear()  # a full bucket is what a forgotten one becomes anyway
            bucket = self._buckets[(credential, kind)] = _Bucket(float(allowance), now)
        bucket.tokens = min(float(allowance), bucket.tokens + (now - bucket.at) * rate)
        bucket.at = now
        if bucket.tokens < 1:
            RATE_LIMITED.labels(kind=kind).inc()
            retry_after = max(1, math.ceil((1 - bucket.tokens) / rate))
            raise HTTPException(
                status_code=429,
                detail=f"rate limit: at most {allowance} {kind}s a minute for this credential; retry in {retry_after}s",
                headers={"Retry-After": str(retry_after)},
            )
        bucket.tokens -= cost
