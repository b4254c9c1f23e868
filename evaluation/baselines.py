"""Baselines in the same run: flat RAG over the raw messages/paragraphs, and no retrieval at all.

Flat RAG indexes each event's episode (what memorize would store as the raw text) in its own store, without any
extraction, and answers with the simple QA path: the same answer prompt, model and context size (``qa_top_k``),
fused dense + BM25 search over the raw texts only. No retrieval asks the same prompt with an empty memory."""

from __future__ import annotations

from collections.abc import Sequence

from evaluation.datasets import MemoryEvent
from schemas.events import Answer, AnswerStatus, Query
from services import ids
from services.adapters.sqlite import SqliteMemoryStore
from services.domain import VertexKind
from services.llm.scope import llm_scope
from services.llm.task import TaskFailed, run_task
from services.memorize.builder import ChangeSetBuilder
from services.memorize.service import _units
from services.ports import LLM, Embedder, VectorItem
from services.qa.simple import AnswerInput, AnswerTask


async def index_raw(
    store: SqliteMemoryStore, embedder: Embedder, events: Sequence[MemoryEvent], chunk_chars: int, batch: int = 64
) -> int:
    """Write every not yet indexed event as episodes with their vectors; returns how many were written."""
    written = 0
    by_user: dict[str, list[MemoryEvent]] = {}
    for event in events:
        by_user.setdefault(event.user_id, []).append(event)
    for user_id, user_events in by_user.items():
        seen = await store.seen_events(user_id, [e.event_id for e in user_events])
        fresh = [e for e in user_events if e.event_id not in seen]
        for start in range(0, len(fresh), batch):
            chunk = fresh[start : start + batch]
            event_ids = [e.event_id for e in chunk]
            builder = ChangeSetBuilder(user_id, ids.change_set_id(user_id, event_ids), event_ids)
            for event in chunk:
                for unit in _units(event, chunk_chars):
                    builder.add(unit.source, None)
            change_set = builder.build(0)
            episodes = [v for v in change_set.vertices if v.kind is VertexKind.EPISODIC]
            vectors = await embedder.embed([v.name[:2000] for v in episodes])
            items = [
                VectorItem(id=v.id, kind=v.kind.value, text=v.name[:2000], vector=list(vec))
                for v, vec in zip(episodes, vectors, strict=True)
            ]
            await store.apply(change_set, items)
            written += len(chunk)
    return written


class NoRetrieval:
    """The answer prompt with nothing in memory: what the model says on its own."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.task = AnswerTask()

    async def answer(self, query: Query, emit: object = None) -> Answer:
        status, text, error, calls = AnswerStatus.NO_ANSWER, "No answer", None, 0
        with llm_scope(query.user_id):
            try:
                result = await run_task(self.llm, self.task, AnswerInput(query.question, []))
            except TaskFailed as exc:
                status, text, error = AnswerStatus.ERROR, "", str(exc)
            else:
                calls = result.calls
                if result.value.found:
                    status, text = AnswerStatus.ANSWERED, result.value.answer
        return Answer.to(query, answer=text, status=status, llm_calls=calls, error=error)
