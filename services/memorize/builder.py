"""Turn validated extraction output into a change set with deterministic ids (PersonalAI memorize steps 1-4)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, date, datetime, time, timedelta
from typing import Any

from services import ids, metrics
from services.domain import (
    ALIAS_OF,
    HOLDER,
    MARK_PARTNER,
    ChangeSet,
    Edge,
    EdgeInvalidation,
    EdgeKind,
    EpisodeLabel,
    Invalidation,
    Mark,
    PropsUpdate,
    TemporalLabel,
    ThesisMark,
    Vertex,
    VertexKind,
    thesis_marks,
    with_marks,
)
from services.memorize.extraction import Alias, Fact, ItemFacts
from services.memorize.labels import Outcome, Side, decide
from services.memorize.when import When


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
    """A known (stored, valid) thesis judged with a new fact: the new one may replace it, contradict it or confirm
    or refute it, as ``verdict`` and the labels of both say (``services.memorize.labels``)."""

    id: str
    t_valid: datetime | None
    #: the relation edge it states (``ids.stated_relation``), if any
    relation: str | None = None
    #: the other valid theses the store knows to state that edge too: while one stays valid, so does the edge
    co_staters: frozenset[str] = frozenset()
    #: the resolve verdict on the pair (``services.memorize.resolve``)
    verdict: str = "updates"
    name: str = ""
    kind: EpisodeLabel = EpisodeLabel.FACT
    temporal: TemporalLabel = TemporalLabel.DYNAMIC
    #: its props as read (its marks and holder among them): rewritten whole when its marks change
    props: Mapping[str, str] = field(default_factory=dict)
    #: the props of the theses its marks name, so ending it can take its mark off them
    partners: Mapping[str, Mapping[str, str]] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        thesis: Vertex,
        known: Iterable[Vertex] = (),
        verdict: str = "updates",
        partners: Mapping[str, Mapping[str, str]] | None = None,
    ) -> KnownRef:
        relation = ids.stated_relation(thesis.user_id, thesis.props)
        others = frozenset(
            v.id
            for v in known
            if relation is not None
            and v.id != thesis.id
            and v.t_invalid is None
            and ids.stated_relation(v.user_id, v.props) == relation
        )
        return cls(
            thesis.id,
            thesis.t_valid,
            relation,
            others,
            verdict,
            thesis.name,
            thesis.episode_label or EpisodeLabel.FACT,
            thesis.temporal_label or TemporalLabel.DYNAMIC,
            dict(thesis.props),
            dict(partners or {}),
        )


#: the ends of a fact an alias can name (``Fact.subject_alias``/``object_alias``; thesis props of the same names)
ALIAS_ENDS = ("subject", "object")
MERGED = "merged"  # episode prop: the facts of this source that repeat a known thesis (JSON), see ``merged_facts``


def fact_record(fact: Fact) -> dict[str, Any]:
    record: dict[str, Any] = {
        k: getattr(fact, k) for k in ("subject", "text", "relation", "object", "kind", "temporal")
    }
    if fact.when is not None:
        record["when"] = {
            "start": fact.when.start.isoformat(),
            "end": fact.when.end.isoformat(),
            "text": fact.when.text,
        }
        record["when"] |= {k: True for k in ("ended", "open_start") if getattr(fact.when, k)}
    if fact.unresolved:
        record["unresolved"] = fact.unresolved
    if fact.cut:
        record["cut"] = True
    for end in ALIAS_ENDS:
        alias = getattr(fact, f"{end}_alias")
        if alias is not None:
            record[f"{end}_alias"] = asdict(alias)
    return record


def fact_of(record: Mapping[str, Any]) -> Fact:
    raw = record.get("when")
    when = (
        None
        if not raw
        else When(
            date.fromisoformat(raw["start"]),
            date.fromisoformat(raw["end"]),
            raw["text"],
            ended=bool(raw.get("ended")),
            open_start=bool(raw.get("open_start")),
        )
    )
    fields = {k: str(record[k]) for k in ("subject", "text", "relation", "object", "kind", "temporal")}
    subject_alias, object_alias = (
        Alias(**record[f"{e}_alias"]) if record.get(f"{e}_alias") else None for e in ALIAS_ENDS
    )
    return Fact(
        **fields,
        when=when,
        unresolved=str(record.get("unresolved", "")),
        cut=bool(record.get("cut")),
        subject_alias=subject_alias,
        object_alias=object_alias,
    )


def merged_facts(episode: Vertex) -> dict[str, list[Fact]]:
    """Per known thesis id, the facts of this episode that were merged into it (its own wording of them)."""
    found: dict[str, list[Fact]] = {}
    for entry in json.loads(episode.props.get(MERGED, "[]")):
        found.setdefault(str(entry["thesis"]), []).append(fact_of(entry["fact"]))
    return found


def thesis_text(fact: Fact) -> str:
    """A fact as stored: the date it is about goes into its text, so every retriever and the reader see it. Time
    words no date could be read from ("since I was 12") go in as said, unless the fact already says them."""
    if fact.when is not None:
        return f"{fact.text.rstrip('.')} ({fact.when.describe()})."
    if fact.unresolved and ids.normalize_text(fact.unresolved) not in ids.normalize_text(fact.text):
        return f'{fact.text.rstrip(".")} (as said: "{fact.unresolved}").'
    return fact.text


def _day(when: datetime | None) -> str:
    return when.date().isoformat() if when is not None else ""


def _midnight(day: date) -> datetime:
    return datetime.combine(day, time(), tzinfo=UTC)


def validity(when: When | None, kind: str, said_at: datetime) -> tuple[datetime, datetime | None]:
    """When a thesis starts and stops being true on the world's clock (``t_valid``, ``t_invalid``).

    Without time words it holds from when it was said. With them, from the first day they name (00:00 UTC):
    "I went to Paris last weekend", said Friday 12 May 2023, holds from 6 May; "in March" from 1 March. An event
    or a period it was true in stays valid after it as a record of what happened; only words that say a state
    stopped ("until June", "from 2019 to 2021": ``When.ended``) end it, on the day after the last one named
    (1 January 2022). Words that only name the end ("until June") give the end's period as the start, the only
    time known, unless the statement was made earlier (then it holds from when it was said).

    Never later than it was said: a plan or prediction ("next week I fly to Rome", a PREDICTION or a time still
    to come) holds, as a plan, from when it was said; its date is in its text. An end still to come ("I'm in
    Berlin until June", said in May) is not a ``t_invalid`` either, since the stores take any ``t_invalid`` as
    "no longer true now": it stays in the text and ``when_end``, and a later message ends it."""
    if when is None or kind == EpisodeLabel.PREDICTION.value:
        return said_at, None
    start = _midnight(when.start)
    if start > said_at:
        return said_at, None
    end = _midnight(when.end + timedelta(days=1)) if when.ended else None
    if when.open_start and end is not None and end <= said_at:
        return start, end
    if when.open_start:
        return said_at, None
    return start, end if end is not None and end <= said_at else None


def valid_from_props(props: Mapping[str, str], kind: str, said_at: datetime) -> tuple[datetime, datetime | None]:
    """``validity`` of a stored thesis, from the ``when_*`` props ``ChangeSetBuilder`` wrote and when its source
    said it (what forgetting its first source re-derives it from)."""
    if not props.get("when_start") or not props.get("when_end"):
        return said_at, None
    when = When(
        date.fromisoformat(props["when_start"]),
        date.fromisoformat(props["when_end"]),
        props.get("when_text", ""),
        ended=props.get("when_ended") == "true",
        open_start=props.get("when_open_start") == "true",
    )
    return validity(when, kind, said_at)


def holder_of(fact: Fact) -> str:
    """Who thinks or expects an opinion or a prediction ("" for a fact): its subject, as extraction names it
    (first-person facts: the speaker). An opinion is superseded only by its holder's later one, and the reader
    says whose it is."""
    return fact.subject if fact.kind in (EpisodeLabel.OPINION.value, EpisodeLabel.PREDICTION.value) else ""


class ChangeSetBuilder:
    def __init__(self, user_id: str, change_set_id: str, event_ids: list[str]) -> None:
        self.cs = ChangeSet(id=change_set_id, user_id=user_id, event_ids=event_ids)
        self._vertices: dict[str, Vertex] = {}
        self._edges: dict[str, Edge] = {}
        self._invalidated: dict[str, Invalidation] = {}
        #: per relation edge this change set writes, the new theses stating it
        self._stated: dict[str, list[str]] = {}
        #: the known theses invalidated, with the relation edge each stated
        self._replaced: dict[str, KnownRef] = {}
        #: new theses whose own words say they stopped ("from 2019 to 2021"): their t_invalid and t_expired
        self._ended: dict[str, tuple[datetime, datetime]] = {}
        #: per thesis whose marks this change set changes, its marks now
        self._marks: dict[str, list[ThesisMark]] = {}
        #: known theses whose marks may change: their props as read
        self._known_props: dict[str, Mapping[str, str]] = {}

    @property
    def user_id(self) -> str:
        return self.cs.user_id

    def _vertex(self, vertex: Vertex) -> Vertex:
        return self._vertices.setdefault(vertex.id, vertex)

    def _edge(
        self, kind: EdgeKind, source: str, relation: str, target: str, src: Source, t_valid: datetime | None = None
    ) -> str:
        """``t_valid``: the world time it holds from, the stating thesis's (default: when it was said)."""
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
                t_valid=t_valid or src.event_time,
            ),
        )
        return edge_id

    def _object(self, name: str, src: Source, props: dict[str, str] | None = None) -> Vertex:
        name = " ".join(name.split())
        return self._vertex(
            Vertex(
                id=ids.object_id(self.user_id, name),
                user_id=self.user_id,
                kind=VertexKind.OBJECT,
                name=name,
                props=props or {},
                t_created=src.ingest_time,
                t_valid=src.event_time,
            )
        )

    def _alias(self, alias: Alias, src: Source) -> Vertex:
        """The alias record of a merged name: an object vertex under the name as said (the id it would have had),
        pointing at the canonical object, with the evidence of the first merge. Indexed and found by its name like
        any object, so a question naming "Mel" reaches Melanie; linked to every episode that said it, so
        forgetting them all removes it (``services.memorize.forget``)."""
        evidence = {k: v for k, v in asdict(alias).items() if k not in ("said", "canonical")}
        props = {
            ALIAS_OF: alias.canonical,
            "alias_evidence": json.dumps(evidence | {"event_id": src.event_id}, sort_keys=True),
        }
        return self._object(alias.said, src, props)

    def add(self, src: Source, found: ItemFacts | None, same_as: dict[int, str] | None = None) -> list[str]:
        """The episode of ``src`` and its facts; returns the thesis id of each fact, in order.

        ``same_as`` maps a fact's index to a known thesis it repeats: that thesis gains this episode as a source
        instead of a second, reworded copy being written."""
        latest = self.cs.event_time
        self.cs.event_time = src.event_time if latest is None else max(latest, src.event_time)
        props = dict(src.props)
        merged = [
            {"thesis": known, "fact": fact_record(found.facts[n])}
            for n, known in sorted((same_as or {}).items())
            if found is not None and n < len(found.facts)
        ]
        if merged:
            # its own wording of what it repeats: if the thesis's first source is forgotten, this one's fact is
            # written as its own (services/memorize/forget.py), as if the first had never been said
            props[MERGED] = json.dumps(merged, sort_keys=True, ensure_ascii=False)
        episode = self._vertex(
            Vertex(
                id=ids.episode_id(self.user_id, src.event_id, src.chunk),
                user_id=self.user_id,
                kind=VertexKind.EPISODIC,
                name=src.text,
                props=props,
                t_created=src.ingest_time,
                t_valid=src.event_time,
            )
        )
        if found is None:
            return []
        touched: set[str] = set()
        # Who said it (a chat speaker) or what it is about (a document's title) is an object of every episode, so
        # each message stays reachable from, and shown beside, a vertex even when extraction kept no fact of it:
        # what the model missed is still found in the words said.
        author = src.props.get("speaker") or src.props.get("title")
        if author and author.strip():
            touched.add(self._object(author, src).id)
        thesis_ids: list[str] = []
        for n, fact in enumerate(found.facts):
            for alias in (fact.subject_alias, fact.object_alias):
                if alias is not None:
                    touched.add(self._alias(alias, src).id)
            known = (same_as or {}).get(n)
            if known is not None:
                thesis_ids.append(known)
                touched.add(known)
                continue
            thesis = self._vertex(self._thesis(fact, src))
            thesis_ids.append(thesis.id)
            touched.add(thesis.id)
            entities = [self._object(fact.subject, src)]
            if fact.object:
                entities.append(self._object(fact.object, src))
            for obj in entities:
                touched.add(obj.id)
                self._edge(EdgeKind.THESIS, obj.id, EdgeKind.THESIS.value, thesis.id, src, thesis.t_valid)
            if fact.object and fact.relation and entities[0].id != entities[-1].id:
                relation = " ".join(fact.relation.lower().split())
                edge_id = self._edge(EdgeKind.RELATION, entities[0].id, relation, entities[-1].id, src, thesis.t_valid)
                stated = self._stated.setdefault(edge_id, [])
                if thesis.id not in stated:
                    stated.append(thesis.id)
        for vertex_id in sorted(touched):
            self._edge(EdgeKind.EPISODIC, vertex_id, EdgeKind.EPISODIC.value, episode.id, src)
        return thesis_ids

    def _thesis(self, fact: Fact, src: Source) -> Vertex:
        thesis = thesis_vertex(self.user_id, fact, src)
        t_invalid = validity(fact.when, fact.kind, src.event_time)[1]
        if t_invalid is not None and thesis.id not in self._vertices:
            # its own words say it stopped: not invalidated by anything, a record of a state that ended
            self._ended.setdefault(thesis.id, (t_invalid, src.ingest_time))
        return thesis

    def invalidate(self, old: KnownRef, new_id: str, src: Source) -> None:
        """Apply the verdict on a known thesis and a new one under the label rules (``labels.decide``): one ends
        the other, both are marked conflicting, or the new one confirms or refutes the known prediction."""
        new = self._vertices.get(new_id)
        if new is None or new.kind is not VertexKind.THESIS or old.id == new_id:
            return
        self._known_props.setdefault(old.id, old.props)
        for partner, props in old.partners.items():
            self._known_props.setdefault(partner, props)
        known = Side(old.kind, old.temporal, old.props.get(HOLDER, ""), old.t_valid, self._in_conflict(old.id))
        outcome = decide(old.verdict, self._side(new), known)
        metrics.LABEL_OUTCOMES.labels(outcome.value).inc()
        if outcome is Outcome.SUPERSEDE:
            ended = self._invalidate(old, new, src)
            if ended is not None:  # a thesis in conflict that ends was the wrong side: the conflict is settled
                self._unmark_conflicts(ended)
        elif outcome is not Outcome.KEEP:
            mark = {Outcome.CONFLICT: Mark.CONFLICTS_WITH, Outcome.CONFIRM: Mark.CONFIRMS}.get(outcome, Mark.REFUTES)
            self._link(new, old, mark)

    def _side(self, thesis: Vertex) -> Side:
        return Side(
            thesis.episode_label or EpisodeLabel.FACT,
            thesis.temporal_label or TemporalLabel.DYNAMIC,
            thesis.props.get(HOLDER, ""),
            thesis.t_valid,
            self._in_conflict(thesis.id),
        )

    def _marks_of(self, thesis_id: str) -> list[ThesisMark]:
        if thesis_id in self._marks:
            return self._marks[thesis_id]
        vertex = self._vertices.get(thesis_id)
        return thesis_marks(vertex.props if vertex is not None else self._known_props.get(thesis_id, {}))

    def _in_conflict(self, thesis_id: str) -> bool:
        return any(m.mark is Mark.CONFLICTS_WITH for m in self._marks_of(thesis_id))

    def _link(self, new: Vertex, old: KnownRef, mark: Mark) -> None:
        """``new`` carries ``mark`` to ``old``, ``old`` its partner mark back (each with the other's text and date)."""
        self._marks[new.id] = [
            *self._marks_of(new.id),
            ThesisMark(mark=mark, id=old.id, text=old.name, date=_day(old.t_valid)),
        ]
        back = ThesisMark(mark=MARK_PARTNER[mark], id=new.id, text=new.name, date=_day(new.t_valid))
        self._marks[old.id] = [*self._marks_of(old.id), back]

    def _unmark_conflicts(self, thesis_id: str) -> None:
        """Take the conflict marks between ``thesis_id`` and its partners off both sides."""
        partners = {m.id for m in self._marks_of(thesis_id) if m.mark is Mark.CONFLICTS_WITH}
        if not partners:
            return
        self._marks[thesis_id] = [m for m in self._marks_of(thesis_id) if m.mark is not Mark.CONFLICTS_WITH]
        for partner in partners:
            if partner in self._vertices or partner in self._known_props:
                kept = [m for m in self._marks_of(partner) if not (m.mark is Mark.CONFLICTS_WITH and m.id == thesis_id)]
                self._marks[partner] = kept

    def _invalidate(self, old: KnownRef, new: Vertex, src: Source) -> str | None:
        """Both times are world times: a thesis's ``t_valid`` is the time its words name (``validity``), so a later
        message about an earlier time ("Back in 2019 I worked at Bosch") does not supersede a newer state."""
        if old.t_valid is not None and new.t_valid is not None and old.t_valid > new.t_valid:
            # The "new" statement describes an earlier time (a late, out-of-order event): it is the one that
            # ended when the old one became true, unless its own words end it before that.
            own = self._ended.get(new.id)
            if own is not None and own[0] <= old.t_valid:
                return None
            self._invalidated.setdefault(
                new.id,
                Invalidation(thesis_id=new.id, invalidated_by=old.id, t_invalid=old.t_valid, t_expired=src.ingest_time),
            )
            return new.id
        assert new.t_valid is not None
        self._invalidated.setdefault(
            old.id,
            Invalidation(thesis_id=old.id, invalidated_by=new.id, t_invalid=new.t_valid, t_expired=src.ingest_time),
        )
        self._replaced.setdefault(old.id, old)
        return old.id

    def _still_stated(self, edge_id: str, known: frozenset[str] = frozenset()) -> bool:
        """Some thesis stating ``edge_id`` stays valid after this change set: a new one not invalidated on
        arrival, or a known one (``known``) this change set does not invalidate."""
        staters = [*self._stated.get(edge_id, []), *known]
        return any(thesis not in self._invalidated and thesis not in self._ended for thesis in staters)

    def _edge_validity(self) -> list[EdgeInvalidation]:
        """Relation edges follow the theses that state them: a new edge whose every new stater is invalidated on
        arrival (a late, out-of-order fact) is written invalidated like them, and the edge of a known thesis this
        change set invalidates ends with it unless another valid thesis still states it. Known staters are those
        the caller gave (``KnownRef.co_staters``, the user's valid theses about the subject)."""
        for edge_id, staters in self._stated.items():
            if not self._still_stated(edge_id):
                inv = self._invalidated.get(staters[0])
                if inv is not None:
                    update: dict[str, Any] = {
                        "t_invalid": inv.t_invalid,
                        "t_expired": inv.t_expired,
                        "invalidated_by": inv.invalidated_by,
                    }
                else:  # its stater's own words ended it
                    t_invalid, t_expired = self._ended[staters[0]]
                    update = {"t_invalid": t_invalid, "t_expired": t_expired, "invalidated_by": None}
                self._edges[edge_id] = self._edges[edge_id].model_copy(update=update)
        ended: dict[str, EdgeInvalidation] = {}
        for old in self._replaced.values():
            if old.relation is None or self._still_stated(old.relation, old.co_staters):
                continue
            inv = self._invalidated[old.id]
            ended.setdefault(
                old.relation,
                EdgeInvalidation(
                    edge_id=old.relation,
                    invalidated_by=inv.invalidated_by,
                    t_invalid=inv.t_invalid,
                    t_expired=inv.t_expired,
                ),
            )
        return list(ended.values())

    def _props_updates(self) -> list[PropsUpdate]:
        """Marks changed: a new thesis carries them in its props, a known one's props are rewritten whole."""
        updates = []
        for thesis_id, marks in sorted(self._marks.items()):
            vertex = self._vertices.get(thesis_id)
            if vertex is not None:
                self._vertices[thesis_id] = vertex.model_copy(update={"props": with_marks(vertex.props, marks)})
            else:
                known = self._known_props[thesis_id]
                props = with_marks(known, marks)
                if props != dict(known):
                    updates.append(PropsUpdate(thesis_id=thesis_id, props=props))
        return updates

    def build(self, llm_calls: int) -> ChangeSet:
        self.cs.edge_invalidations = self._edge_validity()
        self.cs.props_updates = self._props_updates()
        for thesis_id, (t_invalid, t_expired) in self._ended.items():
            if thesis_id not in self._invalidated:  # an invalidation on arrival is written by the store instead
                self._vertices[thesis_id] = self._vertices[thesis_id].model_copy(
                    update={"t_invalid": t_invalid, "t_expired": t_expired}
                )
        self.cs.vertices = list(self._vertices.values())
        self.cs.edges = list(self._edges.values())
        self.cs.invalidations = list(self._invalidated.values())
        self.cs.llm_calls = llm_calls
        return self.cs


def thesis_vertex(user_id: str, fact: Fact, src: Source) -> Vertex:
    """The thesis vertex of ``fact`` said in ``src``: its text, props (who, what relation to what, when) and
    validity, as every change set writes it."""
    text = thesis_text(fact)
    props = {"event_id": src.event_id, "subject": fact.subject}
    if holder := holder_of(fact):
        props[HOLDER] = holder
    if fact.object and fact.relation:
        # what a later fact is compared with: same subject and relation, another object may replace it
        props |= {"relation": ids.normalize_text(fact.relation), "object": fact.object}
    for end in ALIAS_ENDS:  # the name it was said with: what unmerging an alias moves back
        alias = getattr(fact, f"{end}_alias")
        if alias is not None:
            props[f"{end}_alias"] = alias.said
    if fact.when is not None:
        props |= {
            "when_text": fact.when.text,
            "when_start": fact.when.start.isoformat(),
            "when_end": fact.when.end.isoformat(),
        }
        props |= {f"when_{k}": "true" for k in ("ended", "open_start") if getattr(fact.when, k)}
    elif fact.unresolved:
        props["when_unresolved"] = fact.unresolved  # said, though no date could be read from it
    if fact.cut:
        props["cut"] = "length"  # ended by the sentence bound, not by the model: a reader sees why it stops short
    thesis_id = ids.thesis_id(user_id, text)
    t_valid = validity(fact.when, fact.kind, src.event_time)[0]
    return Vertex(
        id=thesis_id,
        user_id=user_id,
        kind=VertexKind.THESIS,
        name=text,
        props=props,
        t_created=src.ingest_time,
        t_valid=t_valid,
        episode_label=EpisodeLabel(fact.kind),
        temporal_label=TemporalLabel(fact.temporal),
    )
