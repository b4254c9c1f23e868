"""Forgetting: a tombstone erases its sources and everything memory derived from them alone.

From the episodes a tombstone names, the erasure follows the provenance the memorize steps wrote:
- the episodes go, with their edges and index entries;
- a thesis or object goes when no remaining episode supports it (its episodic edges are its sources; an alias
  record of a merged name, ``ChangeSetBuilder._alias``, is supported by the messages that said the name); what
  another source still supports stays, and if its first source was forgotten it takes its times from the next
  one, as if the forgotten one had never been said;
- a relation edge first written by a forgotten source stays only while a remaining thesis states it;
- a thesis that a removed thesis had invalidated is valid again;
- a mark naming a removed thesis (a conflict, a prediction's confirmation or refutation) goes from the thesis
  that carries it, so none points at nothing;
- a kept relation edge is valid while a remaining thesis stating it is (so the edge of a thesis made valid again
  is valid again), and otherwise ended when the last of them was; it did not hold between their times (its gaps,
  ``services.validity``), and a thesis's gap that a removed thesis began goes;
- the cached model answers built from the forgotten events, and those built from the user's memory at large
  (questions, contradiction checks), go too;
- the forgotten event ids stay recorded, so a redelivered or replayed event is not memorized again.
The erasure is computed from the store's current state and applied in one store call (see ``ForgetStore.erase``);
a tombstone applied before announces what it announced then.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime

from schemas.events import Forget, ForgetScope, MemoryForgotten
from services import ids, metrics
from services.domain import ChangeSet, Edge, EdgeKind, Erasure, Triplet, Vertex, VertexKind, thesis_marks, with_marks
from services.embeddings import CachedEmbedder
from services.logging import get_logger
from services.memorize.builder import MERGED, ChangeSetBuilder, Source, merged_facts, valid_from_props
from services.memorize.extraction import Fact, ItemFacts
from services.ports import Embedder, ForgetStore, GraphStore, KeyValueCache, VectorItem
from services.validity import without_gaps_by

log = get_logger(__name__)

_MATCH_KEY = {
    ForgetScope.MESSAGE: "event_id",
    ForgetScope.DOCUMENT: "document_id",
    ForgetScope.CONVERSATION: "conversation_id",
}


def forget_mark(tombstone: Forget, source_topic: str) -> str:
    """The id the store keeps an applied tombstone under (a user forget comes on two topics: one each)."""
    return "f_" + ids.digest(tombstone.user_id, "forget", tombstone.event_id, source_topic)


def _first(episodes: Iterable[Vertex]) -> Vertex:
    """The source memorize met first: the earliest received (ties: the id)."""
    return min(episodes, key=_sort_key)


def _sort_key(episode: Vertex) -> tuple[bool, datetime | None, str]:
    return (episode.t_created is None, episode.t_created, episode.id)


def _stated_relation(user_id: str, thesis: Vertex) -> str | None:
    """The relation edge id a thesis wrote (``ChangeSetBuilder.add``), if it wrote one."""
    return ids.stated_relation(user_id, thesis.props)


class _Plan:
    """The erasure of a set of episodes, computed from the graph around them."""

    def __init__(self, user_id: str, episodes: list[Vertex], events: set[str]) -> None:
        self.user_id = user_id
        self.episodes = {e.id: e for e in episodes}
        self.events = events
        self.delete_vertices: set[str] = set(self.episodes)
        self.delete_edges: set[str] = set()
        self.delete_relations: set[str] = set()
        self.puts: dict[str, Vertex] = {}
        self.edge_puts: dict[str, Edge] = {}
        self.restored = 0
        #: per remaining episode, the facts it had merged into a thesis that goes: written as its own again
        self.reworded: dict[str, tuple[Vertex, list[Fact]]] = {}
        self.vectors: list[VectorItem] = []

    def current(self, vertex: Vertex) -> Vertex:
        return self.puts.get(vertex.id, vertex)

    def sources(self, links: list[Triplet]) -> dict[str, list[Vertex]]:
        """Per vertex linked to the episodes, every episode it has (forgotten ones included)."""
        found: dict[str, list[Vertex]] = {}
        for link in links:
            if link.edge.kind is EdgeKind.EPISODIC and link.end.kind is VertexKind.EPISODIC:
                found.setdefault(link.start.id, []).append(link.end)
        return found

    def drop_or_rederive(self, vertex: Vertex, episodes: list[Vertex]) -> None:
        remaining = [e for e in episodes if e.id not in self.episodes]
        if not remaining:
            self.delete_vertices.add(vertex.id)
            return
        first = _first(remaining)
        if vertex.kind is VertexKind.THESIS:
            if vertex.props.get("event_id") in self.events:
                merged = {e.id: merged_facts(e).get(vertex.id, []) for e in remaining}
                if all(merged.values()):
                    # every remaining source only repeated it in other words: the forgotten wording goes, and each
                    # source's own fact is written as it would have been had the first never been said
                    self.delete_vertices.add(vertex.id)
                    for episode in remaining:
                        _, facts = self.reworded.setdefault(episode.id, (episode, []))
                        facts.extend(merged[episode.id])
                    return
                first = _first(e for e in remaining if not merged[e.id])  # one that stated it in these words
                props = {**vertex.props, "event_id": first.props.get("event_id", "")}
                # the world time its words name, else when its first remaining source said it
                t_valid = first.t_valid
                if first.t_valid is not None and vertex.episode_label is not None:
                    t_valid = valid_from_props(props, vertex.episode_label.value, first.t_valid)[0]
                self.puts[vertex.id] = vertex.model_copy(
                    update={"props": props, "t_valid": t_valid, "t_created": first.t_created}
                )
        elif vertex.kind is VertexKind.OBJECT:
            # its times are those of the source that introduced it: a forgotten one when it shares the object's
            # receipt time and no remaining source has both of its times (two messages of one request share the
            # receipt time and differ in when they were said)
            forgotten_times = {e.t_created for e in episodes if e.id in self.episodes}
            kept = {(e.t_valid, e.t_created) for e in remaining}
            if vertex.t_created in forgotten_times and (vertex.t_valid, vertex.t_created) not in kept:
                self.puts[vertex.id] = vertex.model_copy(
                    update={"t_valid": first.t_valid, "t_created": first.t_created}
                )

    def edges(self, around: list[Triplet]) -> None:
        """Edges at a removed vertex go; kept thesis and relation edges whose first source went are re-derived."""
        stated: dict[str, dict[str, Vertex]] = {}
        theses = [v for t in around for v in (t.start, t.end) if v.kind is VertexKind.THESIS]
        for thesis in theses:
            # a gap a removed thesis began is gone with it: as if the thesis had never been invalidated then
            mended = without_gaps_by(self.current(thesis).props, self.delete_vertices)
            if mended is not None and thesis.id not in self.delete_vertices:
                self.puts[thesis.id] = self.current(thesis).model_copy(update={"props": mended})
        for vertex in [*theses, *self.puts.values()]:
            if vertex.kind is VertexKind.THESIS and vertex.id not in self.delete_vertices:
                edge_id = _stated_relation(self.user_id, self.current(vertex))
                if edge_id is not None:
                    stated.setdefault(edge_id, {})[vertex.id] = self.current(vertex)
        for t in around:
            edge = t.edge
            if edge.source in self.delete_vertices or edge.target in self.delete_vertices:
                self.delete_edges.add(edge.id)
                if edge.kind is EdgeKind.RELATION:
                    self.delete_relations.add(edge.id)
                continue
            if edge.kind is EdgeKind.RELATION and edge.id in stated:
                current = self.edge_puts.get(edge.id, edge)
                derived = current.stated_by(list(stated[edge.id].values()))
                if derived != current:
                    self.edge_puts[edge.id] = derived
            if edge.props.get("event_id") not in self.events:
                continue
            if edge.kind is EdgeKind.RELATION:
                by = list(stated.get(edge.id, {}).values())
                if not by:
                    self.delete_edges.add(edge.id)
                    self.delete_relations.add(edge.id)
                    continue
                source = min(by, key=lambda v: (v.t_created is None, v.t_created, v.id))
            elif edge.kind is EdgeKind.THESIS:
                source = self.current(t.end)
            else:
                continue
            current = self.edge_puts.get(edge.id, edge)
            props = {**current.props, "event_id": source.props.get("event_id", "")}
            self.edge_puts[edge.id] = current.model_copy(update={"props": props, "t_valid": source.t_valid})

    def rewritten(self) -> ChangeSet:
        """The reworded sources' facts as memorize would write them (``ChangeSetBuilder``), oldest source first;
        each episode loses the merge records of the theses that go."""
        builder = ChangeSetBuilder(self.user_id, "rederived", [])
        for episode, facts in sorted(self.reworded.values(), key=lambda item: _sort_key(item[0])):
            records = json.loads(episode.props.get(MERGED, "[]"))
            kept = [r for r in records if r["thesis"] not in self.delete_vertices]
            props = {k: v for k, v in episode.props.items() if k != MERGED}
            if kept:
                props[MERGED] = json.dumps(kept, sort_keys=True, ensure_ascii=False)
            assert episode.t_valid is not None and episode.t_created is not None
            source = Source(
                props.get("event_id", ""),
                int(props.get("chunk", "0")),
                episode.name,
                episode.t_valid,
                episode.t_created,
                props,
            )
            builder.add(source, ItemFacts(facts=facts))
        return builder.build(0)

    async def apply_rewritten(self, graph: GraphStore, embedder: Embedder) -> None:
        """Fold the rewritten facts into the erasure: what exists and stays is left as it is, what was going to be
        removed comes back as written anew (its index entry, the same text, stays), what is new is written and
        indexed."""
        if not self.reworded:
            return
        written = self.rewritten()
        existing = await graph.get_vertices(self.user_id, [v.id for v in written.vertices])
        existing_edges = await graph.get_triplets(self.user_id, [e.id for e in written.edges])
        names = {v.id: v.name for v in existing.values()} | {v.id: v.name for v in written.vertices}
        new: list[tuple[str, str, str]] = []
        for vertex in written.vertices:
            if vertex.kind is VertexKind.EPISODIC:
                self.puts[vertex.id] = vertex  # the same episode, without the merge records of what went
            elif vertex.id in self.delete_vertices or vertex.id not in existing:
                self.delete_vertices.discard(vertex.id)
                self.puts[vertex.id] = vertex
                if vertex.id not in existing:
                    new.append((vertex.id, vertex.kind.value, vertex.name[:2000]))
        for edge in written.edges:
            if edge.id in self.delete_edges or edge.id not in existing_edges:
                self.delete_edges.discard(edge.id)
                self.delete_relations.discard(edge.id)
                self.edge_puts[edge.id] = edge
                if edge.kind is EdgeKind.RELATION and edge.id not in existing_edges:
                    new.append((edge.id, "triplet", f"{names[edge.source]} {edge.relation} {names[edge.target]}"))
        if new:
            embedded = await embedder.embed([text for _, _, text in new])
            self.vectors = [
                VectorItem(id=i, kind=k, text=t, vector=list(v)) for (i, k, t), v in zip(new, embedded, strict=True)
            ]

    def unmark(self, partners: Iterable[Vertex]) -> None:
        """The marks that name a removed thesis go from the kept theses that carry them."""
        for partner in partners:
            if partner.id in self.delete_vertices:
                continue
            current = self.current(partner)
            marks = thesis_marks(current.props)
            kept = [m for m in marks if m.id not in self.delete_vertices]
            if kept != marks:
                self.puts[partner.id] = current.model_copy(update={"props": with_marks(current.props, kept)})

    def restore(self, invalidated: list[Vertex]) -> list[str]:
        """Theses a removed thesis had invalidated are valid again; returns the relation edges they state."""
        relations = []
        for thesis in invalidated:
            if thesis.id in self.delete_vertices:
                continue
            self.puts[thesis.id] = self.current(thesis).model_copy(
                update={"t_invalid": None, "t_expired": None, "invalidated_by": None}
            )
            self.restored += 1
            edge_id = _stated_relation(self.user_id, thesis)
            if edge_id is not None:
                relations.append(edge_id)
        return relations


class ForgetService:
    def __init__(
        self,
        graph: GraphStore,
        store: ForgetStore,
        cache: KeyValueCache | None,
        embedder: Embedder,
        *,
        embeddings: CachedEmbedder | None = None,
    ) -> None:
        """``embedder``: for facts written again in a remaining source's own words (``_Plan.apply_rewritten``);
        ``embeddings``: memorize's per-user embedding cache, whose entries of the user a forget drops."""
        self.graph = graph
        self.store = store
        self.cache = cache
        self.embedder = embedder
        self.embeddings = embeddings

    async def forget(self, tombstone: Forget, source_topic: str) -> MemoryForgotten:
        user = tombstone.user_id
        mark = forget_mark(tombstone, source_topic)
        kept = await self.store.forget_outcome(user, mark)
        if kept is not None:  # applied before (a redelivery): announce the same again
            metrics.FORGETS.labels(tombstone.scope.value, "replayed").inc()
            return MemoryForgotten.model_validate_json(kept)
        if tombstone.scope is ForgetScope.USER:
            plan = None
            erasure = Erasure(forget_id=mark, user_id=user, whole_user=True)
        else:
            plan = await self._plan(tombstone)
            erasure = Erasure(
                forget_id=mark,
                user_id=user,
                event_ids=sorted(plan.events),
                delete_vertices=sorted(plan.delete_vertices),
                delete_edges=sorted(plan.delete_edges),
                delete_vectors=sorted(plan.delete_vertices | plan.delete_relations),
                put_vertices=[plan.puts[k] for k in sorted(plan.puts) if k not in plan.delete_vertices],
                put_edges=[plan.edge_puts[k] for k in sorted(plan.edge_puts) if k not in plan.delete_edges],
            )
        # the cache first: a crash after it leaves the graph as it was, so the replay computes the same erasure
        cached = 0
        if self.cache is not None:
            cached = await self.cache.forget(user, None if plan is None else erasure.event_ids)
        if self.embeddings is not None:  # the vectors of the user's texts, kept in memory: all of them go
            self.embeddings.forget_user(user)
        outcome = MemoryForgotten(
            event_id=tombstone.event_id,
            user_id=user,
            event_time=tombstone.event_time,
            forget_id=tombstone.event_id,
            source_topic=source_topic,
            scope=tombstone.scope,
            target=tombstone.target,
            removed_all=plan is None,
            source_event_ids=erasure.event_ids,
            removed_ids=sorted(set(erasure.delete_vertices) | set(erasure.delete_edges)),
            vertices_removed=len(erasure.delete_vertices),
            edges_removed=len(erasure.delete_edges),
            theses_restored=0 if plan is None else plan.restored,
            theses_rewritten=0 if plan is None else sum(len(facts) for _, facts in plan.reworded.values()),
            cache_entries_removed=cached,
        )
        erasure.outcome = outcome.model_dump_json()
        await self.store.erase(erasure, [] if plan is None else plan.vectors)
        metrics.FORGETS.labels(tombstone.scope.value, "applied").inc()
        metrics.FORGOTTEN.labels("vertices").inc(outcome.vertices_removed)
        metrics.FORGOTTEN.labels("edges").inc(outcome.edges_removed)
        metrics.FORGOTTEN.labels("theses_restored").inc(outcome.theses_restored)
        metrics.FORGOTTEN.labels("cache_entries").inc(cached)
        log.info(
            "forgotten",
            user_id=user,
            forget_id=tombstone.event_id,
            scope=tombstone.scope.value,
            events=len(erasure.event_ids),
            vertices=outcome.vertices_removed,
            edges=outcome.edges_removed,
            restored=outcome.theses_restored,
            cache_entries=cached,
        )
        return outcome

    async def _plan(self, tombstone: Forget) -> _Plan:
        user = tombstone.user_id
        assert tombstone.target is not None
        episodes = await self.store.episodes(user, {_MATCH_KEY[tombstone.scope]: tombstone.target})
        events = {e.props["event_id"] for e in episodes if "event_id" in e.props}
        if tombstone.scope is ForgetScope.MESSAGE:
            events.add(tombstone.target)  # even if it never became memory (dead-lettered, or still to come late)
        plan = _Plan(user, episodes, events)
        if not episodes:
            return plan
        links = await self.graph.neighbors(user, list(plan.episodes), [EdgeKind.EPISODIC])
        plan.delete_edges.update(t.edge.id for t in links)
        linked = {t.start.id: t.start for t in links if t.start.id not in plan.episodes}
        episodic = await self.graph.neighbors(user, list(linked), [EdgeKind.EPISODIC])
        sources = plan.sources(episodic)
        for vertex_id in sorted(linked):
            plan.drop_or_rederive(linked[vertex_id], sources.get(vertex_id, []))
        around = await self.graph.neighbors(user, sorted(linked), [EdgeKind.THESIS, EdgeKind.RELATION])
        removed_theses = [
            v for v in sorted(plan.delete_vertices) if v in linked and linked[v].kind is VertexKind.THESIS
        ]
        revived = plan.restore(await self.store.invalidated_by(user, removed_theses))
        # the relation edges of the theses valid again, where the graph around the forgotten episodes lacks them
        seen = {t.edge.id for t in around}
        extra = await self.graph.get_triplets(user, sorted(set(revived) - seen)) if set(revived) - seen else {}
        # a thesis reworded goes though it keeps sources: its episodic edges to them go with it
        plan.edges([*around, *extra.values(), *episodic])
        await plan.apply_rewritten(self.graph, self.embedder)
        # marks are kept on both sides: a removed thesis's own marks name the kept theses that name it
        named = {m.id for v in linked.values() if v.id in plan.delete_vertices for m in thesis_marks(v.props)}
        if named - plan.delete_vertices:
            plan.unmark((await self.graph.get_vertices(user, sorted(named - plan.delete_vertices))).values())
        return plan
