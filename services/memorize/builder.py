"""Turn validated extraction output into a change set with deterministic ids (PersonalAI memorize steps 1-4)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from services import ids
from services.domain import (
    ChangeSet,
    Edge,
    EdgeKind,
    EpisodeLabel,
    Invalidation,
    TemporalLabel,
    Vertex,
    VertexKind,
)
from services.memorize.extraction import MessageOut


@dataclass(frozen=True)
class Source:
    """Where an extraction item came from: one chat message or one document chunk."""

    event_id: str
    chunk: int
    text: str
    event_time: datetime
    ingest_time: datetime
    props: dict[str, str]


@dataclass(frozen=True)
class KnownRef:
    id: str
    t_valid: datetime | None


class ChangeSetBuilder:
    def __init__(self, user_id: str, change_set_id: str, event_ids: list[str]) -> None:
        self.cs = ChangeSet(id=change_set_id, user_id=user_id, event_ids=event_ids)
        self._vertices: dict[str, Vertex] = {}
        self._edges: dict[str, Edge] = {}
        self._invalidated: dict[str, Invalidation] = {}

    @property
    def user_id(self) -> str:
        return self.cs.user_id

    def _vertex(self, vertex: Vertex) -> Vertex:
        return self._vertices.setdefault(vertex.id, vertex)

    def _edge(self, kind: EdgeKind, source: str, relation: str, target: str, src: Source) -> None:
        edge_id = ids.edge_id(self.user_id, kind.value, source, relation, target)
        self._edges.setdefault(
            edge_id,
            Edge(
                id=edge_id,
                user_id=self.user_id,
                kind=kind,
                source=source,
                target=target,
                relation=relation,
                props={"event_id": src.event_id},
                t_valid=src.event_time,
            ),
        )

    def _object(self, name: str, src: Source) -> Vertex:
        name = " ".join(name.split())
        return self._vertex(
            Vertex(
                id=ids.object_id(self.user_id, name),
                user_id=self.user_id,
                kind=VertexKind.OBJECT,
                name=name,
                t_created=src.ingest_time,
                t_valid=src.event_time,
            )
        )

    def add(self, src: Source, out: MessageOut | None, known: dict[str, KnownRef]) -> None:
        episode = self._vertex(
            Vertex(
                id=ids.episode_id(self.user_id, src.event_id, src.chunk),
                user_id=self.user_id,
                kind=VertexKind.EPISODIC,
                name=src.text,
                props=src.props,
                t_created=src.ingest_time,
                t_valid=src.event_time,
            )
        )
        if out is None:
            return
        touched: set[str] = set()
        for thesis_out in out.theses:
            thesis = self._vertex(
                Vertex(
                    id=ids.thesis_id(self.user_id, thesis_out.text),
                    user_id=self.user_id,
                    kind=VertexKind.THESIS,
                    name=thesis_out.text,
                    props={"event_id": src.event_id},
                    t_created=src.ingest_time,
                    t_valid=src.event_time,
                    episode_label=EpisodeLabel(thesis_out.kind),
                    temporal_label=TemporalLabel(thesis_out.temporal),
                )
            )
            touched.add(thesis.id)
            for entity in thesis_out.entities:
                obj = self._object(entity, src)
                touched.add(obj.id)
                self._edge(EdgeKind.THESIS, obj.id, EdgeKind.THESIS.value, thesis.id, src)
            for ref in thesis_out.replaces:
                old = known.get(ref)
                if old is None or old.id == thesis.id:
                    continue
                self._invalidate(old, thesis, src)
        for triple in out.triples:
            subject, obj = self._object(triple.subject, src), self._object(triple.object, src)
            if subject.id == obj.id:
                continue
            touched.update((subject.id, obj.id))
            self._edge(EdgeKind.RELATION, subject.id, " ".join(triple.relation.lower().split()), obj.id, src)
        for vertex_id in sorted(touched):
            self._edge(EdgeKind.EPISODIC, vertex_id, EdgeKind.EPISODIC.value, episode.id, src)

    def _invalidate(self, old: KnownRef, new: Vertex, src: Source) -> None:
        if old.t_valid is not None and new.t_valid is not None and old.t_valid > new.t_valid:
            # The "new" statement describes an earlier time (a late, out-of-order event): it is the one that
            # ended when the old one became true.
            self._invalidated.setdefault(
                new.id,
                Invalidation(thesis_id=new.id, invalidated_by=old.id, t_invalid=old.t_valid, t_expired=src.ingest_time),
            )
            return
        assert new.t_valid is not None
        self._invalidated.setdefault(
            old.id,
            Invalidation(thesis_id=old.id, invalidated_by=new.id, t_invalid=new.t_valid, t_expired=src.ingest_time),
        )

    def build(self, llm_calls: int) -> ChangeSet:
        self.cs.vertices = list(self._vertices.values())
        self.cs.edges = list(self._edges.values())
        self.cs.invalidations = list(self._invalidated.values())
        self.cs.llm_calls = llm_calls
        return self.cs
