"""Conversation file loaders: turn LoCoMo JSON and a simple JSONL chat format into chat-message events."""

from services.ingest.loaders import LoaderError, load_conversation

__all__ = ["LoaderError", "load_conversation"]
