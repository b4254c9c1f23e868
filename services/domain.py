"""The PersonalAI memory-graph model: object, thesis and episodic vertices, and the edges between them."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

from services.validity import held, holes, in_gap, with_gaps

#: object prop of an alias record: the id of the object this name was merged into (``services.memorize.entities``)
ALIAS_OF = "alias_of"


class VertexKind(StrEnum):
    OBJECT = "object"  # an entity
    THESIS = "thesis"  # a self-contained statement (the paper's "hyper" vertex)
    EPISODIC = "episodic"  # the raw message or document chunk


class EdgeKind(StrEnum):
    RELATION = "relation"  # object -> object, named by ``relation``
    THESIS = "thesis"  # object -> thesis
    EPISODIC = "episodic"  # object or thesis -> episodic


class EpisodeLabel(StrEnum):
    FACT = "FACT"
    OPINION = "OPINION"
    PREDICTION = "PREDICTION"


class TemporalLabel(StrEnum):
    STATIC = "STATIC"
    DYNAMIC = "DYNAMIC"
    ATEMPORAL = "ATEMPORAL"


class Mark(StrEnum):
    """A link between two valid theses that the label rules keep both of (``services.memorize.labels``)."""

    CONFLICTS_WITH = "conflicts_with"  # a contradicted STATIC or ATEMPORAL thesis and its contradiction
    CONFIRMED_BY = "confirmed_by"  # a PREDICTION and the later thesis that shows it came true
    REFUTED_BY = "refuted_by"  # a PREDICTION and the later thesis that shows it did not
    CONFIRMS = "confirms"
    REFUTES = "refutes"


#: the mark the other side of a link carries
MARK_PARTNER = {
    Mark.CONFLICTS_WITH: Mark.CONFLICTS_WITH,
    Mark.CONFIRMED_BY: Mark.CONFIRMS,
    Mark.CONFIRMS: Mark.CONFIRMED_BY,
    Mark.REFUTED_BY: Mark.REFUTES,
    Mark.REFUTES: Mark.REFUTED_BY,
}
MARKS = "marks"  # thesis prop: its marks (JSON), see ``thesis_marks``
#: characters of a message shown beside a thesis that came from it (a chat turn whole, a document chunk's opening)
SAID_CHARS = 400
HOLDER = "holder"  # thesis prop of an OPINION or PREDICTION: who thinks or expects it


class ThesisMark(BaseModel):
    """One mark of a thesis: the other thesis's id, with its text and date so the reader needs no lookup."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mark: Mark
    id: str
    text: str
    date: str = ""

    def describe(self) -> str:
        when = f" {self.date}" if self.date else ""
        return {
            Mark.CONFLICTS_WITH: f"conflicts with:{f' [{self.date}]' if self.date else ''} {self.text}",
            Mark.CONFIRMED_BY: f"prediction, confirmed{when} by: {self.text}",
            Mark.REFUTED_BY: f"prediction, refuted{when} by: {self.text}",
            Mark.CONFIRMS: f"confirms the prediction{f' of {self.date}' if self.date else ''}: {self.text}",
            Mark.REFUTES: f"refutes the prediction{f' of {self.date}' if self.date else ''}: {self.text}",
        }[self.mark]


def thesis_marks(props: Mapping[str, str]) -> list[ThesisMark]:
    return [ThesisMark.model_validate(m) for m in json.loads(props.get(MARKS, "[]"))]


def with_marks(props: Mapping[str, str], marks: Iterable[ThesisMark]) -> dict[str, str]:
    """``props`` carrying exactly ``marks`` (one per mark and thesis, in a fixed order; none: no prop)."""
    unique = {(m.mark.value, m.id): m for m in marks}
    out = {k: v for k, v in props.items() if k != MARKS}
    if unique:
        records = [unique[key].model_dump(mode="json") for key in sorted(unique)]
        out[MARKS] = json.dumps(records, sort_keys=True, ensure_ascii=False)
    return out


class Vertex(BaseModel):
    """A vertex. ``name`` is the entity name, the thesis text or the episode text.

    Theses are bi-temporal: ``t_valid``/``t_invalid`` are on the world's clock (event time), ``t_created``/
    ``t_expired`` on memstream's clock (ingest time). Invalidation never deletes.
    """

    model_config = ConfigDict(extra="forbid")

    id: str
    user_id: str
    kind: VertexKind
    name: str
    props: dict[str, str] = Field(default_factory=dict)
    t_created: datetime | None = None
    t_valid: datetime | None = None
    t_expired: datetime | None = None
    t_invalid: datetime | None = None
    invalidated_by: str | None = None
    episode_label: EpisodeLabel | None = None
    temporal_label: TemporalLabel | None = None

    def valid_at(self, when: datetime | None) -> bool:
        """True if this vertex held at ``when`` (``None``: now, i.e. not invalidated)."""
        if self.kind is VertexKind.EPISODIC:
            # a message is memory from the moment it was said
            return when is None or self.t_valid is None or self.t_valid <= when
        if self.kind is not VertexKind.THESIS:
            return True
        if when is None:
            return self.t_invalid is None
        if self.t_valid is not None and self.t_valid > when:
            return False
        return (self.t_invalid is None or self.t_invalid > when) and not in_gap(self.props, when)

    @property
    def text(self) -> str:
        if self.kind is VertexKind.THESIS and self.t_valid is not None:
            return f"[{self.t_valid.date().isoformat()}] {self.name}"
        return self.name

    @property
    def alias_of(self) -> str | None:
        """For an alias record (an object vertex named as the user once said it), the object it stands for."""
        return self.props.get(ALIAS_OF) if self.kind is VertexKind.OBJECT else None

    @property
    def context(self) -> str:
        """What the QA reader is shown: ``text`` with the label and holder of an opinion or prediction and the
        thesis's marks ("[2023-03-01] OPINION (Ben): ... (conflicts with: ...)"). Not embedded or compared: the
        retrievers rank and deduplicate by ``text``."""
        if self.kind is VertexKind.EPISODIC and self.t_valid is not None:
            # when it was said: "yesterday" in a message means nothing without it
            return f"[{self.t_valid.date().isoformat()}] {self.name}"
        if self.kind is not VertexKind.THESIS:
            return self.text
        date = f"[{self.t_valid.date().isoformat()}] " if self.t_valid is not None else ""
        label = ""
        if self.episode_label in (EpisodeLabel.OPINION, EpisodeLabel.PREDICTION):
            holder = self.props.get(HOLDER)
            label = f"{self.episode_label.value}{f' ({holder})' if holder else ''}: "
        notes = "".join(f" ({m.describe()})" for m in thesis_marks(self.props))
        return f"{date}{label}{self.name}{notes}"


class Edge(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    user_id: str
    kind: EdgeKind
    source: str
    target: str
    relation: str
    props: dict[str, str] = Field(default_factory=dict)
    t_valid: datetime | None = None
    # a relation edge is bi-temporal like the theses that state it: invalidated when the last valid thesis stating
    # it is (``t_invalid``, world clock; ``t_expired``, ingest clock); thesis and episodic edges are never
    # invalidated, their thesis's validity governs them
    t_expired: datetime | None = None
    t_invalid: datetime | None = None
    invalidated_by: str | None = None

    def valid_at(self, when: datetime | None) -> bool:
        """True if this edge held at ``when`` (``None``: now, i.e. not invalidated). An edge that ended and was
        stated again later did not hold in between (``services.validity``)."""
        if when is None:
            return self.t_invalid is None
        if self.t_valid is not None and self.t_valid > when:
            return False
        return (self.t_invalid is None or self.t_invalid > when) and not in_gap(self.props, when)

    def stated_by(self, staters: Sequence[Vertex]) -> Edge:
        """This relation edge with the validity the theses stating it give it: valid while one of them is,
        otherwise ended when the last of them was (as ``ChangeSetBuilder`` ends it when it invalidates its last
        valid stater), and not holding between their times (its gaps, ``services.validity``)."""
        between = holes(i for v in staters for i in held(v.t_valid, v.t_invalid, v.props))
        props = with_gaps(self.props, between)
        if any(v.t_invalid is None for v in staters):
            return self.model_copy(
                update={"t_invalid": None, "t_expired": None, "invalidated_by": None, "props": props}
            )
        last = max(staters, key=lambda v: (v.t_expired is not None, v.t_expired, v.t_invalid, v.id))
        ended = {"t_invalid": last.t_invalid, "t_expired": last.t_expired, "invalidated_by": last.invalidated_by}
        return self.model_copy(update={**ended, "props": props})


class Triplet(BaseModel):
    """An edge with both ends, as retrievers hand it to the QA pipeline."""

    model_config = ConfigDict(extra="forbid")

    start: Vertex
    edge: Edge
    end: Vertex

    @property
    def id(self) -> str:
        return self.edge.id

    @property
    def text(self) -> str:
        if self.edge.kind is EdgeKind.RELATION:
            return f"{self.start.name} {self.edge.relation} {self.end.name}"
        # object->thesis and ->episodic triplets read as the statement itself, as in PersonalAI
        return self.end.text

    @property
    def context(self) -> str:
        """What the QA reader is shown (``Vertex.context`` for a statement); a thesis with the message it came
        from: "[2023-05-20] Mel ran a charity race (said: [2023-05-25] Mel: I ran a charity race last Saturday)"."""
        if self.edge.kind is EdgeKind.RELATION:
            return self.text
        if self.edge.kind is EdgeKind.EPISODIC and self.start.kind is VertexKind.THESIS:
            said = self.end.context
            if len(said) > SAID_CHARS:  # a document chunk: its opening, so that a context of them fits the window
                said = said[:SAID_CHARS].rsplit(" ", 1)[0] + " …"
            return f"{self.start.context} (said: {said})"
        return self.end.context


class Invalidation(BaseModel):
    model_config = ConfigDict(extra="forbid")

    thesis_id: str
    invalidated_by: str
    t_invalid: datetime
    t_expired: datetime


class EdgeInvalidation(BaseModel):
    """A relation edge no valid thesis states any more: it ended when its last stater did (first one wins)."""

    model_config = ConfigDict(extra="forbid")

    edge_id: str
    invalidated_by: str = Field(description="The thesis whose invalidation of the last stater ended it.")
    t_invalid: datetime
    t_expired: datetime


class PropsUpdate(BaseModel):
    """The props of a known thesis as a change set leaves them (its marks changed), whole: read by memorize just
    before, which is safe since one user's change sets are made and written one at a time."""

    model_config = ConfigDict(extra="forbid")

    thesis_id: str
    props: dict[str, str]


class ChangeSet(BaseModel):
    """Everything one memorize step writes for one user. Applied atomically (embedded) or idempotently (remote)."""

    model_config = ConfigDict(extra="forbid")

    id: str
    user_id: str
    event_ids: list[str]
    vertices: list[Vertex] = Field(default_factory=list)
    edges: list[Edge] = Field(default_factory=list)
    invalidations: list[Invalidation] = Field(default_factory=list)
    edge_invalidations: list[EdgeInvalidation] = Field(default_factory=list)
    props_updates: list[PropsUpdate] = Field(default_factory=list)
    llm_calls: int = 0
    event_time: datetime | None = Field(default=None, description="The latest event time of its events.")

    def restated_theses(self) -> list[Vertex]:
        """The theses it writes that hold from their ``t_valid``, not invalidated on arrival: one the store already
        has ended at or before then holds again (``services.validity.reopened``)."""
        invalidated = {inv.thesis_id for inv in self.invalidations}
        return [
            v
            for v in self.vertices
            if v.kind is VertexKind.THESIS and v.t_invalid is None and v.t_valid is not None and v.id not in invalidated
        ]


class Announcement(BaseModel):
    """What a written change set announces on the memory-update topic.

    The store keeps it, written in the same transaction that marks the change set's events applied, until the
    publish is acknowledged: a crash in between leaves it pending, and the replay of those events announces it."""

    model_config = ConfigDict(extra="forbid")

    change_set_id: str
    user_id: str
    event_ids: list[str]
    event_time: datetime
    committed_at: datetime
    vertices_added: int = 0
    edges_added: int = 0
    theses_added: int = 0
    theses_invalidated: int = 0
    llm_calls: int = 0

    @classmethod
    def of(cls, change_set: ChangeSet, result: ApplyResult) -> Announcement:
        """The announcement of ``change_set`` as the store just wrote it (committed now)."""
        committed = datetime.now(UTC)
        return cls(
            change_set_id=change_set.id,
            user_id=change_set.user_id,
            event_ids=change_set.event_ids,
            event_time=change_set.event_time or committed,
            committed_at=committed,
            vertices_added=result.vertices_added,
            edges_added=result.edges_added,
            theses_added=result.theses_added,
            theses_invalidated=result.theses_invalidated,
            llm_calls=change_set.llm_calls,
        )


class ApplyResult(BaseModel):
    vertices_added: int = 0
    edges_added: int = 0
    theses_added: int = 0
    theses_invalidated: int = 0
    skipped_events: list[str] = Field(default_factory=list)
    announcement: Announcement | None = Field(
        default=None, description="Pending until announced; None when every event was applied before (nothing written)."
    )


class Stats(BaseModel):
    user_id: str
    vertices: dict[str, int]
    edges: dict[str, int]
    theses_valid: int
    theses_invalidated: int
    events: int


class Erasure(BaseModel):
    """What one forget removes from a user's memory and what it repairs, computed by ``services.memorize.forget``.

    ``put_vertices``/``put_edges`` replace kept items whole: a thesis a removed thesis had invalidated is valid
    again, and a kept item whose first source was forgotten takes its times from the next one. ``event_ids`` are
    recorded as forgotten (a replay or a redelivery of one of them memorizes nothing), and ``outcome`` (the
    MemoryForgotten JSON) is kept under ``forget_id`` so a replayed tombstone announces the same thing again.
    Undoing an entity merge (``services.memorize.unmerge``) rewrites memory through it too, with no events."""

    model_config = ConfigDict(extra="forbid")

    forget_id: str
    user_id: str
    event_ids: list[str] = Field(default_factory=list)
    delete_vertices: list[str] = Field(default_factory=list)
    delete_edges: list[str] = Field(default_factory=list)
    delete_vectors: list[str] = Field(default_factory=list, description="Vertex and relation-edge ids indexed.")
    put_vertices: list[Vertex] = Field(default_factory=list)
    put_edges: list[Edge] = Field(default_factory=list)
    whole_user: bool = Field(default=False, description="Everything of the user goes; the lists are not used.")
    outcome: str = ""
