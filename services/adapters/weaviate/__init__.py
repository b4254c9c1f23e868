"""Weaviate adapter: vector and BM25 search over vertex and triplet texts, one tenant per user (weaviate-client v4)."""

from .store import VectorWriteError, WeaviateVectorStore

__all__ = ["VectorWriteError", "WeaviateVectorStore"]
