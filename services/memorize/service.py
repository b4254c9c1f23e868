"""Memorize: chat messages and documents -> PersonalAI memory graph, incrementally and idempotently.

Per user (events of one user stay in order), already-applied events are skipped, the rest are packed into
extraction calls (several messages per call, bounded by a token budget), the output becomes one change set per
group of events, and the change set plus its vectors are written in one store call. A group whose extraction
still fails after bounded retries is split in halves so one poisonous message cannot take its neighbours down;
a single event that fails becomes a dead letter with the reason.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from tenacity import AsyncRetrying, stop_after_attempt, wait_exponential

from schemas.events import ChatMessage, DeadLetter, Document, MemoryUpdate
from services import ids, metrics
from services.domain import ChangeSet, EdgeKind, VertexKind
from services.llm.task import TaskFailed, run_task
from services.logging import get_logger
from services.memorize.builder import ChangeSetBuilder, KnownRef, Source
from services.memorize.chunking import chunk_text
from services.memorize.extraction import ExtractionInput, ExtractTask, Item, KnownThesis, MessageOut
from services.ports import LLM, Embedder, MemoryStore, VectorItem
from services.settings import Settings

log = get_logger(__name__)
MemoryEvent = ChatMessage | Document
_EXTRACT = ExtractTask()


@dataclass
class MemorizeOutcome:
    updates: list[MemoryUpdate] = field(default_factory=list)
    dead_letters: list[DeadLetter] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    llm_calls: int = 0


@dataclass
class _Unit:
    """One extraction item with its provenance."""

    event: MemoryEvent
    source: Source
    item: Item


def _units(event: MemoryEvent, chunk_chars: int) -> list[_Unit]:
    if isinstance(event, ChatMessage):
        props = {"speaker": event.speaker, "conversation_id": event.conversation_id, "event_id": event.event_id}
        if event.platform:
            props["platform"] = event.platform
        text = f"{event.speaker}: {event.text}"
        source = Source(event.event_id, 0, text, event.event_time, event.ingest_time, props)
        return [_Unit(event, source, Item(event.speaker, event.text, event.event_time))]
    units = []
    for n, chunk in enumerate(chunk_text(event.text, chunk_chars)):
        props = {"document_id": event.document_id, "event_id": event.event_id, "chunk": str(n)}
        if event.title:
            props["title"] = event.title
        source = Source(event.event_id, n, chunk, event.event_time, event.ingest_time, props)
        units.append(_Unit(event, source, Item(event.title, chunk, event.event_time)))
    return units


def _tokens(text: str) -> int:
    return len(text) // 4 + 8


class MemorizeService:
    def __init__(self, store: MemoryStore, llm: LLM, embedder: Embedder, settings: Settings) -> None:
        self.store = store
        self.llm = llm
        self.embedder = embedder
        self.settings = settings

    async def memorize(self, events: Sequence[MemoryEvent], source_topic: str = "memorize") -> MemorizeOutcome:
        outcome = MemorizeOutcome()
        by_user: OrderedDict[str, dict[str, MemoryEvent]] = OrderedDict()
        for event in events:
            by_user.setdefault(event.user_id, {}).setdefault(event.event_id, event)
        for user_id, user_events in by_user.items():
            seen = await self.store.seen_events(user_id, list(user_events))
            outcome.skipped.extend(sorted(seen))
            for event_id in seen:
                metrics.MEMORIZE_EVENTS.labels(kind=user_events[event_id].kind, outcome="duplicate").inc()
            fresh = [e for e in user_events.values() if e.event_id not in seen]
            for group in self._groups(fresh):
                await self._memorize_group(user_id, group, outcome, source_topic)
        return outcome

    def _groups(self, events: list[MemoryEvent]) -> list[list[MemoryEvent]]:
        """Pack whole events into groups within the batch limits; a change set never splits an event."""
        groups: list[list[MemoryEvent]] = []
        size = 0
        for event in events:
            tokens = _tokens(event.text)
            if (
                groups
                and len(groups[-1]) < self.settings.batch_max_messages
                and (size + tokens <= self.settings.batch_token_budget)
            ):
                groups[-1].append(event)
                size += tokens
            else:
                groups.append([event])
                size = tokens
        return groups

    async def _memorize_group(
        self, user_id: str, events: list[MemoryEvent], outcome: MemorizeOutcome, source_topic: str
    ) -> None:
        units = [u for e in events for u in _units(e, self.settings.document_chunk_chars)]
        try:
            outs, known, calls = await self._extract(user_id, units)
        except TaskFailed as exc:
            outcome.llm_calls += exc.attempts
            metrics.EXTRACTION_FAILURES.labels(reason="invalid_output").inc()
            if len(events) > 1:
                half = len(events) // 2
                log.warning("extraction_failed_splitting", user_id=user_id, events=len(events), error=str(exc))
                await self._memorize_group(user_id, events[:half], outcome, source_topic)
                await self._memorize_group(user_id, events[half:], outcome, source_topic)
                return
            self._dead_letter(outcome, events, source_topic, "extraction_failed", str(exc), exc.attempts)
            return
        outcome.llm_calls += calls
        event_ids = [e.event_id for e in events]
        builder = ChangeSetBuilder(user_id, ids.change_set_id(user_id, event_ids), event_ids)
        for unit, out in zip(units, outs, strict=True):
            builder.add(unit.source, out, known)
        change_set = builder.build(calls)
        try:
            update = await self._write(change_set, events)
        except Exception as exc:  # the store is down or broken: keep the events, say why
            log.error("store_write_failed", user_id=user_id, error=repr(exc))
            self._dead_letter(outcome, events, source_topic, "store_failed", repr(exc), 3)
            return
        outcome.updates.append(update)

    async def _extract(
        self, user_id: str, units: list[_Unit]
    ) -> tuple[list[MessageOut | None], dict[str, KnownRef], int]:
        """Extraction calls over ``units`` packed by the token budget; returns one output per unit."""
        outs: list[MessageOut | None] = []
        known_all: dict[str, KnownRef] = {}
        calls = 0
        batch: list[_Unit] = []
        size = 0

        async def flush() -> None:
            nonlocal calls
            if not batch:
                return
            known = await self._known_theses(user_id, [u.item.text for u in batch], start=len(known_all) + 1)
            data = ExtractionInput(items=[u.item for u in batch], known=[k for k, _ in known])
            result = await run_task(self.llm, _EXTRACT, data, attempts=self.settings.extraction_attempts)
            calls += result.calls
            metrics.MEMORIZE_BATCH_SIZE.observe(len(batch))
            by_number = {m.message: m for m in result.value.messages}
            outs.extend(by_number.get(n) for n in range(1, len(batch) + 1))
            known_all.update({k.ref: ref for k, ref in known})
            batch.clear()

        for unit in units:
            tokens = _tokens(unit.item.text)
            if batch and (
                len(batch) >= self.settings.batch_max_messages or size + tokens > self.settings.batch_token_budget
            ):
                await flush()
                size = 0
            batch.append(unit)
            size += tokens
        await flush()
        return outs, known_all, calls

    async def _known_theses(self, user_id: str, texts: list[str], start: int) -> list[tuple[KnownThesis, KnownRef]]:
        """Still-valid theses most similar to the new messages: what a new statement may contradict."""
        limit = self.settings.invalidation_candidates
        if limit == 0:
            return []
        vectors = await self.embedder.embed([" ".join(texts)[:4000]])
        hits = await self.store.search(user_id, [VertexKind.THESIS.value], vectors[0], " ".join(texts), k=limit * 2)
        found = await self.store.get_vertices(user_id, [h.id for h in hits])
        valid = [found[h.id] for h in hits if h.id in found and found[h.id].t_invalid is None][:limit]
        return [
            (KnownThesis(f"K{start + n}", v.name, v.t_valid), KnownRef(v.id, v.t_valid)) for n, v in enumerate(valid)
        ]

    async def _write(self, change_set: ChangeSet, events: list[MemoryEvent]) -> MemoryUpdate:
        vectors = await self._vectors(change_set)
        async for attempt in AsyncRetrying(
            stop=stop_after_attempt(3), wait=wait_exponential(multiplier=0.2, max=2), reraise=True
        ):
            with attempt:
                result = await self.store.apply(change_set, vectors)
        committed = datetime.now(UTC)
        for event in events:
            metrics.MEMORIZE_EVENTS.labels(kind=event.kind, outcome="memorized").inc()
            metrics.INGEST_TO_QUERYABLE.observe(max(0.0, (committed - event.ingest_time).total_seconds()))
        metrics.MEMORIZE_CHANGES.labels(what="vertices").inc(result.vertices_added)
        metrics.MEMORIZE_CHANGES.labels(what="edges").inc(result.edges_added)
        metrics.MEMORIZE_CHANGES.labels(what="invalidations").inc(result.theses_invalidated)
        log.info(
            "memorized",
            user_id=change_set.user_id,
            change_set_id=change_set.id,
            events=len(events),
            vertices=result.vertices_added,
            edges=result.edges_added,
            invalidated=result.theses_invalidated,
            llm_calls=change_set.llm_calls,
        )
        return MemoryUpdate(
            event_id=change_set.id,
            user_id=change_set.user_id,
            event_time=max(e.event_time for e in events),
            change_set_id=change_set.id,
            source_event_ids=change_set.event_ids,
            vertices_added=result.vertices_added,
            edges_added=result.edges_added,
            theses_added=result.theses_added,
            theses_invalidated=result.theses_invalidated,
            llm_calls=change_set.llm_calls,
            committed_at=committed,
        )

    async def _vectors(self, change_set: ChangeSet) -> list[VectorItem]:
        """Vectors for the vertices and relations that have none yet.

        Asked of the vector index, not the graph: with a remote store the graph write may have landed before a
        crash and the vector write not, and the replay must still index them."""
        user_id = change_set.user_id
        existing = await self.store.get_vertices(user_id, [v.id for v in change_set.vertices])
        names = {v.id: v.name for v in change_set.vertices} | {k: v.name for k, v in existing.items()}
        relations = [e for e in change_set.edges if e.kind is EdgeKind.RELATION]
        indexed = await self.store.get_vectors(user_id, [v.id for v in change_set.vertices] + [e.id for e in relations])
        entries: list[tuple[str, str, str]] = [
            (v.id, v.kind.value, names[v.id][:2000]) for v in change_set.vertices if v.id not in indexed
        ]
        entries += [
            (e.id, "triplet", f"{names.get(e.source, '')} {e.relation} {names.get(e.target, '')}")
            for e in relations
            if e.id not in indexed
        ]
        if not entries:
            return []
        vectors = await self.embedder.embed([text for _, _, text in entries])
        return [VectorItem(id=i, kind=k, text=t, vector=list(v)) for (i, k, t), v in zip(entries, vectors, strict=True)]

    def _dead_letter(
        self, outcome: MemorizeOutcome, events: list[MemoryEvent], topic: str, reason: str, error: str, attempts: int
    ) -> None:
        for event in events:
            metrics.MEMORIZE_EVENTS.labels(kind=event.kind, outcome=reason).inc()
            metrics.DEAD_LETTERS.labels(topic=topic, reason=reason).inc()
            outcome.dead_letters.append(
                DeadLetter(
                    event_id=f"dl_{event.event_id}",
                    user_id=event.user_id,
                    source_topic=topic,
                    reason=reason,
                    error=error[:2000],
                    payload=event.model_dump_json(),
                    failed_event_ids=[event.event_id],
                    attempts=attempts,
                )
            )
