"""Dgraph adapter: the memory graph, the applied-event log and the LLM cache on a Dgraph cluster (pydgraph)."""

from .store import DgraphGraphStore, schema_text

__all__ = ["DgraphGraphStore", "schema_text"]
