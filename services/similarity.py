"""Cosine similarity of two vectors, for the comparisons made outside a vector index (names being merged, facts
of one memorize batch, the QA filter's triplets)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    # numpy: the QA filter scores every kept triplet against two targets per step, on the answer's path
    va, vb = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    norm = float(np.linalg.norm(va) * np.linalg.norm(vb))
    return float(va @ vb) / norm if norm else 0.0


def best_cosines(rows: Sequence[Sequence[float]], targets: Sequence[Sequence[float]]) -> list[float]:
    """Each row's highest cosine to any of ``targets`` (1.0 with no target): ``cosine`` over a whole matrix at once
    (the QA filter scores about 20 triplets against two targets per clue-query; one pair at a time was 7 ms of a
    question at 1M triplets)."""
    if not targets:
        return [1.0] * len(rows)
    if not rows:
        return []
    matrix, wanted = np.asarray(rows, dtype=np.float64), np.asarray(targets, dtype=np.float64)
    norms = np.outer(np.linalg.norm(matrix, axis=1), np.linalg.norm(wanted, axis=1))
    dots = matrix @ wanted.T
    safe = np.where(norms > 0, norms, 1.0)
    return np.where(norms > 0, dots / safe, 0.0).max(axis=1).tolist()
