"""Entity resolution beyond exact names, once per batch after extraction: "Mel" said of the person memory knows
as "Melanie", "Caroline's mom" of "Caroline's mother", "Carolin" of "Caroline" become one object.

For every entity name of the new facts that has no object of this user yet:
- candidates are the user's objects found by the store's dense and lexical search on the name (never another
  user's: every store call is scoped by the user id), the known names elsewhere in the batch, and the other new
  names of the batch (so two new spellings in one batch become one object too);
- a candidate pair is one whose names are alike (``name_score`` >= ``entity_name_min_score``: prefix nicknames,
  spelling variants, reordered words) or whose name vectors are close (cosine >=
  ``entity_min_similarity``: "mom" / "mother");
- a pair equal after a light normalisation (case, accents, punctuation, spacing: "St. Mary's" / "St Marys") merges
  without a call; the rest, at most ``entity_candidates`` per name, are judged by ONE ``same_entity`` call per
  batch. A pair the model skips, or a failed call (counted and logged), merges nothing. A name left apart is an
  object of its own from then on: its later mentions match it exactly and are not asked about again.

A merged fact names the canonical object as its subject or object (its text keeps its own words) and records the
alias it was said with (``Fact.subject_alias``/``object_alias``, thesis props of the same names); the builder writes
an alias record per merged name (``ChangeSetBuilder._alias``), so the name stays findable and the merge can be
undone (``services.memorize.unmerge``). An alias once recorded resolves by its exact name, without a call.
"""

from __future__ import annotations

import asyncio
import unicodedata
from dataclasses import dataclass, replace

from rapidfuzz import fuzz, utils

from services import ids, metrics
from services.domain import EdgeKind, Vertex, VertexKind
from services.llm.scope import llm_scope
from services.llm.task import TaskFailed, run_task
from services.logging import get_logger
from services.memorize.builder import ALIAS_ENDS
from services.memorize.entity_task import NamePair, SameEntityTask, Verdict
from services.memorize.extraction import Alias, Fact, ItemFacts
from services.ports import LLM, Embedder, GraphStore, VectorHit, VectorStore
from services.retrieval.common import is_literal
from services.settings import Settings
from services.similarity import cosine

log = get_logger(__name__)
_TASK = SameEntityTask()
#: dense and lexical hits per new name the candidates are drawn from
_POOL = 10
#: pairs one confirmation call judges at most (its answer stays within the task's token limit); the best first
MAX_PAIRS = 40


def light_key(name: str) -> str:
    """A name without case, accents, punctuation or spacing: two names equal here are one name written twice."""
    folded = unicodedata.normalize("NFKD", ids.normalize_name(name))
    return "".join(c for c in folded if c.isalnum())


def name_score(a: str, b: str) -> float:
    """How alike two names are as strings, 0-100: whole-name edit similarity (spelling variants, "Carolin"), in
    any word order, or 90 for a proper name's prefix nickname ("Mel" / "Melanie"). Not partial matches inside
    longer strings: on LoCoMo those made "work" a candidate for "support network" (docs/benchmarks.md)."""
    x, y = utils.default_process(a), utils.default_process(b)
    whole = max(fuzz.ratio(x, y), fuzz.token_sort_ratio(x, y))
    return max(float(whole), 90.0 if _nickname(a, b) or _nickname(b, a) else 0.0)


def _nickname(short: str, full: str) -> bool:
    """``short`` is one capitalised word of 3+ letters that begins ``full``'s first word and is shorter."""
    words = full.split()
    return (
        len(short) >= 3
        and " " not in short.strip()
        and short[:1].isupper()
        and bool(words)
        and words[0][:1].isupper()
        and len(words[0]) > len(short)
        and words[0].casefold().startswith(short.strip().casefold())
    )


@dataclass(frozen=True)
class _Target:
    """What a name can be merged into: a known object (``known``) or another new name of the batch."""

    key: str  # "k:<object id>" or "n:<name key>"
    name: str  # the canonical name facts will carry
    object_id: str
    known: bool


@dataclass(frozen=True)
class _Pair:
    key: str  # the new name's key
    said: str
    target: _Target
    shown: str  # the target's name as compared (an alias record's own name, for a known alias)
    name_score: float
    similarity: float
    clear: bool

    @property
    def rank(self) -> float:
        return max(self.name_score / 100.0, self.similarity)


class EntityResolver:
    def __init__(
        self, graph: GraphStore, vectors: VectorStore, llm: LLM, embedder: Embedder, settings: Settings
    ) -> None:
        self.graph = graph
        self.vectors = vectors
        self.llm = llm
        self.embedder = embedder
        self.settings = settings

    async def resolve(self, user_id: str, found: list[ItemFacts]) -> tuple[list[ItemFacts], int]:
        """``found`` with every merged name replaced by its canonical object's (aliases recorded); the calls made."""
        if self.settings.entity_candidates == 0:
            return found, 0
        said, context = _names(found)
        if not said:
            return found, 0
        exact = await self.graph.find_objects(user_id, sorted(said))
        merges: dict[str, tuple[_Target, Alias | None]] = {}
        await self._known_aliases(user_id, exact, merges)
        new = {key: name for key, name in said.items() if key not in exact and not is_literal(name)}
        calls = 0
        if new:
            pairs = await self._pairs(user_id, new, {k: v for k, v in exact.items() if k not in merges}, context)
            verdicts, calls = await self._confirm(user_id, [p for p in pairs if not p.clear], context)
            _settle(pairs, verdicts, merges, user_id)
        if not merges:
            return found, calls
        return [_rewritten(item, merges) for item in found], calls

    async def _known_aliases(
        self, user_id: str, exact: dict[str, Vertex], merges: dict[str, tuple[_Target, Alias | None]]
    ) -> None:
        """Names that are recorded aliases resolve to their canonical object, no call needed."""
        pointing = {key: v.alias_of for key, v in exact.items() if v.alias_of}
        if not pointing:
            return
        canonical = await self.graph.get_vertices(user_id, sorted({i for i in pointing.values() if i}))
        for key, object_id in pointing.items():
            vertex = canonical.get(object_id or "")
            if vertex is not None:  # else its object is gone: the record is an object of its own again
                target = _Target(f"k:{vertex.id}", vertex.name, vertex.id, True)
                merges[key] = (target, Alias(exact[key].name, vertex.id, "alias", 100.0, 1.0))
                metrics.ENTITY_MERGES.labels("alias").inc()

    async def _pairs(
        self, user_id: str, new: dict[str, str], exact: dict[str, Vertex], context: dict[str, str]
    ) -> list[_Pair]:
        """Candidate pairs of each new name, best first, at most ``entity_candidates`` per name."""
        keys = sorted(new)
        vectors = dict(zip(keys, await self.embedder.embed([new[k] for k in keys]), strict=True))
        objects = [VertexKind.OBJECT.value]

        async def lexical(key: str) -> list[VectorHit]:
            try:
                return await self.vectors.search(user_id, objects, None, new[key], k=_POOL)
            except Exception:  # a name the lexical index cannot parse still has its dense candidates
                log.warning("entity_lexical_search_failed", user_id=user_id, name=new[key], exc_info=True)
                return []

        # the batch's names searched together: one dense read for all of them, the lexical ones sent at once
        dense, by_words = await asyncio.gather(
            self.vectors.search_many(user_id, objects, [vectors[k] for k in keys], k=_POOL),
            asyncio.gather(*(lexical(key) for key in keys)),
        )
        pooled = {key: {h.id for h in [*near, *words]} for key, near, words in zip(keys, dense, by_words, strict=True)}
        wanted = sorted({i for hits in pooled.values() for i in hits} | {v.id for v in exact.values()})
        found, stored = await asyncio.gather(
            self.graph.get_vertices(user_id, wanted), self.vectors.get_vectors(user_id, wanted)
        )
        canonical = await self.graph.get_vertices(user_id, sorted({v.alias_of for v in found.values() if v.alias_of}))
        known = [v for v in found.values() if v.kind is VertexKind.OBJECT and v.user_id == user_id]
        pairs: list[_Pair] = []
        for key in keys:
            options: list[_Pair] = []
            ids_here = set(pooled[key]) | {v.id for v in exact.values()}
            for vertex in known:
                if vertex.id not in ids_here or vertex.id not in stored:
                    continue
                target_vertex = canonical.get(vertex.alias_of) if vertex.alias_of else vertex
                if target_vertex is None:
                    continue
                target = _Target(f"k:{target_vertex.id}", target_vertex.name, target_vertex.id, True)
                options.append(_pair(key, new[key], target, vertex.name, cosine(vectors[key], stored[vertex.id])))
            for other in keys:
                if other != key:
                    target = _Target(f"n:{other}", new[other], ids.object_id(user_id, new[other]), False)
                    options.append(_pair(key, new[key], target, new[other], cosine(vectors[key], vectors[other])))
            options = [p for p in options if p.clear or (self._candidate(p) and not _possessive_of(p.said, p.shown))]
            options.sort(key=lambda p: (not p.clear, -p.rank, p.target.key))
            best: dict[str, _Pair] = {}
            for option in options:
                best.setdefault(option.target.key, option)
            chosen = list(best.values())
            pairs.extend([chosen[0]] if chosen and chosen[0].clear else chosen[: self.settings.entity_candidates])
        return _one_per_couple(pairs)

    def _candidate(self, pair: _Pair) -> bool:
        return (
            pair.name_score >= self.settings.entity_name_min_score
            or pair.similarity >= self.settings.entity_min_similarity
        )

    async def _confirm(
        self, user_id: str, pairs: list[_Pair], context: dict[str, str]
    ) -> tuple[dict[tuple[str, str], Verdict], int]:
        """ONE call for the batch's ambiguous pairs: verdicts by (name key, target key); none if it failed."""
        if not pairs:
            return {}, 0
        if len(pairs) > MAX_PAIRS:  # the least alike stay apart (counted): a batch this full of new names is rare
            metrics.ENTITY_PAIRS.labels("not_asked").inc(len(pairs) - MAX_PAIRS)
            log.info("entity_pairs_over_limit", user_id=user_id, pairs=len(pairs), asked=MAX_PAIRS)
            pairs = sorted(pairs, key=lambda p: -p.rank)[:MAX_PAIRS]
        shown = await self._contexts(user_id, pairs, context)
        task_input = [NamePair(p.said, context[p.key], p.shown, shown[p.target.key]) for p in pairs]
        try:
            with llm_scope(user_id):  # it reads known theses: filed under the user's memory at large
                result = await run_task(self.llm, _TASK, task_input, attempts=self.settings.extraction_attempts)
        except (TaskFailed, ConnectionError, TimeoutError) as exc:  # the model is down, stalled or off-contract
            # nothing merges: two objects for one entity lose no fact, one object for two people mixes theirs
            metrics.ENTITY_PAIRS.labels("failed").inc(len(pairs))
            metrics.EXTRACTION_FAILURES.labels(reason="entity_confirm_failed").inc()
            log.warning("entity_confirm_failed_not_merged", user_id=user_id, pairs=len(pairs), error=str(exc))
            return {}, getattr(exc, "attempts", 1)
        verdicts: dict[tuple[str, str], Verdict] = {}
        for pair, verdict in zip(pairs, result.value, strict=True):
            metrics.ENTITY_PAIRS.labels(verdict).inc()
            verdicts[(pair.key, pair.target.key)] = verdict
        return verdicts, result.calls

    async def _contexts(self, user_id: str, pairs: list[_Pair], context: dict[str, str]) -> dict[str, str]:
        """A statement using each target: a new name's fact, or a known object's newest thesis."""
        known = sorted({p.target.object_id for p in pairs if p.target.known})
        theses = await self.graph.neighbors(user_id, known, [EdgeKind.THESIS], limit_per_vertex=1) if known else []
        about = {t.start.id: t.end.name for t in theses if t.end.kind is VertexKind.THESIS}
        return {
            p.target.key: about.get(p.target.object_id, p.target.name)
            if p.target.known
            else context[p.target.key.removeprefix("n:")]
            for p in pairs
        }


def _names(found: list[ItemFacts]) -> tuple[dict[str, str], dict[str, str]]:
    """Per name key, the name as first said and a fact text that says it."""
    said: dict[str, str] = {}
    context: dict[str, str] = {}
    for item in found:
        for fact in item.facts:
            for name in (fact.subject, fact.object):
                key = ids.normalize_name(name) if name else ""
                if key:
                    said.setdefault(key, " ".join(name.split()))
                    context.setdefault(key, fact.text)
    return said, context


def _possessive_of(a: str, b: str) -> bool:
    """One name is the other's possessor ("Dana" / "Dana's mom"): by its words never the same entity."""
    x, y = (" ".join(ids.normalize_name(n).replace("\u2019", "'").split()) for n in (a, b))
    return bool(x and y) and (y.startswith(x + "'s ") or x.startswith(y + "'s "))


def _pair(key: str, said: str, target: _Target, shown: str, similarity: float) -> _Pair:
    clear = light_key(said) == light_key(shown) and bool(light_key(said))
    return _Pair(key, said, target, shown, name_score(said, shown), round(similarity, 4), clear)


def _one_per_couple(pairs: list[_Pair]) -> list[_Pair]:
    """Two new names that are each other's candidates are asked about once."""
    kept: list[_Pair] = []
    seen: set[frozenset[str]] = set()
    for pair in pairs:
        couple = frozenset((f"n:{pair.key}", pair.target.key))
        if couple not in seen:
            seen.add(couple)
            kept.append(pair)
    return kept


def _settle(
    pairs: list[_Pair],
    verdicts: dict[tuple[str, str], Verdict],
    merges: dict[str, tuple[_Target, Alias | None]],
    user_id: str,
) -> None:
    """Merge along the accepted pairs: a group of names joined by them becomes one object, a known one if the
    group holds one; a group joined to two known objects is ambiguous and merges nothing."""
    accepted = [p for p in pairs if p.clear or verdicts.get((p.key, p.target.key)) == "same"]
    parent: dict[str, str] = {}

    def root(node: str) -> str:
        while parent.get(node, node) != node:
            node = parent[node]
        return node

    targets: dict[str, _Target] = {}
    for pair in accepted:
        targets[pair.target.key] = pair.target
        targets.setdefault(
            f"n:{pair.key}", _Target(f"n:{pair.key}", pair.said, ids.object_id(user_id, pair.said), False)
        )
        parent[root(f"n:{pair.key}")] = root(pair.target.key)
    groups: dict[str, list[str]] = {}
    for node in targets:
        groups.setdefault(root(node), []).append(node)
    evidence: dict[str, _Pair] = {}
    for pair in accepted:  # the best direct pair of each name, for its record
        evidence.setdefault(pair.key, pair)
    for members in groups.values():
        known = [targets[m] for m in members if targets[m].known]
        if len(known) > 1:
            log.warning("entity_merge_ambiguous", user_id=user_id, names=sorted(m for m in members))
            metrics.ENTITY_MERGES.labels("ambiguous_skipped").inc()
            continue
        news = [targets[m] for m in members if not targets[m].known]
        canonical = known[0] if known else max(news, key=lambda t: (len(t.name), t.key))
        for target in news:
            if target.key == canonical.key:
                continue
            key = target.key.removeprefix("n:")
            pair = evidence.get(key) or next(p for p in accepted if p.target.key == target.key)
            method = "normalized" if pair.clear else "confirmed"
            verdict = "" if pair.clear else "same"
            merges[key] = (
                canonical,
                Alias(target.name, canonical.object_id, method, pair.name_score, pair.similarity, verdict),
            )
            metrics.ENTITY_MERGES.labels(method).inc()


def _rewritten(item: ItemFacts, merges: dict[str, tuple[_Target, Alias | None]]) -> ItemFacts:
    facts: list[Fact] = []
    for fact in item.facts:
        changes: dict[str, object] = {}
        for end in ALIAS_ENDS:
            name = getattr(fact, end)
            merged = merges.get(ids.normalize_name(name)) if name else None
            if merged is not None:
                target, alias = merged
                changes[end] = target.name
                if alias is not None:
                    changes[f"{end}_alias"] = replace(alias, said=" ".join(name.split()))
        facts.append(replace(fact, **changes) if changes else fact)  # type: ignore[arg-type]
    return replace(item, facts=facts)
