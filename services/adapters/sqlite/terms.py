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
class Terms:
    """One user's index. Row positions index ``item_nos``, ``kinds`` and ``lengths``."""

    item_nos: np.ndarray  # int64 (n,)
    kinds: np.ndarray  # int16 (n,): codes of ``kind_codes``
    kind_codes: dict[str, int]
    lengths: np.ndarray  # float64 (n,): tokens in all columns, as FTS5 counts a row's size
    norms: np.ndarray  # float64 (n,): BM25's length normalisation, k1 * (1 - b + b * length / mean length)
    postings: dict[str, tuple[np.ndarray, np.ndarray]]  # term -> (row positions int32, counts uint16)


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
        scores, matched = self._scores(terms, text)
        rows = np.flatnonzero(matched)
        if kinds:  # a lookup table by kind code, read for the matched rows only
            wanted = np.zeros(max(len(terms.kind_codes), 1), dtype=bool)
            wanted[[terms.kind_codes[kind] for kind in kinds if kind in terms.kind_codes]] = True
            rows = rows[wanted[terms.kinds[rows]]]
        tied: list[int] = []
        kth = 0.0
        if len(rows) > k:  # the rows above the k-th score are in; among those tied with it the id order decides
            kth = float(np.partition(scores[rows], len(rows) - k)[len(rows) - k])
            tied = terms.item_nos[rows[scores[rows] == kth]].tolist()
            rows = rows[scores[rows] > kth]
        by_item = dict(zip(terms.item_nos[rows].tolist(), scores[rows].tolist(), strict=True))
        return _ranked(conn, user_id, kinds, by_item, tied, kth, k)

    def _scores(self, terms: Terms, text: str) -> tuple[np.ndarray, np.ndarray]:
        """Each row's BM25 for ``text``, and whether any of its phrases is in the row."""
        n = len(terms.item_nos)
        scores = np.zeros(n, dtype=np.float64)
        matched = np.zeros(n, dtype=bool)
        if n == 0:
            return scores, matched
        for word in query_words(text):
            hit = _phrase(terms, self.tokens(word, query=True))
            if hit is None:
                continue
            rows, counts = hit
            idf = math.log((n - len(rows) + 0.5) / (len(rows) + 0.5))
            if idf <= 0.0:
                idf = 1e-6  # as FTS5: a word in most rows still counts, barely
            scores[rows] += idf * (counts * (K1 + 1.0)) / (counts + terms.norms[rows])
            matched[rows] = True
        return scores, matched

    # -- building the copy ----------------------------------------------------------------------------------------

    def _empty(self) -> Terms:
        return Terms(np.zeros(0, np.int64), np.zeros(0, np.int16), {}, np.zeros(0, np.float64), np.zeros(0), {})

    def _add(self, copy: Terms, rows: Sequence[Any]) -> Terms:
        start = len(copy.item_nos)
        kind_codes = dict(copy.kind_codes)
        kinds, lengths, item_nos = [], [], []
        kind_tokens = {kind: len(self.tokens(kind)) for kind in {str(row[1]) for row in rows}}  # once a kind, not a row
        grown: dict[str, tuple[list[int], list[int]]] = {}
        for position, (item_no, kind, text) in enumerate(rows, start=start):
            kind = str(kind)
            if kind not in kind_codes:
                kind_codes[kind] = len(kind_codes)
            counts = Counter(self.tokens(str(text)))
            item_nos.append(int(item_no))
            kinds.append(kind_codes[kind])
            lengths.append(sum(counts.values()) + USER_KEY_TOKENS + kind_tokens[kind])
            for term, count in counts.items():
                at, tf = grown.setdefault(term, ([], []))
                at.append(position)
                tf.append(count)
        postings = dict(copy.postings)
        for term, (at, tf) in grown.items():
            new = (np.asarray(at, dtype=np.int32), np.minimum(np.asarray(tf), 65535).astype(np.uint16))
            old = postings.get(term)
            postings[term] = (
                new if old is None else (np.concatenate([old[0], new[0]]), np.concatenate([old[1], new[1]]))
            )
        all_lengths = np.concatenate([copy.lengths, np.asarray(lengths, dtype=np.float64)])
        return Terms(
            np.concatenate([copy.item_nos, np.asarray(item_nos, dtype=np.int64)]),
            np.concatenate([copy.kinds, np.asarray(kinds, dtype=np.int16)]),
            kind_codes,
            all_lengths,
            K1 * (1 - B + B * all_lengths / max(float(all_lengths.mean()), 1e-9)) if len(all_lengths) else all_lengths,
            postings,
        )


def _phrase(terms: Terms, tokens: list[str]) -> tuple[np.ndarray, np.ndarray] | None:
    """The rows holding every token, with the fewest of their counts (one token: its postings)."""
    found = [terms.postings.get(token) for token in tokens]
    if not found or any(f is None for f in found):
        return None
    rows, counts = found[0]  # type: ignore[misc]
    for other_rows, other_counts in found[1:]:  # type: ignore[misc]
        common, mine, theirs = np.intersect1d(rows, other_rows, assume_unique=True, return_indices=True)
        rows, counts = common, np.minimum(counts[mine], other_counts[theirs])
    return (rows, counts) if len(rows) else None


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
