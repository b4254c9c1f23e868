"""The retriever interface: every traversal (BeamSearch, WaterCircles, A*, flat, ToG-2, PGraphRAG) implements it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from services.domain import Triplet, VertexKind


class RetrievalRequest(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)

    user_id: str
    query: str
    query_vector: list[float] | None = None
    seeds: list[str] = Field(default_factory=list, description="matched object-vertex ids to start from")
    as_of: datetime | None = Field(default=None, description="keep theses valid at this time; None: valid now")
    budget: int = Field(default=20, ge=1, description="at most this many triplets returned")
    context_kinds: frozenset[VertexKind] = frozenset({VertexKind.OBJECT, VertexKind.THESIS})
    params: dict[str, Any] = Field(default_factory=dict)


class Retriever(ABC):
    name: str

    @abstractmethod
    async def retrieve(self, request: RetrievalRequest) -> list[Triplet]:
        """Best first, at most ``request.budget`` triplets, all of ``request.user_id``."""
