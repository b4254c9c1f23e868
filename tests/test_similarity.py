"""``best_cosines`` is ``cosine`` over a matrix: the QA filter's scores must not move when it is computed at once."""

from __future__ import annotations

import numpy as np
import pytest

from services.similarity import best_cosines, cosine


def test_best_cosines_is_the_highest_pairwise_cosine() -> None:
    rng = np.random.default_rng(1)
    rows = [*rng.standard_normal((12, 8)).tolist(), [0.0] * 8]  # a zero vector scores 0, as ``cosine`` gives
    targets = rng.standard_normal((2, 8)).tolist()
    want = [max(cosine(t, r) for t in targets) for r in rows]
    assert best_cosines(rows, targets) == pytest.approx(want, abs=1e-12)
    assert best_cosines(rows, targets)[-1] == 0.0


def test_best_cosines_without_targets_or_rows() -> None:
    assert best_cosines([[1.0, 0.0], [0.0, 1.0]], []) == [1.0, 1.0]  # no target: every row kept, as before
    assert best_cosines([], [[1.0, 0.0]]) == []
