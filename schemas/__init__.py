"""Event contracts of memstream: the only shapes that cross a topic or the gateway."""

from schemas.events import (
    SCHEMA_VERSION,
    Answer,
    AnswerStatus,
    ChatMessage,
    DeadLetter,
    Document,
    EvidenceTriplet,
    MemoryUpdate,
    PlanStep,
    Query,
    QueryOptions,
    StageEvent,
    StageStatus,
    SubAnswer,
)

__all__ = [
    "SCHEMA_VERSION",
    "Answer",
    "AnswerStatus",
    "ChatMessage",
    "DeadLetter",
    "Document",
    "EvidenceTriplet",
    "MemoryUpdate",
    "PlanStep",
    "Query",
    "QueryOptions",
    "StageEvent",
    "StageStatus",
    "SubAnswer",
]
