"""Whether the model's contradiction verdicts are worth asking for, learned from its own control answers.

``resolve_check`` puts two control pairs with known answers into every call; a call whose controls come back wrong
acts on nothing (``services/memorize/resolve_check.py``). A model that fails them call after call (the default
1.5B model failed every one measured: ``docs/benchmarks.md``, "Contradiction verdicts") makes ``resolve`` and its
check two calls a batch that change nothing (0.19 of the 0.36 calls a turn on whole LoCoMo conversations).
So after ``after`` such calls in a row the pairs are not sent for ``skip`` batches, then sent once more: a check
whose controls come back right trusts the model again. Skipping keeps both statements of every pair, what the
failed controls would have done; the skipped pairs are counted (``memstream_resolve_pairs_total{verdict=
"skipped_untrusted"}``) and each change of mind is logged. The state is the process's, about the model, not about
any user: nothing of one user's memory decides what is asked about another's beyond this one yes or no.
"""

from __future__ import annotations

from dataclasses import dataclass

from services import metrics
from services.logging import get_logger

log = get_logger(__name__)


@dataclass
class VerdictTrust:
    """``after`` failed control calls in a row -> skip the next ``skip`` batches with pairs, then ask again.
    ``after`` 0: always ask."""

    after: int = 3
    skip: int = 20
    failed_in_a_row: int = 0
    skipping: int = 0  # batches with pairs still to skip

    def ask(self, pairs: int) -> bool:
        """Whether a batch with ``pairs`` candidate pairs goes to the model; a skipped one is counted."""
        if self.skipping <= 0:
            return True
        self.skipping -= 1
        metrics.RESOLVE_VERDICTS.labels("skipped_untrusted").inc(pairs)
        return False

    def controls(self, right: bool) -> None:
        """Record one check call's controls: answered right or not."""
        if right:
            if self.failed_in_a_row >= self.after > 0:
                log.info("resolve_trusted_again", failed_before=self.failed_in_a_row)
            self.failed_in_a_row = 0
            return
        self.failed_in_a_row += 1
        if self.after > 0 and self.failed_in_a_row >= self.after:
            self.skipping = self.skip
            log.info("resolve_untrusted_skipping", failed_in_a_row=self.failed_in_a_row, batches=self.skip)
