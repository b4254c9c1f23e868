"""Memorize: chat messages and documents -> PersonalAI memory graph, incrementally and idempotently.

Per user (events of one user stay in order), already-applied events are skipped, the rest are packed into
extraction calls (several messages per call, bounded by a token budget), the output becomes one change set per
group of events, and the change set plus its vectors are written in one store call. A group whose extraction
still fails after bounded retries is split in halves so one poisonous message cannot take its neighbours down;
a single event that fails becomes a dead letter with the reason.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

from schemas.events import ChatMessage, DeadLetter, Document, MemoryUpdate
from services import ids, metrics
from services.backends import BackendUnavailable
from services.domain import (
    HOLDER,
    Announcement,
    ChangeSet,
    EdgeKind,
    EpisodeLabel,
    Vertex,
    VertexKind,
    thesis_marks,
)
from services.embeddings import CachedEmbedder, embedding_user
from services.llm.layers import TRANSIENT_ERRORS, attempts_made
from services.llm.scope import background_calls, llm_scope, sent_ahead
from services.llm.task import TaskFailed, run_task
from services.logging import get_logger
from services.memorize.builder import (
    ChangeSetBuilder,
    KnownRef,
    Source,
    holder_of,
    thesis_text,
    thesis_vertex,
    validity,
)
from services.memorize.chunking import chunk_text
from services.memorize.entities import EntityResolver
from services.memorize.extraction import ExtractionInput, ExtractTask, Fact, Item, ItemFacts, extract_batch
from services.memorize.labels import keeps
from services.memorize.resolve import Pair, ResolveTask
from services.memorize.resolve_check import CheckTask
from services.memorize.trust import VerdictTrust
from services.ports import LLM, Embedder, Stores, VectorItem
from services.settings import Settings
from services.similarity import cosine

log = get_logger(__name__)
MemoryEvent = ChatMessage | Document
_RESOLVE = ResolveTask()
_CHECK = CheckTask()
# users memorized at once: their fact groups' texts are embedded together (``CachedEmbedder`` coalesces them)
_USERS_AT_ONCE = 16
#: A worker's step takes up to this many extraction batches' worth of events (several users', or several batches of
#: one user's backlog); a user's batches in one call are extracted side by side.
TAKE_BATCHES = 8


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


def _keeps(verdict: str, fact: Fact, old: Vertex) -> bool:
    """Whether the label policy keeps both on ``verdict`` for this pair whatever a check says (``labels.keeps``)."""
    old_kind = old.episode_label or EpisodeLabel.FACT
    return keeps(verdict, EpisodeLabel(fact.kind), holder_of(fact), old_kind, old.props.get(HOLDER, ""))


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
        units.append(_Unit(event, source, Item(event.title, chunk, event.event_time, document=True)))
    return units


def _rival(fact: Fact, old: Vertex) -> bool:
    """``old`` relates the same subject to another entity than ``fact`` does, or, when either is an opinion or a
    prediction, otherwise to the same one ("thinks Dune is boring" / "is great"; "will get the job at Acme" / "was
    not hired by Acme"): only such a pair can say the one replaced, confirmed or refuted the other. (Pairs of two
    subjects, or of two facts about one entity, were judged "updates" by the default model in every case inspected
    on LoCoMo: docs/benchmarks.md, temporal memory.)"""
    if not fact.object or not fact.relation or not old.props.get("relation"):
        return False
    if ids.normalize_name(old.props.get("subject", "")) != ids.normalize_name(fact.subject):
        return False
    if not _same_object(fact, old):
        return True
    stances = {EpisodeLabel.OPINION.value, EpisodeLabel.PREDICTION.value}
    known_kind = old.episode_label.value if old.episode_label else ""
    return (fact.kind in stances or known_kind in stances) and not _same_relation(fact, old)


def _trusted(verdict: str, by_meaning: bool) -> str:
    """The verdict acted on. "updates" on a pair found only by meaning is kept as "compatible": on LoCoMo the
    default model gave it to 30 such pairs, wrongly in every one ("Caroline went to a LGBTQ support group" /
    "Caroline shared her journey"); such a pair still merges a repeat ("same") and confirms or refutes a
    prediction. Counted apart, so it shows."""
    if verdict == "updates" and by_meaning:
        metrics.RESOLVE_VERDICTS.labels("updates_by_meaning_kept").inc()
        return "compatible"
    metrics.RESOLVE_VERDICTS.labels(verdict).inc()
    return verdict


def _same_object(fact: Fact, old: Vertex) -> bool:
    return ids.normalize_name(old.props.get("object", "")) == ids.normalize_name(fact.object)


def _same_relation(fact: Fact, old: Vertex) -> bool:
    return old.props.get("relation") == ids.normalize_text(fact.relation)


def _tokens(text: str) -> int:
    return len(text) // 4 + 8


T = TypeVar("T")


def _pack(items: list[T], text: Callable[[T], str], max_items: int, token_budget: int) -> list[list[T]]:
    """Consecutive items in batches of at most ``max_items`` and about ``token_budget`` input tokens."""
    batches: list[list[T]] = []
    size = 0
    for item in items:
        tokens = _tokens(text(item))
        if batches and len(batches[-1]) < max_items and size + tokens <= token_budget:
            batches[-1].append(item)
            size += tokens
        else:
            batches.append([item])
            size = tokens
    return batches


def memory_update(announcement: Announcement) -> MemoryUpdate:
    """The event that announces a written change set. Built from what the store kept only, so an announcement
    made again on replay is the same record, id (the change set's) included."""
    return MemoryUpdate(
        event_id=announcement.change_set_id,
        user_id=announcement.user_id,
        event_time=announcement.event_time,
        ingest_time=announcement.committed_at,
        change_set_id=announcement.change_set_id,
        source_event_ids=announcement.event_ids,
        vertices_added=announcement.vertices_added,
        edges_added=announcement.edges_added,
        theses_added=announcement.theses_added,
        theses_invalidated=announcement.theses_invalidated,
        llm_calls=announcement.llm_calls,
        committed_at=announcement.committed_at,
    )


def _with_outcome(source: Source, found: ItemFacts) -> Source:
    """The episode records how many facts came of it and, if none, why: never an unexplained empty."""
    props = {"facts": str(len(found.facts))}
    if not found.facts:
        reason = "no_entry" if not found.answered else ("all_dropped" if found.dropped else "none_listed")
        props["no_facts"] = reason
        metrics.MEMORIZE_NO_FACTS.labels(reason=reason).inc()
    for reason in found.dropped:
        metrics.FACTS_DROPPED.labels(reason=reason).inc()
    if cut := sum(f.cut for f in found.facts):
        props["facts_cut"] = str(cut)
        metrics.FACTS_CUT.inc(cut)
    return replace(source, props={**source.props, **props})


class MemorizeService:
    def __init__(
        self,
        stores: Stores,
        llm: LLM,
        embedder: Embedder,
        settings: Settings,
        *,
        extract_task: ExtractTask | None = None,
    ) -> None:
        self.extract_task = extract_task or ExtractTask.from_settings(settings)
        self.graph = stores.graph
        self.vectors = stores.vectors
        self.writer = stores.writer
        self.announcements = stores.announcements
        self.llm = llm
        # every distinct text of a user embedded once; users worked on at once share the model's calls
        self.embedder = CachedEmbedder(embedder)
        self.settings = settings
        self.entities = EntityResolver(stores.graph, stores.vectors, llm, self.embedder, settings)
        # the model's contradiction verdicts, asked for only while it answers its control pairs right
        self.trust = VerdictTrust(settings.resolve_untrusted_after, settings.resolve_untrusted_skip)
        self._users_at_once = asyncio.Semaphore(_USERS_AT_ONCE)

    async def memorize(self, events: Sequence[MemoryEvent], source_topic: str = "memorize") -> MemorizeOutcome:
        """Each user's events in order; users side by side (nothing of one user depends on another's). The
        outcome lists the users in the order their first event came, as if they had been memorized one by one."""
        by_user: OrderedDict[str, dict[str, MemoryEvent]] = OrderedDict()
        for event in events:
            by_user.setdefault(event.user_id, {}).setdefault(event.event_id, event)
        with background_calls():  # the tasks inherit it: a question never waits behind this backlog's calls
            tasks = [
                asyncio.create_task(self._memorize_user(user_id, list(user_events.values()), source_topic))
                for user_id, user_events in by_user.items()
            ]
        try:
            parts = await asyncio.gather(*tasks)
        except BaseException:  # the first failure is raised as it is; the other users' work stops with it
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        outcome = MemorizeOutcome()
        for part in parts:
            outcome.updates.extend(part.updates)
            outcome.dead_letters.extend(part.dead_letters)
            outcome.skipped.extend(part.skipped)
            outcome.llm_calls += part.llm_calls
        return outcome

    async def memorize_backlog(
        self,
        events: Sequence[MemoryEvent],
        on_step: Callable[[list[MemoryEvent], MemorizeOutcome], None] = lambda _events, _outcome: None,
    ) -> None:
        """A backlog memorized as workers would take it from the topic: each user's events in order, in steps of up
        to ``TAKE_BATCHES`` batches a memorize call, users at once (as partitions are); ``on_step`` sees each step's
        events and outcome. For the evaluation and the benchmarks, which replay a whole dataset."""
        step = self.settings.batch_max_messages * TAKE_BATCHES
        by_user: dict[str, list[MemoryEvent]] = {}
        for event in events:
            by_user.setdefault(event.user_id, []).append(event)

        async def one_user(user_events: list[MemoryEvent]) -> None:
            for start in range(0, len(user_events), step):
                chunk = user_events[start : start + step]
                on_step(chunk, await self.memorize(chunk))

        await asyncio.gather(*(one_user(user_events) for user_events in by_user.values()))

    async def _memorize_user(self, user_id: str, events: list[MemoryEvent], source_topic: str) -> MemorizeOutcome:
        outcome = MemorizeOutcome()
        async with self._users_at_once:
            with embedding_user(user_id):
                seen = await self.graph.seen_events(user_id, [e.event_id for e in events])
                outcome.skipped.extend(sorted(seen))
                for event in events:
                    if event.event_id in seen:
                        metrics.MEMORIZE_EVENTS.labels(kind=event.kind, outcome="duplicate").inc()
                if seen:  # applied before: a crash may have come before their memory updates were published
                    await self._pending(user_id, sorted(seen), outcome)
                fresh = [e for e in events if e.event_id not in seen]
                groups = self._groups(fresh)
                # Extraction reads a group's own messages, never memory: every group's call is sent at once and
                # the engine decodes them together (its slots: about twice the tokens a second of one call on
                # 2 cores, docs/benchmarks.md), while each group's checks and write still follow the one before.
                units = [self._group_units(group) for group in groups]
                with sent_ahead():  # the checks of a group being written go first (``LimitedLLM``)
                    extractions = [asyncio.ensure_future(self._extract(u)) for u in units]
                try:
                    for group, group_units, extraction in zip(groups, units, extractions, strict=True):
                        await self._memorize_group(user_id, group, outcome, source_topic, (group_units, extraction))
                finally:  # a failure stops the rest; their calls still queued are not left running
                    for extraction in extractions:
                        extraction.cancel()
                    await asyncio.gather(*extractions, return_exceptions=True)
        return outcome

    async def announced(self, updates: Sequence[MemoryUpdate]) -> None:
        """These memory updates were published (the broker acknowledged them): they are no longer pending."""
        by_user: dict[str, list[str]] = {}
        for update in updates:
            by_user.setdefault(update.user_id, []).append(update.change_set_id)
        for user_id, change_set_ids in by_user.items():
            await self.announcements.mark_announced(user_id, change_set_ids)

    async def _pending(self, user_id: str, event_ids: list[str], outcome: MemorizeOutcome) -> None:
        """The pending announcements of these applied events join the outcome, to be published (again)."""
        known = {u.change_set_id for u in outcome.updates}
        for announcement in await self.announcements.pending_announcements(user_id, event_ids):
            if announcement.change_set_id not in known:
                metrics.MEMORY_UPDATES_REANNOUNCED.inc()
                log.info("memory_update_pending", user_id=user_id, change_set_id=announcement.change_set_id)
                outcome.updates.append(memory_update(announcement))
                known.add(announcement.change_set_id)

    def _groups(self, events: list[MemoryEvent]) -> list[list[MemoryEvent]]:
        """Whole events packed within the batch limits; a change set never splits an event."""
        return _pack(events, lambda e: e.text, self.settings.batch_max_messages, self.settings.batch_token_budget)

    def _group_units(self, events: list[MemoryEvent]) -> list[_Unit]:
        return [u for e in events for u in _units(e, self.settings.document_chunk_chars)]

    async def _memorize_group(
        self,
        user_id: str,
        events: list[MemoryEvent],
        outcome: MemorizeOutcome,
        source_topic: str,
        started: tuple[list[_Unit], Awaitable[tuple[list[ItemFacts], int]]] | None = None,
    ) -> None:
        """One change set from ``events``; ``started``, when given, is their units and its extraction under way."""
        units, extraction = started if started is not None else (self._group_units(events), None)
        try:
            found, calls = await (extraction if extraction is not None else self._extract(units))
        except TaskFailed as exc:
            outcome.llm_calls += exc.attempts
            metrics.EXTRACTION_FAILURES.labels(reason="invalid_output").inc()
            if len(events) > 1:
                log.warning("extraction_failed_splitting", user_id=user_id, events=len(events), error=str(exc))
                await self._halves(user_id, events, outcome, source_topic)
                return
            self._dead_letter(outcome, events, source_topic, "extraction_failed", str(exc), exc.attempts)
            return
        except TRANSIENT_ERRORS as exc:  # the model is down or stalled: the events wait in the dead letters
            metrics.EXTRACTION_FAILURES.labels(reason="llm_unavailable").inc()
            self._dead_letter(outcome, events, source_topic, "llm_unavailable", repr(exc), attempts_made(exc))
            return
        found, entity_calls = await self.entities.resolve(user_id, found)  # aliases -> the objects they name
        calls += entity_calls
        sources = [_with_outcome(u.source, f) for u, f in zip(units, found, strict=True)]
        texts = [thesis_text(fact) for f in found for fact in f.facts]
        vectors = dict(zip(texts, await self.embedder.embed(texts), strict=True)) if texts else {}
        same_as, replaced, resolve_calls = await self._resolve(user_id, units, found, vectors)
        calls += resolve_calls
        outcome.llm_calls += calls
        event_ids = [e.event_id for e in events]
        builder = ChangeSetBuilder(user_id, ids.change_set_id(user_id, event_ids), event_ids)
        for n, (source, facts) in enumerate(zip(sources, found, strict=True)):
            thesis_ids = builder.add(source, facts, same_as.get(n))
            for fact_n, old in replaced.get(n, []):
                builder.invalidate(old, thesis_ids[fact_n], source)
        change_set = builder.build(calls)
        try:
            announcement = await self._write(change_set, events, vectors)
        except Exception as exc:  # the store is down or broken: keep the events, say why
            if len(events) > 1 and not isinstance(exc, TRANSIENT_ERRORS):
                # maybe one event's value the store rejects: halves, so only that one is dead-lettered
                log.warning("store_write_failed_splitting", user_id=user_id, events=len(events), error=repr(exc))
                await self._halves(user_id, events, outcome, source_topic)
                return
            log.error("store_write_failed", user_id=user_id, error=repr(exc))
            reason = "store_unavailable" if isinstance(exc, BackendUnavailable) else "store_failed"
            self._dead_letter(outcome, events, source_topic, reason, repr(exc), getattr(exc, "attempts", 1))
            return
        if announcement is None:  # another worker applied these events meanwhile (a rebalance): its news, if pending
            await self._pending(user_id, event_ids, outcome)
        else:
            outcome.updates.append(memory_update(announcement))

    async def _halves(
        self, user_id: str, events: list[MemoryEvent], outcome: MemorizeOutcome, source_topic: str
    ) -> None:
        """Memorize each half on its own, so the one event that fails a group is dead-lettered alone."""
        half = len(events) // 2
        await self._memorize_group(user_id, events[:half], outcome, source_topic)
        await self._memorize_group(user_id, events[half:], outcome, source_topic)

    async def _extract(self, units: list[_Unit]) -> tuple[list[ItemFacts], int]:
        """Extraction calls over ``units`` packed by the token budget; returns what was found in each unit.

        A unit the model gave no entry for is asked once more on its own batch; if it still has none, it is
        recorded as having no facts for that reason, never silently."""
        found: list[ItemFacts] = []
        calls = 0
        participants = tuple(dict.fromkeys(u.item.speaker for u in units if u.item.speaker and not u.item.document))
        for batch in self._batches(units):
            data = ExtractionInput(items=[u.item for u in batch], participants=participants)
            # the cached extraction is filed under the events it read, so forgetting one of them removes it
            with llm_scope(batch[0].event.user_id, (u.event.event_id for u in batch)):
                value, made = await extract_batch(
                    self.llm, self.extract_task, data, attempts=self.settings.extraction_attempts
                )
            calls += made
            metrics.MEMORIZE_BATCH_SIZE.observe(len(batch))
            missing = [n for n, f in enumerate(value) if not f.answered]
            if missing:
                again = ExtractionInput(items=[batch[n].item for n in missing], participants=participants)
                with llm_scope(batch[0].event.user_id, (batch[n].event.event_id for n in missing)):
                    retry = await run_task(
                        self.llm, self.extract_task, again, attempts=self.settings.extraction_attempts
                    )
                calls += retry.calls
                for n, facts in zip(missing, retry.value, strict=True):
                    value[n] = facts
            found.extend(value)
        return found, calls

    def _batches(self, units: list[_Unit]) -> list[list[_Unit]]:
        return _pack(units, lambda u: u.item.text, self.settings.batch_max_messages, self.settings.batch_token_budget)

    async def _resolve(
        self, user_id: str, units: list[_Unit], found: list[ItemFacts], vectors: dict[str, list[float]]
    ) -> tuple[dict[int, dict[int, str]], dict[int, list[tuple[int, KnownRef]]], int]:
        """Duplicates and contradictions of the new facts among the user's valid theses and the batch's own earlier
        facts, after extraction.

        - A known thesis of the same kind about the same subject nearly equal in meaning (cosine >=
          ``duplicate_min_similarity``) is the same fact: the new one becomes a source of it, no call needed.
        - Candidates per new fact, at most ``invalidation_candidates``, among the known theses that relate its
          subject to another entity (``_rival``), and among the facts of earlier messages of the same batch (a batch
          may span months of a chat history): those stating the same relation ("works at Siemens" / "works at
          St. Mary's"), then its nearest by meaning (cosine >= ``contradiction_min_similarity``: "is employed by
          Bosch"). All pairs of a batch are judged by one ``resolve`` call: at most one call per batch
          whatever the number of pairs (measured on LoCoMo: 0.11 per message, docs/evaluation.md). (A small model
          asked about every similar pair answers "updates" to all of them.)
        - What a verdict does follows the labels of both theses (``ChangeSetBuilder.invalidate``).

        Returns, per unit: facts that repeat a known thesis (fact -> thesis id), the known theses judged with a
        fact (their verdict in ``KnownRef.verdict``), and the calls made."""
        facts = [(u, n, fact) for u, f in enumerate(found) for n, fact in enumerate(f.facts)]
        if self.settings.invalidation_candidates == 0 or not facts:
            return {}, {}, 0
        same_as: dict[int, dict[int, str]] = {}
        texts = [thesis_text(fact) for _, _, fact in facts]
        k = 3 + self.settings.invalidation_candidates
        # a candidate relates the same subject (``_rival``), and so does every thesis stating its relation edge: the
        # subjects' theses are all that is read, beside the whole batch's nearest theses (one read each, together)
        subjects = sorted({fact.subject for _, _, fact in facts})
        hits, of_object = await asyncio.gather(
            self.vectors.search_many(user_id, [VertexKind.THESIS.value], [vectors[t] for t in texts], k=k),
            self.graph.valid_theses_each(user_id, [ids.object_id(user_id, e) for e in subjects], 200),
        )
        near = [
            [(h.id, h.score) for h in found if h.id != ids.thesis_id(user_id, text)]
            for text, found in zip(texts, hits, strict=True)
        ]
        known = await self.graph.get_vertices(user_id, sorted({i for scored in near for i, _ in scored}))
        for (unit_n, fact_n, fact), scored in zip(facts, near, strict=True):
            for hit, score in scored:
                old = known.get(hit)
                if score < self.settings.duplicate_min_similarity or old is None:
                    continue
                # of the same kind: "Ben got the job" is no repeat of "Ben will get the job" but what it came to
                same_kind = old.episode_label is None or old.episode_label.value == fact.kind
                if old.t_invalid is None and old.props.get("subject") == fact.subject and same_kind:
                    same_as.setdefault(unit_n, {})[fact_n] = old.id
                    break
        about = {e: of_object[ids.object_id(user_id, e)] for e in subjects}
        # The batch's own earlier facts are candidates too, as they would be in a batch of their own: one batch may
        # hold the old state and the new ("I'm a chemistry teacher" in April, "I now work at Novagen" in September).
        drafted = {
            (u, n): thesis_vertex(user_id, fact, units[u].source) for u, n, fact in facts if n not in same_as.get(u, {})
        }
        pairs: list[tuple[int, int, Vertex]] = []
        by_meaning: set[tuple[int, int, str]] = set()  # pairs found only by meaning, not by a shared relation
        least = self.settings.contradiction_min_similarity
        for (unit_n, fact_n, fact), scored in zip(facts, near, strict=True):
            if fact_n in same_as.get(unit_n, {}):
                continue
            shared = {v.id: v for v in about[fact.subject] if _rival(fact, v)}
            own = drafted[(unit_n, fact_n)]
            earlier = [v for (u, _), v in drafted.items() if u < unit_n and v.id != own.id and _rival(fact, v)]
            # the same relation to another entity, or (an opinion, a prediction) another relation to the same one:
            # judged whatever their wording; the rest only when near in meaning
            known_or_earlier = [*shared.values(), *earlier]
            rivals = [old for old in known_or_earlier if _same_relation(fact, old) or _same_object(fact, old)]
            nearest = [shared[hit] for hit, score in scored if hit in shared and score >= least]
            nearest += [v for v in earlier if cosine(vectors[own.name], vectors[v.name]) >= least]
            if not self.settings.resolve_by_meaning:
                # a by-meaning pair's "updates" is not acted on (``_trusted``): what the call could still do is
                # merge a repeat, or confirm or refute a known prediction; only the last is kept asking for
                nearest = [v for v in nearest if v in rivals or v.episode_label is EpisodeLabel.PREDICTION]
            candidates = list({v.id: v for v in [*rivals, *nearest]}.values())
            pairs.extend((unit_n, fact_n, old) for old in candidates[: self.settings.invalidation_candidates])
            by_meaning.update((unit_n, fact_n, v.id) for v in nearest if v not in rivals)
        if not pairs or not self.trust.ask(len(pairs)):
            return same_as, {}, 0
        task_input = [
            Pair(
                thesis_text(found[u].facts[f]),
                validity(found[u].facts[f].when, found[u].facts[f].kind, units[u].item.time)[0],
                old.name,
                old.t_valid,
                known_prediction=old.episode_label is EpisodeLabel.PREDICTION,
            )
            for u, f, old in pairs
        ]
        try:
            with llm_scope(user_id):  # it reads known theses too: filed under the user's memory at large
                result = await run_task(self.llm, _RESOLVE, task_input, attempts=self.settings.extraction_attempts)
        except (TaskFailed, ConnectionError, TimeoutError) as exc:
            # both statements are kept: a missed update is repaired by a later one, a lost fact is not
            metrics.EXTRACTION_FAILURES.labels(reason="resolve_failed").inc()
            log.warning("resolve_failed_keeping_both", user_id=user_id, pairs=len(pairs), error=str(exc))
            return same_as, {}, getattr(exc, "attempts", 1)
        verdicts = [
            _trusted(v, (u, f, old.id) in by_meaning) for (u, f, old), v in zip(pairs, result.value, strict=True)
        ]
        acting = [
            n
            for n, ((u, f, old), v) in enumerate(zip(pairs, verdicts, strict=True))
            if v in ("updates", "refutes") and not _keeps(v, found[u].facts[f], old)
        ]
        verdicts, check_calls = await self._check(user_id, task_input, verdicts, acting)
        judged = [(p, v) for p, v in zip(pairs, verdicts, strict=True) if v not in ("same", "compatible")]
        # the theses the judged ones are marked against: ending one takes its mark off them
        marked = {m.id for (_, _, old), _ in judged for m in thesis_marks(old.props)}
        partners = await self.graph.get_vertices(user_id, sorted(marked)) if marked else {}
        replaced: dict[int, list[tuple[int, KnownRef]]] = {}
        for (unit_n, fact_n, old), verdict in zip(pairs, verdicts, strict=True):
            if verdict == "same":
                same_as.setdefault(unit_n, {}).setdefault(fact_n, old.id)
            elif verdict != "compatible":
                known_about = about[found[unit_n].facts[fact_n].subject]
                theirs = {m.id: partners[m.id].props for m in thesis_marks(old.props) if m.id in partners}
                ref = KnownRef.of(old, known_about, verdict, theirs)
                replaced.setdefault(unit_n, []).append((fact_n, ref))
        # an earlier fact of the batch judged a repeat of a known thesis is not written: nothing may point at it
        unwritten = {v.id for (u, n), v in drafted.items() if n in same_as.get(u, {})}
        if unwritten:
            same_as = {u: {n: t for n, t in m.items() if t not in unwritten} for u, m in same_as.items()}
            replaced = {u: [(n, r) for n, r in refs if r.id not in unwritten] for u, refs in replaced.items()}
        return same_as, replaced, result.calls + check_calls

    async def _check(
        self, user_id: str, pairs: list[Pair], verdicts: list[str], acting: list[int]
    ) -> tuple[list[str], int]:
        """The verdicts that would end, mark or refute a known thesis (``acting``: those the label policy does not
        keep anyway), asked again the other way round (could one person say both?, ``resolve_check``, between two
        control pairs): one the check does not confirm, or confirms in a call whose controls were answered wrong,
        or a failed call, keeps both; each reason counted once, apart, so it shows."""
        if not acting or not self.settings.resolve_check:
            return verdicts, 0
        try:
            with llm_scope(user_id):
                result = await run_task(
                    self.llm, _CHECK, [pairs[n] for n in acting], attempts=self.settings.extraction_attempts
                )
        except (TaskFailed, ConnectionError, TimeoutError) as exc:
            # unconfirmed: both statements are kept, as when resolve itself fails
            metrics.EXTRACTION_FAILURES.labels(reason="resolve_check_failed").inc()
            log.warning("resolve_check_failed_keeping_both", user_id=user_id, pairs=len(acting), error=str(exc))
            stands, calls = [False] * len(acting), getattr(exc, "attempts", 1)
        else:
            checked_out, calls = result.value, result.calls
            self.trust.controls(checked_out.trusted)
            if checked_out.trusted:
                stands = checked_out.not_both
                for n, confirmed in zip(acting, stands, strict=True):
                    if not confirmed:  # the check says one person could say both
                        metrics.RESOLVE_VERDICTS.labels(f"{verdicts[n]}_unconfirmed_kept").inc()
            else:
                # the model answered a control pair wrong: in this call it could not tell the two kinds apart
                metrics.RESOLVE_VERDICTS.labels("check_controls_failed").inc(len(acting))
                stands = [False] * len(acting)
        checked = list(verdicts)
        for n, confirmed in zip(acting, stands, strict=True):
            if not confirmed:
                checked[n] = "compatible"
        return checked, calls

    async def _write(
        self, change_set: ChangeSet, events: list[MemoryEvent], known_vectors: dict[str, list[float]]
    ) -> Announcement | None:
        vectors = await self._vectors(change_set, known_vectors)
        result = await self.writer.apply(change_set, vectors)  # the store's call sites retry (services.backends)
        if result.announcement is None:
            return None
        committed = result.announcement.committed_at
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
        return result.announcement

    async def _vectors(self, change_set: ChangeSet, known_vectors: dict[str, list[float]]) -> list[VectorItem]:
        """Vectors for the vertices and relations that have none yet.

        Asked of the vector index, not the graph: with a remote store the graph write may have landed before a
        crash and the vector write not, and the replay must still index them."""
        user_id = change_set.user_id
        relations = [e for e in change_set.edges if e.kind is EdgeKind.RELATION]
        existing, indexed = await asyncio.gather(  # one read of each store, together
            self.graph.get_vertices(user_id, [v.id for v in change_set.vertices]),
            self.vectors.get_vectors(user_id, [v.id for v in change_set.vertices] + [e.id for e in relations]),
        )
        names = {v.id: v.name for v in change_set.vertices} | {k: v.name for k, v in existing.items()}
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
        # thesis texts were embedded to find their candidates: only the rest is embedded here
        todo = sorted({text for _, _, text in entries if text not in known_vectors})
        fresh = dict(zip(todo, await self.embedder.embed(todo), strict=True)) if todo else {}
        lookup = known_vectors | fresh
        return [VectorItem(id=i, kind=k, text=t, vector=list(lookup[t])) for i, k, t in entries]

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
