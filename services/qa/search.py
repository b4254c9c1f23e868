"""The search room: stages 3-8 of one search step. The step's entities (stage 3: named by an LLM call, or given by
the call that wrote the step), their object vertices (4), clue-queries from combinations of them (5), a traversal
per clue-query (6), the relevance filter (7), and reading what was found (8, the planning engine only)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from schemas.events import StageStatus
from services import ids
from services.domain import EdgeKind, Triplet, VertexKind
from services.llm.task import TaskFailed
from services.logging import get_logger
from services.qa.base import Clue, RunBase, Step, SubQuestion, evidence_of, run_all
from services.qa.matching import Match, combinations
from services.qa.stages import Stage
from services.qa.tasks import (
    ClueAnswerInput,
    ClueAnswerTask,
    ClueQueryInput,
    ClueQueryTask,
    Finding,
    NerInput,
    NerTask,
    StepAnswerInput,
    StepAnswerTask,
    Substitution,
    mention,
    substitute,
)
from services.retrieval.base import RetrievalRequest, Retriever
from services.similarity import best_cosines

log = get_logger(__name__)


class SearchRoom(RunBase):
    async def search_step(self, sq: SubQuestion, step: Step, retriever: Retriever) -> str | None:
        """Stages 3-8 of the planning engine: the step's answer, read from its clue-queries' memory."""
        ctx = {"sub_question_id": sq.id, "step_id": step.id}
        clues = await self.gather(sq, step, retriever, rewrite=True)
        # Several matched vertices often lead to the very same triplets: the same memory is read once, by the
        # best-ranked clue-query that got it, and the others share its answer.
        readers: dict[frozenset[str], list[Clue]] = {}
        for clue in clues:
            readers.setdefault(frozenset(t.id for t in clue.triplets), []).append(clue)
        await run_all(self._read(sq, step, group) for group in readers.values())

        async with self.recorder.stage(Stage.SUMMARISE, **ctx) as scope:
            findings = [Finding(query=c.text, answer=c.answer) for c in clues]
            found = [f for f in findings if f.answer]
            scope.detail["clues_answered"] = len(found)
            for clue in clues:
                if clue.answer:
                    sq.evidence |= {t.id: evidence_of(t) for t in clue.triplets}
            if not found:
                scope.status = StageStatus.EMPTY
                return None
            if len({ids.normalize_text(f.answer or "") for f in found}) == 1:
                return found[0].answer  # one finding (or the same one several times) needs no summary
            try:
                answer = await self.task(scope, StepAnswerTask(), StepAnswerInput(step=step.text, findings=findings))
            except TaskFailed as exc:
                sq.failures.append(str(exc))
                answer = " ".join(f.answer for f in found if f.answer)  # degrade: the findings side by side
            scope.detail["answer"] = (answer or "")[:300]
            return answer

    async def gather(self, sq: SubQuestion, step: Step, retriever: Retriever, *, rewrite: bool) -> list[Clue]:
        """Stages 3-7 of one step: its clue-queries with the filtered triplets each found. ``rewrite``: whether
        the clue-queries may be written by an LLM call (``clue_query_mode``) or only by substitution."""
        entities, by_step = await self._entities(sq, step)
        matches = await self._match(sq, step, entities)
        clues = await self._clue_queries(sq, step, matches, by_step, rewrite)
        await run_all(self.traverse(sq, step, clue, retriever) for clue in clues)
        return clues

    async def _entities(self, sq: SubQuestion, step: Step) -> tuple[list[str], bool]:
        """Stage 3; ``by_step``: no entity, so the step text itself is matched."""
        ctx = {"sub_question_id": sq.id, "step_id": step.id}
        async with self.recorder.stage(Stage.NER, **ctx) as scope:
            if step.entities is not None:
                entities = step.entities
                scope.detail["named_by"] = step.named_by  # the plan call, or the question's own names: no call
            else:
                try:
                    inputs = NerInput(step=step.text, max_entities=self.config.max_entities)
                    entities = await self.task(scope, NerTask(), inputs)
                except TaskFailed as exc:
                    sq.failures.append(str(exc))
                    entities = []
            scope.detail["entities"] = entities
            by_step = not entities
            if by_step:
                scope.status = StageStatus.EMPTY if scope.status is StageStatus.OK else scope.status
                entities = [step.text]  # degrade: match the step text itself against object vertices
        return entities, by_step

    async def _match(
        self, sq: SubQuestion, step: Step, entities: list[str], fallback: str | None = None
    ) -> dict[str, list[Match]]:
        """Stage 4; ``fallback``: matched instead when no entity matches (the whole question, as the harness's
        ``question_seeds`` does)."""
        async with self.recorder.stage(Stage.MATCH, sub_question_id=sq.id, step_id=step.id) as scope:
            matches = await self._matches(entities)
            if fallback and fallback not in entities and not any(matches.values()):
                matches = await self._matches([fallback])
                scope.detail["matched_instead"] = fallback
            vertices = {m.vertex.id: m.vertex.name for ms in matches.values() for m in ms}
            scope.vertices = len(vertices)
            scope.detail["matches"] = {e: [m.vertex.name for m in ms] for e, ms in matches.items()}
            if not vertices:
                scope.status = StageStatus.EMPTY
        return matches

    async def _matches(self, entities: list[str]) -> dict[str, list[Match]]:
        """The matcher's vertices for each entity, each entity searched once a query (the memory it matches is the
        same within one answer): a planning round's steps name the question's names again, and steps searched
        side by side may name the same one (they share the one search in flight)."""
        wanted = [e for e in dict.fromkeys(entities) if e.strip()]
        todo = [e for e in wanted if e not in self.matched]
        if todo:
            search = asyncio.ensure_future(self.qa.matcher.match(self.user_id, todo, self.config.matches_per_entity))
            self.matched |= dict.fromkeys(todo, search)
        try:
            return {e: (await self.matched[e]).get(e, []) for e in wanted}
        except Exception:
            for e in todo:
                self.matched.pop(e, None)  # a failed search is not kept: a later step searches again
            raise

    async def _clue_queries(
        self, sq: SubQuestion, step: Step, matches: dict[str, list[Match]], by_step: bool, rewrite: bool
    ) -> list[Clue]:
        """Stage 5. ``by_step``: the step itself was matched (no entities), so there is no entity to substitute."""
        ctx = {"sub_question_id": sq.id, "step_id": step.id}
        async with self.recorder.stage(Stage.CLUE_QUERIES, **ctx) as scope:
            if not rewrite and not self.config.near_match_clues:
                # an exact match is certain (``matching``); a near match of that name is another thing, and the
                # step with its name put in searched that other thing's facts, a fused search each
                kept = {e: [m for m in ms if m.exact] or ms for e, ms in matches.items()}
                left = sum(len(ms) - len(kept[e]) for e, ms in matches.items())
                if left:
                    scope.detail["near_matches"] = f"{left} left out: the name they are near matched exactly"
                matches = kept
            combos = combinations(matches, self.config.max_clue_queries)
            texts: list[str | None] = [
                mention(step.text, [m.vertex.name for m in combo])
                if by_step
                else step.text
                if all(m.exact for m in combo)
                else None
                for combo in combos
            ]
            asks = [combo for combo, text in zip(combos, texts, strict=True) if text is None]
            subs = [[Substitution(entity=m.entity, vertex=m.vertex.name) for m in combo] for combo in asks]
            rewritten = [substitute(step.text, s) for s in subs]
            if subs and rewrite and self.config.clue_query_mode == "llm":
                try:
                    inputs = ClueQueryInput(step=step.text, combinations=subs)
                    rewritten = await self.task(scope, ClueQueryTask(), inputs)
                except TaskFailed as exc:
                    sq.failures.append(str(exc))  # degrade: the deterministic substitution
            elif subs:
                scope.detail["rewrite"] = "substitution"  # the matcher's names put in place, no call
            filled = iter(rewritten)
            clues: list[Clue] = []
            seen: set[tuple[str, frozenset[str]]] = set()
            for combo, text in zip(combos, texts, strict=True):
                text = text if text is not None else next(filled)
                seeds = [m.vertex.id for m in combo]
                key = (ids.normalize_text(text), frozenset(seeds))
                if key not in seen:
                    seen.add(key)
                    clues.append(Clue(id=f"{step.id}.c{len(clues) + 1}", text=text, seeds=seeds))
            if not clues:
                # No vertex matched: one seedless clue, for retrievers that can start from the query alone.
                clues.append(Clue(id=f"{step.id}.c1", text=step.text, seeds=[]))
                scope.status = StageStatus.EMPTY
            await self.embed_clues(step, clues)
            scope.detail["clue_queries"] = [c.text for c in clues]
            return clues

    async def embed_clues(self, step: Step, clues: list[Clue]) -> None:
        """One embedding call per step: the step (for the filter) and its distinct clue texts (for traversal)."""
        texts_to_embed = list(dict.fromkeys([step.text, *(c.text for c in clues)]))
        embedded = dict(zip(texts_to_embed, await self.qa.embedder.embed(texts_to_embed), strict=True))
        step.vector = embedded[step.text]
        for clue in clues:
            clue.vector = embedded[clue.text]

    async def traverse(
        self, sq: SubQuestion, step: Step, clue: Clue, retriever: Retriever, top_k: int | None = None
    ) -> None:
        """Stages 6 and 7 for one clue-query; ``top_k``: kept by the filter (default ``filter_top_k``)."""
        ctx = {"sub_question_id": sq.id, "step_id": step.id, "clue_query_id": clue.id}
        async with self.recorder.stage(Stage.TRAVERSAL, **ctx) as scope:
            kinds = {VertexKind.OBJECT, VertexKind.THESIS}
            if self.config.episodic_context:
                kinds.add(VertexKind.EPISODIC)
            request = RetrievalRequest(
                user_id=self.user_id,
                query=clue.text,
                query_vector=clue.vector,
                seeds=clue.seeds,
                as_of=self.query.as_of,
                budget=self.config.budget,
                context_kinds=frozenset(kinds),
                params=dict(self.config.retriever_params),
            )
            try:
                retrieved = await retriever.retrieve(request)
            except Exception as exc:
                log.warning("qa_retriever_failed", retriever=self.config.retriever, exc_info=True)
                scope.fail(f"{type(exc).__name__}: {exc}")
                sq.failures.append(f"retriever {self.config.retriever}: {exc}")
                retrieved = []
            scope.triplets = len(retrieved)
            scope.vertices = len(clue.seeds)
            if not retrieved and scope.status is StageStatus.OK:
                scope.status = StageStatus.EMPTY

        async with self.recorder.stage(Stage.FILTER, **ctx) as scope:
            clue.triplets = await self._filter(retrieved, step.vector, clue.vector, top_k or self.config.filter_top_k)
            scope.triplets = len(clue.triplets)
            scope.detail["retrieved"] = len(retrieved)
            if not clue.triplets:
                scope.status = StageStatus.EMPTY

    async def _read(self, sq: SubQuestion, step: Step, clues: list[Clue]) -> None:
        """Stage 8 for clue-queries that got the same memory: the first reads it, the others share the answer."""
        clue, *others = clues
        ctx = {"sub_question_id": sq.id, "step_id": step.id}
        async with self.recorder.stage(Stage.SUMMARISE, clue_query_id=clue.id, **ctx) as scope:
            if clue.triplets:
                inputs = ClueAnswerInput(
                    query=clue.text, memory=[t.context for t in clue.triplets], as_of=self.query.as_of
                )
                try:
                    clue.answer = await self.task(scope, ClueAnswerTask(), inputs)
                except TaskFailed as exc:
                    sq.failures.append(str(exc))
                scope.detail["answer"] = (clue.answer or "")[:300]
            if clue.answer is None and scope.status is StageStatus.OK:
                scope.status = StageStatus.EMPTY  # nothing to read (no call), or nothing found in it
        for other in others:
            other.answer = clue.answer
            async with self.recorder.stage(Stage.SUMMARISE, clue_query_id=other.id, **ctx) as scope:
                scope.status = StageStatus.SKIPPED if other.triplets else StageStatus.EMPTY
                scope.detail["read_by"] = clue.id

    # -- stage 7 ----------------------------------------------------------------------------------------------

    async def _filter(
        self,
        triplets: Sequence[Triplet],
        step_vector: list[float] | None,
        clue_vector: list[float] | None,
        top_k: int,
    ) -> list[Triplet]:
        """Keep the triplets of this user that held at ``as_of``, without episodic text unless asked, unique by
        id and by text, ranked by cosine to the step (or the clue-query), above the threshold, top-k."""
        as_of = self.query.as_of
        kept: dict[str, Triplet] = {}
        texts: set[str] = set()
        for t in triplets:
            ends = (t.start, t.end)
            if t.id in kept or any(v.user_id != self.user_id for v in ends) or t.edge.user_id != self.user_id:
                continue
            if not (t.edge.valid_at(as_of) and all(v.valid_at(as_of) for v in ends)):
                continue  # a retriever that ignores as_of must not leak an invalidated (or future) thesis or edge
            if not self.config.episodic_context and (
                t.edge.kind is EdgeKind.EPISODIC or any(v.kind is VertexKind.EPISODIC for v in ends)
            ):
                continue
            key = ids.normalize_text(t.text)
            if key in texts:
                continue
            texts.add(key)
            kept[t.id] = t
        if not kept:
            return []
        vectors = await self._triplet_vectors(list(kept.values()))
        targets = [v for v in (step_vector, clue_vector) if v is not None]
        candidates = list(kept.values())
        scores = best_cosines([vectors[t.id] for t in candidates], targets)
        scored = [(s, t) for s, t in zip(scores, candidates, strict=True) if s >= self.config.filter_threshold]
        scored.sort(key=lambda pair: pair[0], reverse=True)
        return [t for _, t in scored[:top_k]]

    async def _triplet_vectors(self, triplets: list[Triplet]) -> dict[str, list[float]]:
        """Stored vectors where the index has them (relation triplets by edge id, others by their end vertex),
        embedding only the rest."""
        index_id = {t.id: (t.id if t.edge.kind is EdgeKind.RELATION else t.end.id) for t in triplets}
        stored = await self.qa.vectors.get_vectors(self.user_id, sorted(set(index_id.values())))
        out = {tid: stored[iid] for tid, iid in index_id.items() if iid in stored}
        missing = [t for t in triplets if t.id not in out]
        if missing:
            for t, vector in zip(missing, await self.qa.embedder.embed([t.text for t in missing]), strict=True):
                out[t.id] = vector
        return out
