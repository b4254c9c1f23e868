"""Retrievers by name: ``get_retriever("beamsearch", graph, vectors, embedder, beam_width=5)``.

Names: beamsearch, watercircles, astar, flat (flat_dense, flat_lexical), bfs (the unscored baseline), tog2,
pgraphrag (pgraphrag_user, pgraphrag_neighbor), and mixtures: "mixture" (beamsearch + watercircles, PersonalAI's
default pair) or any names joined by "+", e.g. "beamsearch+flat". A mixture passes each member the params its model
knows, plus those nested under the member's name (``beamsearch={"depth": 2}``); a param no member knows is an error.
"""

from __future__ import annotations

from typing import Any

from services.ports import Embedder, GraphStore, VectorStore
from services.retrieval.astar import AStar
from services.retrieval.base import Retriever
from services.retrieval.beamsearch import BeamSearch
from services.retrieval.bfs import BFS
from services.retrieval.common import GraphRetriever
from services.retrieval.flat import Flat
from services.retrieval.mixture import Mixture
from services.retrieval.pgraphrag import PGraphRAG
from services.retrieval.tog2 import ToG2
from services.retrieval.watercircles import WaterCircles

# name -> (class, preset params)
RETRIEVERS: dict[str, tuple[type[GraphRetriever], dict[str, Any]]] = {
    "beamsearch": (BeamSearch, {}),
    "watercircles": (WaterCircles, {}),
    "astar": (AStar, {}),
    "flat": (Flat, {}),
    "flat_dense": (Flat, {"mode": "dense"}),
    "flat_lexical": (Flat, {"mode": "lexical"}),
    "bfs": (BFS, {}),
    "tog2": (ToG2, {}),
    "pgraphrag": (PGraphRAG, {"mode": "both"}),
    "pgraphrag_user": (PGraphRAG, {"mode": "user"}),
    "pgraphrag_neighbor": (PGraphRAG, {"mode": "neighbor"}),
}
DEFAULT_MIXTURE = ("beamsearch", "watercircles")
# constructor arguments that are not tuning params
_CONSTRUCTOR_ARGS: dict[type[GraphRetriever], set[str]] = {PGraphRAG: {"shared_tenants"}}


def available() -> list[str]:
    return [*RETRIEVERS, "mixture"]


def get_retriever(
    name: str, graph: GraphStore, vectors: VectorStore, embedder: Embedder | None = None, **params: Any
) -> Retriever:
    names = list(DEFAULT_MIXTURE) if name == "mixture" else [n.strip() for n in name.split("+")]
    unknown = [n for n in names if n not in RETRIEVERS]
    if unknown:
        raise ValueError(f"unknown retriever(s) {unknown}; available: {available()}")
    if len(names) == 1:
        return _build(names[0], graph, vectors, embedder, params)
    used: set[str] = set(names)
    members = []
    for n in names:
        mine = {k: v for k, v in params.items() if k in _accepted(n)}
        mine.update(params.get(n) or {})
        used.update(mine)
        members.append(_build(n, graph, vectors, embedder, mine))
    stray = set(params) - used
    if stray:
        raise ValueError(f"no retriever of {names} takes {sorted(stray)}")
    return Mixture(members)


def _accepted(name: str) -> set[str]:
    cls, _ = RETRIEVERS[name]
    return set(cls.params_model.model_fields) | _CONSTRUCTOR_ARGS.get(cls, set())


def _build(
    name: str, graph: GraphStore, vectors: VectorStore, embedder: Embedder | None, params: dict[str, Any]
) -> GraphRetriever:
    cls, preset = RETRIEVERS[name]
    retriever = cls(graph, vectors, embedder, **{**preset, **params})
    retriever.name = name
    return retriever
