"""Scores: answer token F1 and exact match (SQuAD normalisation), evidence recall@k of a context, and the map
from gold events to the memory derived from them (their episodes, and the theses those episodes support)."""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from services import ids
from services.domain import EdgeKind, Triplet, VertexKind
from services.memorize.chunking import chunk_text
from services.ports import GraphStore

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces (the SQuAD/HotpotQA evaluation script's rule)."""
    return " ".join(_ARTICLES.sub(" ", str(text).lower().translate(_PUNCT)).split())


def exact_match(prediction: str, answers: Sequence[str]) -> float:
    return float(any(normalize_answer(prediction) == normalize_answer(a) for a in answers))


def token_f1(prediction: str, answers: Sequence[str]) -> float:
    """The best token-overlap F1 of the prediction against any gold answer."""
    best = 0.0
    predicted = normalize_answer(prediction).split()
    for answer in answers:
        gold = normalize_answer(answer).split()
        common = sum((Counter(predicted) & Counter(gold)).values())
        if common:
            precision, recall = common / len(predicted), common / len(gold)
            best = max(best, 2 * precision * recall / (precision + recall))
        elif not predicted and not gold:
            best = 1.0
    return best


@dataclass(frozen=True)
class ContextItem:
    """One item of a QA context, in rank order: the memory ids it shows and its text."""

    ids: frozenset[str]
    text: str


def triplet_items(triplets: Iterable[Triplet]) -> list[ContextItem]:
    return [ContextItem(frozenset({t.edge.id, t.start.id, t.end.id}), t.text) for t in triplets]


def recall_at(gold: Sequence[frozenset[str]], context: Sequence[ContextItem], k: int) -> float | None:
    """Share of gold evidence items (each a set of memory ids, any of which counts) shown in the top ``k``;
    None when the question has no gold evidence."""
    if not gold:
        return None
    shown = frozenset().union(*(item.ids for item in context[:k])) if context else frozenset()
    return sum(bool(g & shown) for g in gold) / len(gold)


def triple_recall_at(triples: Sequence[tuple[str, str, str]], context: Sequence[ContextItem], k: int) -> float | None:
    """Share of gold triples whose subject and object both appear in one of the top ``k`` items: extraction words
    a relation its own way, so the two ends, stated together, are what can be checked."""
    if not triples:
        return None
    texts = [ids.normalize_text(item.text) for item in context[:k]]
    found = sum(
        any(ids.normalize_text(s) in text and ids.normalize_text(o) in text for text in texts) for s, _, o in triples
    )
    return found / len(triples)


async def derived_ids(
    graph: GraphStore, user_id: str, events: dict[str, str], chunk_chars: int
) -> dict[str, frozenset[str]]:
    """Per gold event id (mapped to its text): the ids of its episodes and of the theses derived from them."""
    episodes = {
        event_id: [ids.episode_id(user_id, event_id, n) for n in range(max(1, len(chunk_text(text, chunk_chars))))]
        for event_id, text in events.items()
    }
    wanted = sorted({e for eps in episodes.values() for e in eps})
    triplets = await graph.neighbors(user_id, wanted, [EdgeKind.EPISODIC]) if wanted else []
    theses: dict[str, set[str]] = {}
    for t in triplets:
        for episode, other in ((t.start, t.end), (t.end, t.start)):
            if episode.kind is VertexKind.EPISODIC and other.kind is VertexKind.THESIS:
                theses.setdefault(episode.id, set()).add(other.id)
    return {event_id: frozenset(eps).union(*(theses.get(e, set()) for e in eps)) for event_id, eps in episodes.items()}


def mean(values: Iterable[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None
