"""Versioned event contracts.

Every event carries a schema version, an idempotency key (``event_id``), the tenant (``user_id``), the time the
thing happened (``event_time``) and the time memstream received it (``ingest_time``). Events are validated where
they enter (gateway, CLI, topic deserialisation), held to the limits of ``schemas.validation``; anything that fails
goes to the dead-letter topic with a reason.
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, model_validator

from schemas.validation import Timestamp, valid_name, valid_text

SCHEMA_VERSION: Literal[1] = 1

Identifier = Annotated[
    str, StringConstraints(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:@/+=-]*$")
]
UserId = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:@-]*$")]
Text = Annotated[str, StringConstraints(min_length=1, max_length=200_000), AfterValidator(valid_text)]
ChatText = Annotated[str, StringConstraints(min_length=1, max_length=20_000), AfterValidator(valid_text)]
Question = Annotated[str, StringConstraints(min_length=1, max_length=4_000), AfterValidator(valid_text)]
Speaker = Annotated[str, StringConstraints(min_length=1, max_length=200), AfterValidator(valid_name)]
Title = Annotated[str, StringConstraints(max_length=1_000), AfterValidator(valid_name)]
Platform = Annotated[str, StringConstraints(max_length=64), AfterValidator(valid_name)]
Label = Annotated[str, StringConstraints(max_length=200), AfterValidator(valid_name)]


def utcnow() -> datetime:
    return datetime.now(UTC)


class Event(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1] = SCHEMA_VERSION
    event_id: Identifier = Field(description="Idempotency key: replaying an event with the same id changes nothing.")
    user_id: UserId = Field(description="Tenant: every read and write is scoped to it.")
    event_time: Timestamp = Field(description="When it was said or written (the world's clock).")
    ingest_time: Timestamp = Field(default_factory=utcnow, description="When memstream received it.")


class ChatMessage(Event):
    kind: Literal["chat_message"] = "chat_message"
    conversation_id: Identifier = "default"
    speaker: Speaker
    text: ChatText
    platform: Platform | None = None


class Document(Event):
    kind: Literal["document"] = "document"
    document_id: Identifier
    title: Title | None = None
    text: Text


class MemoryUpdate(Event):
    """One committed change set: emitted only after the store write succeeded. At-least-once: after a crash it is
    emitted again, the same record with the same ``event_id`` (the change set id), so consumers dedupe on it."""

    kind: Literal["memory_update"] = "memory_update"
    change_set_id: str
    source_event_ids: list[str]
    vertices_added: int = 0
    edges_added: int = 0
    theses_added: int = 0
    theses_invalidated: int = 0
    llm_calls: int = 0
    committed_at: Timestamp = Field(default_factory=utcnow)


class ForgetScope(StrEnum):
    MESSAGE = "message"  # one chat message: ``target`` is its event id
    DOCUMENT = "document"  # every event of one document: ``target`` is its document id
    CONVERSATION = "conversation"  # every message of one conversation: ``target`` is its conversation id
    USER = "user"  # the user's whole memory: no ``target``


class Forget(Event):
    """A tombstone: forget what the user said or wrote, and everything memory derived from it alone.

    It travels on the topic of what it forgets (chat: messages, conversations; documents: documents; a user: both),
    keyed by the user, so every worker applies it in order with that user's other events: what was accepted before
    it is forgotten, what comes after is new memory. Its ``event_id`` is the forget id."""

    kind: Literal["forget"] = "forget"
    scope: ForgetScope
    target: Identifier | None = Field(default=None, description="Event, document or conversation id; none for a user.")

    @model_validator(mode="after")
    def _target_matches_scope(self) -> Forget:
        if (self.scope is ForgetScope.USER) != (self.target is None):
            raise ValueError("a user forget names no target; a message, document or conversation forget names one")
        return self


class MemoryForgotten(Event):
    """A forget applied by the store: emitted on the memory-update topic after the erasure committed, so readers
    that keep derived copies (answers, traces, dead letters) drop theirs. ``event_id`` is the forget id; a replay
    emits the same record again."""

    kind: Literal["memory_forgotten"] = "memory_forgotten"
    forget_id: str
    source_topic: str = Field(description="The topic its tombstone came on (a user forget comes on two).")
    scope: ForgetScope
    target: str | None = None
    removed_all: bool = Field(default=False, description="The user's whole memory went (removed_ids not listed).")
    source_event_ids: list[str] = Field(default_factory=list, description="The events whose memory was erased.")
    removed_ids: list[str] = Field(default_factory=list, description="Vertex and edge ids no longer in memory.")
    vertices_removed: int = 0
    edges_removed: int = 0
    theses_restored: int = Field(default=0, description="Theses a removed thesis had invalidated: valid again.")
    theses_rewritten: int = Field(
        default=0,
        description="Facts written again in a remaining source's own words (a forgotten one had worded them).",
    )
    cache_entries_removed: int = 0
    committed_at: Timestamp = Field(default_factory=utcnow)


class QueryOptions(BaseModel):
    """Per-query switches, mostly the paper's ablations. ``None`` means: use the configured default."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    retriever: Label | None = None
    plan_enhancement: bool | None = None
    decomposition: bool | None = None
    infer_answers: bool | None = Field(
        default=None, description='"would X ...?" answered by inference from memory (MEMSTREAM_QA_INFER_ANSWERS)'
    )
    near_match_clues: bool | None = Field(
        default=None,
        description="fast engine's rounds: an exactly matched name's near matches substituted too "
        "(MEMSTREAM_QA_NEAR_MATCH_CLUES)",
    )
    max_rounds: int | None = Field(
        default=None, ge=0, le=4, description="fast engine: planning rounds at most (MEMSTREAM_QA_MAX_ROUNDS)"
    )
    chain_context: bool | None = Field(
        default=None,
        description="fast engine: the first answer's lines grouped along the question's chain "
        "(MEMSTREAM_QA_CHAIN_CONTEXT)",
    )
    first_link: bool | None = Field(
        default=None,
        description="fast engine with the chain: the question's first link asked on its own, the rest of the link's "
        "answer (MEMSTREAM_QA_FIRST_LINK)",
    )
    max_clue_queries: int | None = Field(default=None, ge=1, le=8)
    max_steps: int | None = Field(default=None, ge=1, le=12)
    episodic_context: bool | None = None
    filter_top_k: int | None = Field(
        default=None, ge=1, le=50, description="memory items shown to the model per retrieval (MEMSTREAM_QA_TOP_K)"
    )


class Query(Event):
    kind: Literal["query"] = "query"
    question: Question
    as_of: Timestamp | None = Field(default=None, description="Answer with what was valid at this time.")
    options: QueryOptions = QueryOptions()

    @property
    def query_id(self) -> str:
        return self.event_id


class StageStatus(StrEnum):
    OK = "ok"
    EMPTY = "empty"
    ERROR = "error"
    SKIPPED = "skipped"


class StageEvent(Event):
    kind: Literal["stage_event"] = "stage_event"
    query_id: str
    trace_id: str
    stage: int = Field(ge=1, le=13)
    stage_name: str
    sub_question_id: str | None = None
    step_id: str | None = None
    clue_query_id: str | None = None
    started_at: Timestamp
    duration_ms: float = Field(ge=0)
    llm_calls: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    vertices: int = 0
    triplets: int = 0
    status: StageStatus = StageStatus.OK
    detail: dict[str, object] = Field(default_factory=dict)


class AnswerStatus(StrEnum):
    ANSWERED = "answered"
    NO_ANSWER = "no_answer"
    ERROR = "error"
    CANCELLED = "cancelled"


class EvidenceTriplet(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str
    text: str
    kind: str = "relation"


class PlanStep(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    sub_question_id: str
    text: str
    answer: str | None = None
    revision: int = 0


class SubAnswer(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    question: str
    answer: str
    status: AnswerStatus


class Answer(Event):
    kind: Literal["answer"] = "answer"
    query_id: str
    trace_id: str
    question: str
    answer: str
    status: AnswerStatus
    sub_answers: list[SubAnswer] = Field(default_factory=list)
    evidence: list[EvidenceTriplet] = Field(default_factory=list)
    plan: list[PlanStep] = Field(default_factory=list)
    plan_history: list[list[PlanStep]] = Field(default_factory=list)
    duration_ms: float = 0.0
    llm_calls: int = 0
    error: str | None = None

    @classmethod
    def to(cls, query: Query, *, trace_id: str | None = None, **fields: Any) -> Answer:
        """The answer to ``query``: its ids, user, time and question, and ``fields``."""
        return cls(
            event_id=f"ans_{query.query_id}",
            user_id=query.user_id,
            event_time=query.event_time,
            query_id=query.query_id,
            trace_id=trace_id or f"tr_{query.query_id}",
            question=query.question,
            **fields,
        )


class AnswerText(Event):
    """The answer's text so far, while the model writes it (on the answer-text topic). ``text`` is whole, not a
    delta: a lost or repeated event never garbles what a reader shows, and a retried call starts again from "".
    The ``Answer`` event that follows is the answer; these are only its preview."""

    kind: Literal["answer_text"] = "answer_text"
    query_id: str
    seq: int = Field(ge=1, description="Orders one query's text events: a reader keeps the highest seen.")
    text: str


class QueryCancel(Event):
    """Stop answering a query (on the query-control topic): its asker deleted it, or went away."""

    kind: Literal["query_cancel"] = "query_cancel"
    query_id: str
    reason: Literal["deleted", "disconnected"]

    @classmethod
    def of(cls, query_id: str, user_id: str, reason: Literal["deleted", "disconnected"]) -> QueryCancel:
        now = utcnow()
        return cls(event_id=f"cancel_{query_id}", user_id=user_id, event_time=now, query_id=query_id, reason=reason)


class DeadLetter(BaseModel):
    """An input that could not be processed, kept with the reason. ``user_id`` may be unknown for garbage input."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1] = SCHEMA_VERSION
    kind: Literal["dead_letter"] = "dead_letter"
    event_id: str
    user_id: str | None = None
    source_topic: str
    reason: str = Field(description="Machine-readable: invalid_event, extraction_failed, store_failed, ...")
    error: str
    payload: str = Field(description="The original bytes, decoded as UTF-8 with replacement, cut if huge.")
    payload_bytes: int | None = Field(default=None, description="Size of the original bytes; more: payload cut.")
    failed_event_ids: list[str] = Field(default_factory=list)
    attempts: int = 1
    ingest_time: Timestamp = Field(default_factory=utcnow)


CONTRACTS: dict[str, type[BaseModel]] = {
    "chat_message": ChatMessage,
    "document": Document,
    "memory_update": MemoryUpdate,
    "forget": Forget,
    "memory_forgotten": MemoryForgotten,
    "query": Query,
    "stage_event": StageEvent,
    "answer": Answer,
    "answer_text": AnswerText,
    "query_cancel": QueryCancel,
    "dead_letter": DeadLetter,
}
