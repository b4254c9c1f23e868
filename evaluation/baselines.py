"""Baselines in the same run: flat RAG over the raw messages/paragraphs, full context, and no retrieval at all.

Flat RAG indexes each event's episode (what memorize would store as the raw text) in its own store, without any
extraction, and answers with the simple QA path: the same answer prompt, model and context size (``qa_top_k``),
fused dense + BM25 search over the raw texts only. Full context asks the same prompt with every raw event of the
question's user as its memory, only where that prompt fits the model; no retrieval asks it with an empty memory."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime

from evaluation.datasets import MemoryEvent
from schemas.events import Answer, AnswerStatus, ChatMessage, Query
from services import ids
from services.adapters.sqlite import SqliteMemoryStore
from services.domain import Vertex, VertexKind
from services.llm.scope import llm_scope
from services.llm.task import TaskFailed, run_task
from services.memorize.builder import ChangeSetBuilder
from services.memorize.service import _units
from services.ports import LLM, Embedder, VectorItem
from services.qa.simple import AnswerInput, AnswerTask
from services.qa.streaming import streamed


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


#: Characters per token of the prompt estimate. English BPE tokenizers average about four; three over-counts on
#: purpose, so that a prompt said to fit does fit the model's window (no tokenizer call per question, and one
#: estimate for every backend: llama.cpp, Ollama, the scripted LLM).
CHARS_PER_TOKEN = 3
#: the chat template's tokens around each message (role markers), counted on top of its text
TOKENS_PER_MESSAGE = 8


def estimate_tokens(texts: Sequence[str]) -> int:
    """A conservative token count of a prompt made of ``texts`` (see ``CHARS_PER_TOKEN``)."""
    return sum(-(-len(t) // CHARS_PER_TOKEN) + TOKENS_PER_MESSAGE for t in texts)


class PromptOnly:
    """The simple QA's answer prompt over a memory the baseline chooses (no retrieval): one call, same model."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.task = AnswerTask()

    def memory(self, query: Query) -> list[Vertex]:
        return []

    def prompt_tokens(self, query: Query) -> int:
        """The estimated size of the prompt this baseline sends for ``query``."""
        return estimate_tokens([m.content for m in self.task.messages(AnswerInput(query.question, self.memory(query)))])

    async def answer(self, query: Query, emit: object = None, on_text: Callable[[str], None] | None = None) -> Answer:
        status, text, error, calls = AnswerStatus.NO_ANSWER, "No answer", None, 0
        with llm_scope(query.user_id):
            try:
                inputs = AnswerInput(query.question, self.memory(query))
                result = await run_task(self.llm, self.task, inputs, on_text=streamed(on_text))
            except TaskFailed as exc:
                status, text, error = AnswerStatus.ERROR, "", str(exc)
            else:
                calls = result.calls
                if result.value.found:
                    status, text = AnswerStatus.ANSWERED, result.value.answer
        return Answer.to(query, answer=text, status=status, llm_calls=calls, error=error)


class NoRetrieval(PromptOnly):
    """The answer prompt with nothing in memory: what the model says on its own."""


def _raw_line(event: MemoryEvent) -> Vertex:
    """An event as one memory line: a chat turn with its date and speaker, a document whole with its title."""
    date = event.event_time.date().isoformat()
    if isinstance(event, ChatMessage):
        text = f"[{date}] {event.speaker}: {event.text}"
    else:
        text = f"[{date}] document" + (f' "{event.title}"' if event.title else "") + f": {event.text}"
    return Vertex(id=event.event_id, user_id=event.user_id, kind=VertexKind.EPISODIC, name=text)


class FullContext(PromptOnly):
    """The answer prompt with every raw event of the question's user, in time order, as its memory.

    Only where it fits: ``available`` is the model's window less the answer's room; a larger prompt is never sent
    cut (a truncated context passed off as the full one), the harness records the question as skipped instead."""

    def __init__(self, llm: LLM, events: Sequence[MemoryEvent], context_tokens: int) -> None:
        super().__init__(llm)
        self.available = context_tokens - self.task.max_tokens
        by_user: dict[str, list[MemoryEvent]] = {}
        for event in events:
            by_user.setdefault(event.user_id, []).append(event)
        # documents share one fixed time: the sort is stable, so they keep the dataset's order
        self.lines = {
            user: [_raw_line(e) for e in sorted(user_events, key=_time)] for user, user_events in by_user.items()
        }

    def memory(self, query: Query) -> list[Vertex]:
        return self.lines.get(query.user_id, [])

    def fits(self, query: Query) -> bool:
        return self.prompt_tokens(query) <= self.available


def _time(event: MemoryEvent) -> datetime:
    return event.event_time
