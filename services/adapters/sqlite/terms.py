"""Lexical search for a big user: BM25 over an in-memory inverted index of the user's texts, scored in numpy.

FTS5 ranks every row that holds any word of the question: the union of the words' postings, checked against the
user's token, each row's bm25() computed and sorted. At 1M triplets (447k texts of one user) that is 0.5-1.6 s a
search on this machine, and a question makes several. Here each word's postings are arrays (row positions and term
counts); the scores are one ``bincount`` over the question's postings (a few ms at that size), and only the best
rows' ids are read from SQLite.

The ranking is FTS5's ``bm25(fts, 1.0, 0.0, 0.0)``: the same tokenizer (the schema's, through APSW), the same
formula and constants, each distinct question word one OR-ed phrase, a row's length counted over all its columns.
Two differences, both deliberate: the statistics (rows, documents per word, mean length) are the user's own,
where FTS5's are the whole table's, so no other user's texts move this user's ranking; and a question word that
the tokenizer cuts in several (``snake_case``) matches where all its parts appear, not only side by side. With one
user in the file the rankings agree (``tests/test_sqlite_scale.py``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import apsw
import numpy as np

from .codec import FTS_TOKENIZER, query_words
from .follow import MIN_ITEMS, ItemFollower, item_ids

K1 = 1.2  # FTS5's bm25() constants
B = 0.75
USER_KEY_TOKENS = 1  # the user_key column: one opaque token in every row


@dataclass(frozen=True)
class _Kind:
    """One kind's texts of a user. Row positions index ``item_nos`` and ``norms``."""

    item_nos: np.ndarray  # int64 (n,), ascending
    lengths: np.ndarray  # int64 (n,): tokens in all columns, as FTS5 counts a row's size
    norms: np.ndarray  # float64 (n,): BM25's length normalisation, k1 * (1 - b + b * length / mean length)
    postings: dict[str, tuple[np.ndarray, np.ndarray]]  # term -> (row positions int32, counts uint16)


@dataclass(frozen=True)
class Terms:
    """One user's index, a part per kind (a search reads only the kinds it asks for: an object search at 1M triplets
    skipped the postings of 0.4M other texts); the statistics are the user's over every kind, as FTS5's are over
    every row it matches."""

    kinds: dict[str, _Kind]
    rows: int
    tokens: int  # summed lengths: the mean length is tokens / rows, exactly as FTS5 divides its totals


class TermIndex(ItemFollower[Terms]):
    """The in-memory inverted indexes of the big users of one store, shared by its reader threads."""

    columns = ", text"

    def __init__(self, min_items: int = MIN_ITEMS) -> None:
        super().__init__(min_items)
        # the tokenizers are built in; a connection of our own serves them to every thread (APSW serialises it)
        self._tokenizer_db = apsw.Connection(":memory:")
        name, *args = FTS_TOKENIZER.split()
        self._tokenize = self._tokenizer_db.fts5_tokenizer(name, args)

    def tokens(self, text: str, query: bool = False) -> list[str]:
        reason = apsw.FTS5_TOKENIZE_QUERY if query else apsw.FTS5_TOKENIZE_DOCUMENT
        found = self._tokenize(text.encode(), reason, None, include_offsets=False, include_colocated=False)
        return [str(t) for t in found]

    def search(
        self, conn: apsw.Connection, user_id: str, kinds: Sequence[str], text: str, k: int
    ) -> list[tuple[str, float]] | None:
        """The ``k`` best by BM25, in FTS5's order (score, then id); None when the user is searched by FTS5."""
        terms = self.copy_of(conn, user_id)
        if terms is None:
            return None
        words = self._words(terms, text)
        scored = [_scores(part, words[kind]) for kind, part in terms.kinds.items() if not kinds or kind in kinds]
        scores = np.concatenate([s for s, _ in scored]) if scored else np.zeros(0)
        item_nos = np.concatenate([n for _, n in scored]) if scored else np.zeros(0, dtype=np.int64)
        tied: list[int] = []
        kth = 0.0
        if len(scores) > k:  # the rows above the k-th score are in; among those tied with it the id order decides
            kth = _kth_largest(scores, k)
            tied = item_nos[scores == kth].tolist()
            above = scores > kth
            scores, item_nos = scores[above], item_nos[above]
        by_item = dict(zip(item_nos.tolist(), scores.tolist(), strict=True))
        return _ranked(conn, user_id, kinds, by_item, tied, kth, k)

    def _words(self, terms: Terms, text: str) -> dict[str, list[tuple[float, np.ndarray, np.ndarray]]]:
        """Per kind, each phrase of ``text`` it holds, in the question's word order: (idf, rows, counts). The
        question is cut and its phrases looked up once, whatever kinds are searched; the idf counts documents of
        every kind, as FTS5's statistics do."""
        out: dict[str, list[tuple[float, np.ndarray, np.ndarray]]] = {kind: [] for kind in terms.kinds}
        for word in query_words(text):
            tokens = self.tokens(word, query=True)
            hits = {kind: hit for kind, part in terms.kinds.items() if (hit := _phrase(part, tokens)) is not None}
            if not hits:
                continue
            documents = sum(len(rows) for rows, _ in hits.values())
            idf = math.log((terms.rows - documents + 0.5) / (documents + 0.5))
            if idf <= 0.0:
                idf = 1e-6  # as FTS5: a word in most rows still counts, barely
            for kind, (rows, counts) in hits.items():
                out[kind].append((idf, rows, counts))
        return out

    # -- building the copy ----------------------------------------------------------------------------------------

    def _empty(self) -> Terms:
        return Terms({}, 0, 0)

    def _add(self, copy: Terms, rows: Sequence[Any]) -> Terms:
        by_kind: dict[str, list[Any]] = {}
        for row in rows:
            by_kind.setdefault(row[1], []).append(row)
        grown = dict(copy.kinds)
        added = 0
        for kind, found in by_kind.items():
            extra = USER_KEY_TOKENS + len(self.tokens(kind))  # the row's other columns, as FTS5 counts them
            part = grown.get(kind) or _Kind(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0), {})
            grown[kind], tokens = self._extend(part, found, extra)
            added += tokens
        n = copy.rows + len(rows)
        total = copy.tokens + added
        mean = max(total / n, 1e-9) if n else 1.0
        kinds = {
            kind: _Kind(p.item_nos, p.lengths, K1 * (1 - B + B * p.lengths / mean), p.postings)
            for kind, p in grown.items()
        }
        return Terms(kinds, n, total)

    def _extend(self, part: _Kind, found: list[Any], extra: int) -> tuple[_Kind, int]:
        """``part`` with the rows ``found`` (item_no, kind, text) appended (norms left for the caller), and the
        tokens they add."""
        start = len(part.item_nos)
        lengths: list[int] = []
        grown: dict[str, tuple[list[int], list[int]]] = {}
        for position, (_, _, text) in enumerate(found, start=start):
            counts = Counter(self.tokens(str(text)))
            lengths.append(sum(counts.values()) + extra)
            for term, count in counts.items():
                at, tf = grown.setdefault(term, ([], []))
                at.append(position)
                tf.append(count)
        postings = dict(part.postings)
        for term, (at, tf) in grown.items():
            new = (np.asarray(at, dtype=np.int32), np.minimum(np.asarray(tf), 65535).astype(np.uint16))
            old = postings.get(term)
            postings[term] = (
                new if old is None else (np.concatenate([old[0], new[0]]), np.concatenate([old[1], new[1]]))
            )
        item_nos = np.concatenate([part.item_nos, np.fromiter((row[0] for row in found), np.int64, len(found))])
        all_lengths = np.concatenate([part.lengths, np.asarray(lengths, dtype=np.int64)])
        return _Kind(item_nos, all_lengths, part.norms, postings), sum(lengths)


def _phrase(part: _Kind, tokens: list[str]) -> tuple[np.ndarray, np.ndarray] | None:
    """The rows holding every token, with the fewest of their counts (one token: its postings)."""
    found = [part.postings.get(token) for token in tokens]
    if not found or any(f is None for f in found):
        return None
    rows, counts = found[0]  # type: ignore[misc]
    for other_rows, other_counts in found[1:]:  # type: ignore[misc]
        common, mine, theirs = np.intersect1d(rows, other_rows, assume_unique=True, return_indices=True)
        rows, counts = common, np.minimum(counts[mine], other_counts[theirs])
    return (rows, counts) if len(rows) else None


def _scores(part: _Kind, words: list[tuple[float, np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """The BM25 score and item number of each row of ``part`` that holds a phrase: a row's contributions summed in
    the question's word order, as FTS5 sums them (one ``bincount``)."""
    if not words:
        return np.zeros(0), np.zeros(0, dtype=np.int64)
    rows = np.concatenate([at for _, at, _ in words])
    weights = np.concatenate([idf * (counts * (K1 + 1.0)) / (counts + part.norms[at]) for idf, at, counts in words])
    scores = np.bincount(rows, weights=weights, minlength=len(part.item_nos))
    matched = np.flatnonzero(scores > 0.0)  # every contribution is positive (on floats nonzero is 10x slower)
    return scores[matched], part.item_nos[matched]


def _kth_largest(values: np.ndarray, k: int, stride: int = 8) -> float:
    """The ``k``-th largest of ``values`` (``k`` <= its length). The k-th largest of every ``stride``-th value is at
    most the answer, so only the values at or above it are partitioned: a fifth of the time for 100k values."""
    if len(values) >= k * stride:
        sample = values[::stride]
        values = values[values >= np.partition(sample, len(sample) - k)[len(sample) - k]]
    return float(np.partition(values, len(values) - k)[len(values) - k])


def _ranked(
    conn: apsw.Connection,
    user_id: str,
    kinds: Sequence[str],
    above: dict[int, float],
    tied: list[int],
    kth: float,
    k: int,
) -> list[tuple[str, float]]:
    """The ids of the rows ``above`` the cut (item number -> score) and of the first by id of the rows ``tied`` at
    it with score ``kth`` (SQLite sorts those: at 1M texts a common word ties thousands), read again with the
    user's and kinds' filters; best first, then by id."""
    ids = item_ids(conn, user_id, kinds, list(above)) if above else {}
    if tied and len(ids) < k:
        ids |= item_ids(conn, user_id, kinds, tied, first=k - len(ids))
    best = sorted((-above.get(item_no, kth), id_) for item_no, id_ in ids.items())[:k]
    return [(id_, -negated) for negated, id_ in best]
