"""A generated conversational memory of about N triplets (edges) for the QA scale benchmark (``qa_scale``).

The shape follows what memorize writes for a chat (``services.memorize.builder``): every message is an episode
linked to its speaker; each of its 1-3 facts is a thesis linked to its subject and object (thesis edges), with a
relation edge between them when it has an object, and an episodic edge from every vertex it touched to the
episode. Entities are drawn with a Zipf-like law (a few hubs, a long tail; the two speakers are the biggest hubs),
theses carry the message's time over three years, and about 8% of them (with their relation edges) were later
invalidated. Texts are made from generated names, a few dozen relations and filler words.

Vectors are synthetic: ``HashEmbedder`` sums one fixed pseudo-random vector per content word (seeded by the word)
and normalises, so texts that share words are near each other and a nearest-neighbour search has a non-trivial
answer. It is not MiniLM: embedding a million texts with it takes seconds, with MiniLM here about seven hours. The
question vectors come from the same embedder. What a search costs depends on the number and size of the vectors,
not their values; how well a quantized search recalls does depend on the values (see docs/benchmarks.md).

Everything is written through ``MemoryWriter.apply`` in change sets of ``batch`` messages: the production write
path, so the same generator fills the embedded store and Dgraph + Weaviate.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import numpy as np

from services import ids
from services.domain import ChangeSet, Edge, EdgeKind, EpisodeLabel, TemporalLabel, Vertex, VertexKind
from services.ports import Embedder, VectorItem
from services.retrieval.common import STOPWORDS

RELATIONS = [
    "visited", "likes", "works at", "met", "bought", "lives in", "plays", "studies", "adopted", "painted",
    "wrote", "cooked", "moved to", "joined", "left", "taught", "sold", "fixed", "called", "ran with",
    "travelled to", "celebrated", "lost", "found", "read", "watched", "hosted", "married", "helped", "trained",
    "built", "planted", "photographed", "volunteered at", "graduated from", "started", "finished", "borrowed",
    "recommended", "signed up for",
]  # fmt: skip
FILLERS = [
    "last week", "with friends", "in the evening", "over the weekend", "after work", "for the first time",
    "again", "with the kids", "on holiday", "during the summer", "at the festival", "before the trip",
    "with a colleague", "for a charity event", "in the rain", "early in the morning",
]  # fmt: skip
CHAT = [
    "honestly it was great", "I can't stop thinking about it", "you should try it", "it took ages",
    "we laughed a lot", "it was harder than I thought", "I'm so proud", "what a day", "can't wait to go back",
]  # fmt: skip
_SYLLABLES = [
    "ka", "lo", "mi", "ra", "ven", "dor", "sa", "tel", "bri", "an", "ko", "rin", "mar", "el", "tho", "fa",
    "nu", "zel", "or", "pia", "gun", "der", "li", "sto", "vak", "ber", "is", "mon", "ta", "que",
]  # fmt: skip
START = datetime(2021, 1, 1, tzinfo=UTC)
SPAN = timedelta(days=3 * 365)
INVALID_SHARE = 0.08
_WORD = re.compile(r"\w+")


class HashEmbedder(Embedder):
    """Bag of words with one fixed pseudo-random vector per word: cheap, deterministic, neighbours share words."""

    name = "hash-bow"

    def __init__(self, dim: int = 384) -> None:
        self.dim = dim
        self._words: dict[str, np.ndarray] = {}

    def word(self, word: str) -> np.ndarray:
        vec = self._words.get(word)
        if vec is None:
            seed = int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8).digest(), "little")
            vec = np.random.default_rng(seed).standard_normal(self.dim).astype(np.float32)
            self._words[word] = vec
        return vec

    def vectors(self, texts: Sequence[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for row, text in enumerate(texts):
            words = [w for w in _WORD.findall(text.casefold()) if w not in STOPWORDS] or ["<empty>"]
            for w in words:
                out[row] += self.word(w)
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        return out / np.maximum(norms, 1e-12)

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        return self.vectors(texts).tolist()


def names(count: int, rng: np.random.Generator) -> list[str]:
    """``count`` distinct capitalised one-word names made of 2-4 syllables."""
    out: dict[str, None] = {}
    while len(out) < count:
        parts = rng.choice(_SYLLABLES, size=int(rng.integers(2, 5)))
        out.setdefault("".join(parts).capitalize(), None)
    return list(out)


@dataclass
class Fact:
    thesis: Vertex
    subject: str
    relation: str
    object: str | None


@dataclass
class Memory:
    """What was generated for one user: counts, and the facts questions are drawn from."""

    user_id: str
    speakers: tuple[str, str]
    triplets: int = 0
    messages: int = 0
    items: int = 0
    facts: list[Fact] = field(default_factory=list)


class Generator:
    """Change sets of ``batch`` messages each for one user, until about ``triplets`` edges were written."""

    def __init__(self, user_id: str, triplets: int, embedder: HashEmbedder, seed: int, batch: int = 500) -> None:
        self.rng = np.random.default_rng(seed)
        self.user_id = user_id
        self.target = triplets
        self.embedder = embedder
        self.batch = batch
        # about 25 edges per entity over the whole memory, as in LoCoMo's extracted graphs (order of magnitude)
        self.entities = names(max(50, triplets // 25), self.rng)
        weights = 1.0 / np.arange(1, len(self.entities) + 1) ** 1.05  # Zipf-like degrees
        self.weights = weights / weights.sum()
        speakers = self.entities[:2]
        self.memory = Memory(user_id, (speakers[0], speakers[1]))
        self._objects: set[str] = set()
        self._n = 0  # messages so far
        self._messages_total = max(1, triplets // 12)  # ~12 edges per message: spreads the clock evenly

    def _entity(self) -> str:
        return self.entities[int(self.rng.choice(len(self.entities), p=self.weights))]

    def _entities(self, n: int) -> list[str]:
        picks = self.rng.choice(len(self.entities), size=n, p=self.weights)
        return [self.entities[int(i)] for i in picks]

    def change_sets(self) -> Iterator[tuple[ChangeSet, list[VectorItem]]]:
        while self.memory.triplets < self.target:
            yield self._batch()

    def _batch(self) -> tuple[ChangeSet, list[VectorItem]]:
        vertices: dict[str, Vertex] = {}
        edges: dict[str, Edge] = {}
        texts: dict[str, tuple[str, str]] = {}  # item id -> (kind, text)
        events: list[str] = []
        picks = iter(self._entities(self.batch * 8))
        for _ in range(self.batch):
            if self.memory.triplets + len(edges) >= self.target:
                break
            events.append(self._message(picks, vertices, edges, texts))
        self.memory.triplets += len(edges)
        self.memory.messages += len(events)
        self.memory.items += len(texts)
        order = list(texts)
        vectors = self.embedder.vectors([texts[i][1] for i in order])
        items = [
            VectorItem(id=i, kind=texts[i][0], text=texts[i][1], vector=vec.tolist())
            for i, vec in zip(order, vectors, strict=True)
        ]
        change = ChangeSet(
            id=ids.change_set_id(self.user_id, events),
            user_id=self.user_id,
            event_ids=events,
            vertices=list(vertices.values()),
            edges=list(edges.values()),
        )
        return change, items

    def _object(self, name: str, vertices: dict[str, Vertex], texts: dict[str, tuple[str, str]]) -> str:
        oid = ids.object_id(self.user_id, name)
        if name not in self._objects:
            self._objects.add(name)
            vertices[oid] = Vertex(id=oid, user_id=self.user_id, kind=VertexKind.OBJECT, name=name)
            texts[oid] = ("object", name)
        return oid

    def _edge(
        self, edges: dict[str, Edge], kind: EdgeKind, source: str, relation: str, target: str, **kw: object
    ) -> str:
        eid = ids.edge_id(self.user_id, kind.value, source, relation, target)
        edges.setdefault(
            eid, Edge(id=eid, user_id=self.user_id, kind=kind, source=source, target=target, relation=relation, **kw)
        )
        return eid

    def _message(
        self,
        picks: Iterator[str],
        vertices: dict[str, Vertex],
        edges: dict[str, Edge],
        texts: dict[str, tuple[str, str]],
    ) -> str:
        rng = self.rng
        n = self._n
        self._n += 1
        when = START + SPAN * min(1.0, n / self._messages_total) + timedelta(seconds=int(rng.integers(0, 3600)))
        event_id = f"{self.user_id}-m{n}"
        speaker = self.memory.speakers[n % 2]
        touched = {self._object(speaker, vertices, texts)}
        sentences = []
        for _ in range(int(rng.integers(1, 4))):
            subject = speaker if rng.random() < 0.3 else next(picks)
            relation = RELATIONS[int(rng.integers(len(RELATIONS)))]
            obj = next(picks) if rng.random() < 0.8 else None
            if obj == subject:
                obj = None
            filler = FILLERS[int(rng.integers(len(FILLERS)))]
            statement = f"{subject} {relation} {obj + ' ' if obj else ''}{filler}"
            sentences.append(statement)
            invalid = rng.random() < INVALID_SHARE
            t_invalid = when + timedelta(days=int(rng.integers(1, 200))) if invalid else None
            opinion = rng.random() < 0.1
            tid = ids.thesis_id(self.user_id, statement)
            props = {"event_id": event_id, "subject": subject}
            if obj:
                props |= {"relation": relation, "object": obj}
            if opinion:
                props["holder"] = speaker
            thesis = Vertex(
                id=tid,
                user_id=self.user_id,
                kind=VertexKind.THESIS,
                name=statement,
                props=props,
                t_created=when,
                t_valid=when,
                t_invalid=t_invalid,
                t_expired=t_invalid,
                invalidated_by=f"th-later-{tid}" if invalid else None,
                episode_label=EpisodeLabel.OPINION if opinion else EpisodeLabel.FACT,
                temporal_label=TemporalLabel.DYNAMIC if rng.random() < 0.5 else TemporalLabel.STATIC,
            )
            if tid in vertices:
                continue
            vertices[tid] = thesis
            texts[tid] = ("thesis", statement)
            touched.add(tid)
            ends = [self._object(subject, vertices, texts)] + ([self._object(obj, vertices, texts)] if obj else [])
            for oid in ends:
                touched.add(oid)
                self._edge(edges, EdgeKind.THESIS, oid, "thesis", tid, t_valid=when)
            if obj:
                eid = self._edge(
                    edges, EdgeKind.RELATION, ends[0], relation, ends[1],
                    t_valid=when, t_invalid=t_invalid, t_expired=t_invalid,
                    invalidated_by=thesis.invalidated_by,
                )  # fmt: skip
                texts[eid] = ("triplet", f"{subject} {relation} {obj}")
            self.memory.facts.append(Fact(thesis, subject, relation, obj))
        chat = CHAT[int(rng.integers(len(CHAT)))]
        episode_text = f"{speaker}: " + ", and ".join(sentences) + f" - {chat}."
        eid = ids.episode_id(self.user_id, event_id)
        vertices[eid] = Vertex(
            id=eid,
            user_id=self.user_id,
            kind=VertexKind.EPISODIC,
            name=episode_text,
            props={"event_id": event_id, "speaker": speaker},
            t_created=when,
            t_valid=when,
        )
        texts[eid] = ("episodic", episode_text)
        for vid in sorted(touched):
            self._edge(edges, EdgeKind.EPISODIC, vid, "episodic", eid)
        return event_id
