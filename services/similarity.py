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
