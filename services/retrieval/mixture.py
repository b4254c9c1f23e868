"""Mixture: the union of several retrievers' contexts, interleaved best-first and deduplicated."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from services.domain import Triplet
from services.retrieval.base import RetrievalRequest, Retriever
from services.retrieval.common import interleave, take


class Mixture(Retriever):
    """Runs its members concurrently on the same request; takes their results in turn (first of each, then
    second of each...) so no member crowds out the others, dropping repeats, up to the budget."""

    def __init__(self, members: Sequence[Retriever]) -> None:
        if not members:
            raise ValueError("a mixture needs at least one retriever")
        self.members = list(members)
        self.name = "+".join(m.name for m in self.members)

    async def retrieve(self, request: RetrievalRequest) -> list[Triplet]:
        results = await asyncio.gather(*(m.retrieve(request) for m in self.members))
        return take(interleave(results), request.budget)
