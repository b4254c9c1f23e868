"""Evaluation metrics: answer token F1 and exact match, recall@k of a context, and gold LoCoMo turns mapped to the
episodes and theses memorize derived from them."""

from __future__ import annotations

from pathlib import Path

import pytest

from evaluation import datasets, metrics
from services.adapters.minilm import MiniLMEmbedder
from services.adapters.sqlite import SqliteMemoryStore
from services.domain import VertexKind
from services.ids import episode_id
from services.llm.factory import build_llm
from services.llm.scripted import rule_based_llm
from services.memorize.service import MemorizeService
from tests.conftest import make_settings
from tests.test_eval_datasets import TINY_LOCOMO, write


def test_exact_match_normalises_case_punctuation_and_articles() -> None:
    assert metrics.exact_match("The Seine!", ["seine"]) == 1.0
    assert metrics.exact_match("Seine river", ["seine"]) == 0.0
    assert metrics.exact_match("A. Lee", ["Ann Lee", "a lee"]) == 1.0


def test_token_f1_values() -> None:
    # predicted {cat, sat}, gold {cat, sat, on, mat}: precision 1, recall 1/2
    assert metrics.token_f1("the cat sat", ["cat sat on mat"]) == pytest.approx(2 / 3)
    assert metrics.token_f1("7 May 2023", ["7 May 2023"]) == 1.0
    assert metrics.token_f1("May 2023", ["7 May 2023"]) == pytest.approx(0.8)  # P 1, R 2/3
    assert metrics.token_f1("no", ["yes"]) == 0.0
    assert metrics.token_f1("Lee", ["Ann Lee", "Lee"]) == 1.0  # the best alias


def test_recall_at_k_counts_gold_items_shown_in_the_top_k() -> None:
    context = [metrics.ContextItem(frozenset({"t1"}), "a"), metrics.ContextItem(frozenset({"e2", "t2"}), "b")]
    gold = [frozenset({"e1", "t1"}), frozenset({"e2"}), frozenset({"e3"})]
    assert metrics.recall_at(gold, context, 1) == pytest.approx(1 / 3)
    assert metrics.recall_at(gold, context, 2) == pytest.approx(2 / 3)
    assert metrics.recall_at([], context, 2) is None
    assert metrics.recall_at(gold, [], 5) == 0.0


def test_triple_recall_needs_both_ends_in_the_top_k() -> None:
    context = [
        metrics.ContextItem(frozenset(), "Lothair II's mother was Ermengarde of Tours"),
        metrics.ContextItem(frozenset(), "Ermengarde died on 20 March 851"),
    ]
    triples = [("Lothair II", "mother", "Ermengarde of Tours"), ("Ermengarde of Tours", "died", "20 March 851")]
    assert metrics.triple_recall_at(triples, context, 1) == 0.5
    # "Ermengarde of Tours" and the date are in the top 2, but never in one item
    assert metrics.triple_recall_at(triples, context, 2) == 0.5
    assert metrics.triple_recall_at(triples[:1], context[1:], 2) == 0.0


async def test_gold_turns_map_to_their_episodes_and_derived_theses(tmp_path: Path) -> None:
    ds = datasets.load("locomo", tmp_path, write(tmp_path, "tiny.json", TINY_LOCOMO))
    settings = make_settings(tmp_path)
    embedder = MiniLMEmbedder()
    store = await SqliteMemoryStore.open(tmp_path / "memory.sqlite3", dim=embedder.dim)
    try:
        llm = build_llm(settings, inner=rule_based_llm())
        outcome = await MemorizeService(store.stores(), llm, embedder, settings).memorize(ds.events)
        assert not outcome.dead_letters
        user = "eval-locomo-conv-t"
        texts = {e.event_id: e.text for e in ds.events}
        derived = await metrics.derived_ids(store, user, texts, settings.document_chunk_chars)
        first, last = "locomo:conv-t:D1:1", "locomo:conv-t:D2:2"
        assert episode_id(user, first) in derived[first]
        vertices = await store.get_vertices(user, sorted(derived[first] | derived[last]))
        theses = {i for i in derived[first] if vertices[i].kind is VertexKind.THESIS}
        assert theses, "the turn's thesis is gold evidence too"
        assert all("Rex" in vertices[i].name for i in theses)
        assert not theses & derived[last]  # another turn's memory is not this turn's
        # a context holding only that thesis recalls the first turn, not the last
        context = [metrics.ContextItem(frozenset(theses), "")]
        assert metrics.recall_at([derived[first], derived[last]], context, 1) == 0.5
    finally:
        await store.close()
