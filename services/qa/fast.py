"""The fast engine (the default, ``MEMSTREAM_QA_ENGINE=fast``): the PAI-2 stages in a few calls.

A first answer from one retrieval: the question's names matched without a call (stages 3-4), the question itself
as the one clue-query seeded by every match (5), one traversal and filter (6-7), and one call that answers and says
whether the memory sufficed (8, 9 and 13 merged). Only when it did not, a planning round: one call decomposes the
question, plans the search steps with the names each mentions and writes them with what the first answer found and
missed (1, 2, 3 and 10 merged); each step is searched without a call (4-7, clue-queries by substitution); one more
answer call reads everything found. With ``chain_context`` (on by default) the first answer reads along the chain
(``qa.chain``): the named thing's lines first, then, when that answer is insufficient or names another thing, that
thing's lines (searched without a call) with what was found: 1 or 2 calls. With ``first_link`` too, a question whose
words give its first link ("the father of X", ``qa.hops``) asks that link on its own of the named thing's lines, then
the rest of the question of the thing it names, from that thing's lines: 2 calls (3 when the link names no known
thing and the chain is read as without it). A question that asks for an inference ("Would she ...?") gets no round:
its first answer is the inference (see ``AnswerCheckTask``). ``max_rounds`` bounds the rounds: 1 + 2 x rounds calls
at most (3 by default; one more reading along the chain, two when a first link asked on its own named nothing known),
a retried invalid output apart. Every stage still emits its event; a merged or skipped one says so in its detail.
"""

from __future__ import annotations

from dataclasses import replace

from schemas.events import Answer, AnswerStatus, Query, StageStatus
from services.domain import Triplet
from services.llm.task import TaskFailed
from services.qa.base import NO_ANSWER, Clue, Engine, OnText, QAConfig, RunBase, Step, SubQuestion, evidence_of, run_all
from services.qa.chain import Chain, Section, line_objects
from services.qa.hops import Hop, split
from services.qa.search import SearchRoom
from services.qa.stages import Stage, StageRecorder
from services.qa.streaming import streamed
from services.qa.tasks import AnswerCheckInput, AnswerCheckTask, SearchPlan, SearchPlanInput, SearchPlanTask, Verdict
from services.qa.tasks.common import names_in
from services.retrieval.base import Retriever

#: the stage that holds the call a merged stage's work went into
ANSWER_CALL = "summarise"
PLAN_CALL = "plan"
#: why no round runs for a question that asks for an inference
_INFERENCE = "an inference: no line of memory states it, so no round searches for one"


class FastQA(Engine):
    """A first answer from one retrieval; the planning loop only where that answer says evidence is missing."""

    def new_run(self, query: Query, config: QAConfig, recorder: StageRecorder) -> RunBase:
        return _FastRun(self, query, config, recorder)


class _FastRun(SearchRoom):
    def __init__(self, qa: Engine, query: Query, config: QAConfig, recorder: StageRecorder) -> None:
        super().__init__(qa, query, config, recorder)
        self.parts: list[str] = []
        self.shown: list[Triplet] = []  # the memory the latest answer call read
        self.headings: dict[int, str] = {}  # its chain layout's headings, by the line they come before
        self.chain: Chain | None = None  # the first search's lines and what each is about (``chain_context``)
        self.stalled = False  # a round wrote no step to search (its call failed, or nothing new)

    async def execute(self, on_text: OnText | None) -> Answer:
        retriever = self.qa.retriever(self.config.retriever)  # fail fast, before any LLM call
        question = self.query.question
        sq = SubQuestion(id="sq1", text=question)
        self.sub_questions = [sq]
        first = sq.new_step(question)
        first.entities, first.named_by = sorted(names_in(question)), "question"  # capitalised names, no call
        await self._next_step(sq, first)
        found = await self._first_search(sq, first, retriever)
        sq.done.append(first)
        self.plan_history.append(sq.plan)
        verdict = best = await self._first_answer(sq, found, on_text, first, retriever)
        first.answer = verdict.answer
        rounds = 0
        # an inference ("would she ...?") is not searched for: no line states it, and such rounds ended in "No Answer"
        while not verdict.sufficient and not verdict.inference and rounds < self.config.max_rounds:
            rounds += 1
            later = await self._round(sq, verdict, rounds, retriever, on_text)
            if later is None:
                self.stalled = True
                break
            verdict = later
            best = verdict if verdict.answer is not None or best.answer is None else best
        await self._stop(sq, verdict, rounds)
        return await self._finish(sq, best)

    async def _round(
        self, sq: SubQuestion, verdict: Verdict, round_: int, retriever: Retriever, on_text: OnText | None
    ) -> Verdict | None:
        """Plan (one call), search every step (no call), answer again (one call); None: no step to search."""
        steps = await self._plan(sq, verdict, round_)
        if not steps:
            return None
        for step in steps:
            await self._next_step(sq, step)
        clue_lists = await self._search_steps(sq, steps, retriever)
        sq.done += steps
        found = _interleave([[t for c in clue_lists[s.id] for t in c.triplets] for s in steps])
        # what the last answer read, as it read it, then the round's findings (up to top-k): the earlier answers'
        # memory stays in view, and the model's cache of that prompt's start is reused
        seen = {t.id for t in self.shown}
        new = [t for t in found if t.id not in seen][: self.config.filter_top_k]
        headings = dict(self.headings)
        if headings and new:
            headings[len(self.shown)] = "Found by the search steps:"
        return await self._answer_call(sq, self.shown + new, on_text, steps[-1], headings)

    async def _search_steps(self, sq: SubQuestion, steps: list[Step], retriever: Retriever) -> dict[str, list[Clue]]:
        """Stages 3-7 of every step at once: no call among them (entities from the plan, clue-queries substituted)."""
        found: dict[str, list[Clue]] = {}

        async def search(step: Step) -> None:
            found[step.id] = await self.gather(sq, step, retriever, rewrite=False)

        await run_all(search(step) for step in steps)
        return found

    async def _next_step(self, sq: SubQuestion, step: Step) -> None:
        async with self.recorder.stage(Stage.NEXT_STEP, sub_question_id=sq.id, step_id=step.id) as scope:
            scope.detail["step"] = step.text

    async def _first_search(self, sq: SubQuestion, step: Step, retriever: Retriever) -> list[Triplet]:
        """Stages 3-7 for the question itself: one clue-query, one traversal."""
        entities, _ = await self._entities(sq, step)
        matches = await self._match(sq, step, entities, fallback=step.text)
        async with self.recorder.stage(Stage.CLUE_QUERIES, sub_question_id=sq.id, step_id=step.id) as scope:
            seeds = list(dict.fromkeys(m.vertex.id for ms in matches.values() for m in ms))
            clue = Clue(id=f"{step.id}.c1", text=step.text, seeds=seeds)
            await self.embed_clues(step, [clue])
            scope.vertices = len(seeds)
            scope.detail["clue_queries"] = [clue.text]
            scope.detail["reason"] = "first answer: the question itself, seeded by every match, no call"
        if not self.config.chain_context:
            await self.traverse(sq, step, clue, retriever)
            return clue.triplets
        # the whole budget is laid out, so a bridge line the filter ranks low still makes the cut
        await self.traverse(sq, step, clue, retriever, top_k=max(self.config.budget, self.config.filter_top_k))
        self.chain = Chain(self.query.question)
        self.chain.add(clue.triplets, await line_objects(self.qa.graph, self.user_id, clue.triplets))
        return clue.triplets  # the whole pool: ``_first_answer`` lays it out

    async def _first_answer(
        self, sq: SubQuestion, found: list[Triplet], on_text: OnText | None, step: Step, retriever: Retriever
    ) -> Verdict:
        """The answer call on the first search's lines; with ``chain_context``, read along the question's chain
        (``qa.chain``): the lines about what the question names first (one call, a short prompt), then, if that
        answer is insufficient or names another thing, that thing's lines (searched for, no call) with what the
        first call found (a second call). A 1.5B model given all the lines at once answered from the line nearest
        the question's words (13 of 14 chained 2Wiki questions); given the named thing's lines alone it names the
        bridge ("Nicki Minaj", for where the performer of a song was born), called sufficient all the same."""
        chain = self.chain
        if chain is not None and AnswerCheckTask(infer=self.config.infer_answers).inference(self.query.question):
            # an inference ("Would she ...?") follows no link: it reads the lines as the one call does without the
            # chain (on LoCoMo, read from the named lines first, one came back "No Answer" where that call inferred)
            return await self._answer_call(sq, chain.lines[: self.config.filter_top_k], on_text, step, {})
        if chain is None:
            return await self._answer_call(sq, found, on_text, step, {})
        laid = chain.sections(self.config.filter_top_k)
        if len(laid) < 2 or laid[0].part != "named":
            return await self._answer_call(sq, [t for s in laid for t in s.lines], on_text, step, _headings(laid))
        head = laid[0]
        if self.config.first_link and (hop := split(self.query.question, chain.asked_at)) is not None:
            linked = await self._first_link(sq, chain, hop, head, on_text, step, retriever)
            if linked is not None:
                return linked
        verdict = await self._answer_call(sq, head.lines, on_text, step, _headings([head]), read="the named")
        if verdict.inference:
            return verdict
        follow = chain.named_by(verdict.answer or "")
        if verdict.sufficient and not follow:
            return verdict
        if follow:
            await self._follow(sq, step, retriever, chain, follow)
        # the named thing's lines and the next link's, without the rest (lines that share the question's words
        # only, which the model answered from); no next link: every line
        laid = chain.sections(self.config.filter_top_k, follow=follow or None)
        path = [s for s in laid if s.part != "rest"]
        laid = path if len(path) > 1 else laid
        lines = [t for s in laid for t in s.lines]
        return await self._answer_call(
            sq, lines, on_text, step, _headings(laid), found=verdict.answer or "", read="along the chain"
        )

    async def _first_link(
        self,
        sq: SubQuestion,
        chain: Chain,
        hop: Hop,
        head: Section,
        on_text: OnText | None,
        step: Step,
        retriever: Retriever,
    ) -> Verdict | None:
        """The question's first link asked on its own of the named thing's lines (one call: "Who or what is the
        father of X?"), then the rest of the question asked of what it names ("Where was <the father> born?"), read
        from that thing's own lines, searched for by its name (no call). None when the link's answer names no known
        thing: the chain is read as without the link. On 2Wiki the 1.5B model, given the son's lines and the whole
        question, answered with the son's own birthplace, and named nothing to follow."""
        # not streamed: it answers a part of the question, not the question (the trace's stage event shows it)
        link = await self._answer_call(
            sq, head.lines, None, step, _headings([head]), question=hop.ask, read="the first link"
        )
        follow = chain.named_by(link.answer or "")
        if not follow:
            return None
        await self._follow(sq, step, retriever, chain, follow)
        # the linked thing's lines alone, up to top-k of their own (the named thing's lines have had their call)
        bridge = next((s for s in chain.sections(len(chain.lines), follow=follow) if s.part == "bridge"), None)
        if bridge is None:
            return None
        bridge = replace(bridge, lines=bridge.lines[: self.config.filter_top_k])
        name = next(iter(follow.values()))  # the first said: ``named_by`` keeps the answer's order
        return await self._answer_call(
            sq,
            bridge.lines,
            on_text,
            step,
            _headings([bridge]),
            question=hop.then(name),
            found=f"{hop.span}: {link.answer}",
            read="the rest, of the first link's answer",
        )

    async def _follow(
        self, sq: SubQuestion, step: Step, retriever: Retriever, chain: Chain, follow: dict[str, str]
    ) -> None:
        """Stages 5-7 for the things an answer named: one clue-query of their names, no call; its lines join the
        chain."""
        async with self.recorder.stage(Stage.CLUE_QUERIES, sub_question_id=sq.id, step_id=step.id) as scope:
            clue = Clue(id=f"{step.id}.c2", text=", ".join(follow.values()), seeds=sorted(follow))
            await self.embed_clues(step, [clue])
            scope.vertices = len(follow)
            scope.detail["clue_queries"] = [clue.text]
            scope.detail["reason"] = "the first answer named them: their own lines, no call"
        await self.traverse(sq, step, clue, retriever)
        chain.add(clue.triplets, await line_objects(self.qa.graph, self.user_id, clue.triplets))

    async def _answer_call(
        self,
        sq: SubQuestion,
        memory: list[Triplet],
        on_text: OnText | None,
        step: Step,
        headings: dict[int, str] | None = None,
        *,
        found: str = "",
        read: str = "",
        question: str = "",
    ) -> Verdict:
        """Stage 8 (the answer call, streamed) with the verdict it carries as stage 9. ``headings``: the chain
        layout's (default: the last call's); ``found``: what an earlier call on part of these lines answered;
        ``read``: which lines of the chain this call reads (for its event); ``question``: what this call asks, when
        not the question itself (a part of it: ``qa.hops``)."""
        self.shown = memory
        self.headings = self.headings if headings is None else headings
        ctx = {"sub_question_id": sq.id, "step_id": step.id}
        async with self.recorder.stage(Stage.SUMMARISE, **ctx) as scope:
            scope.triplets = len(memory)
            scope.detail["merged"] = ["sufficiency", "combine"]  # one call answers the question and judges it
            if self.headings:
                scope.detail["chain"] = [self.headings[i] for i in sorted(self.headings)]
            if read:
                scope.detail["read"] = read
            if question:
                scope.detail["asked"] = question
            inputs = AnswerCheckInput(
                question=question or self.query.question,
                parts=self.parts,
                memory=[t.context for t in memory],
                headings=self.headings,
                found=found,
                as_of=self.query.as_of,
            )
            try:
                task = AnswerCheckTask(infer=self.config.infer_answers)
                verdict = await self.task(scope, task, inputs, streamed(on_text))
            except TaskFailed as exc:
                sq.failures.append(str(exc))
                verdict = Verdict(answer=None, sufficient=False, missing="the answer")  # degrade: search on
            scope.detail["answer"] = (verdict.answer or "")[:300]
            if verdict.answer is None and scope.status is StageStatus.OK:
                scope.status = StageStatus.EMPTY
        async with self.recorder.stage(Stage.SUFFICIENCY, **ctx) as scope:
            scope.detail |= {"merged_into": ANSWER_CALL, "sufficient": verdict.sufficient, "missing": verdict.missing}
        if verdict.answer is not None:
            sq.evidence = {t.id: evidence_of(t) for t in memory}
        return verdict

    async def _plan(self, sq: SubQuestion, verdict: Verdict, round_: int) -> list[Step]:
        """One call for stages 1, 2, 3 and 10: the round's new steps (none when the call failed)."""
        enhance = self.config.plan_enhancement
        if round_ > 1 and not enhance:
            # a later round re-plans with what the earlier ones found: that is plan enhancement itself
            await self.recorder.mark(Stage.ENHANCE, StageStatus.SKIPPED, sub_question_id=sq.id)
            return []
        async with self.recorder.stage(Stage.PLAN, sub_question_id=sq.id) as scope:
            scope.detail["round"] = round_
            scope.detail["merged"] = ["decompose", "ner", "enhance"]
            inputs = SearchPlanInput(
                question=self.query.question,
                found=(verdict.answer or "nothing") if enhance else "",
                missing=verdict.missing if enhance else "",
                done=[s.text for s in sq.done[1:]],
                decompose=self.config.decomposition,
                max_sub_questions=self.config.max_sub_questions,
                max_steps=self.config.max_steps,
                max_entities=self.config.max_entities,
            )
            try:
                plan = await self.task(scope, SearchPlanTask(), inputs)
            except TaskFailed as exc:
                sq.failures.append(str(exc))
                plan = SearchPlan(sub_questions=[self.query.question], steps=[])  # degrade: the first answer stands
            scope.detail["steps"] = [s.query for s in plan.steps]
        await self._merged_plan_stages(sq, plan, enhance)
        sq.revision = round_
        steps = []
        for planned in plan.steps:
            step = sq.new_step(planned.query)
            step.entities, step.named_by = planned.names, PLAN_CALL
            steps.append(step)
        sq.pending = steps  # the plan as written, for its history; the caller searches them all at once
        self.plan_history.append(sq.plan)
        sq.pending = []
        return steps

    async def _merged_plan_stages(self, sq: SubQuestion, plan: SearchPlan, enhance: bool) -> None:
        """The events of stages 1 and 10, whose work the plan call did."""
        if self.config.decomposition:
            self.parts = plan.sub_questions
            async with self.recorder.stage(Stage.DECOMPOSE) as scope:
                scope.detail |= {"merged_into": PLAN_CALL, "sub_questions": plan.sub_questions}
        else:
            await self.recorder.mark(Stage.DECOMPOSE, StageStatus.SKIPPED)
        if enhance:
            async with self.recorder.stage(Stage.ENHANCE, sub_question_id=sq.id) as scope:
                scope.detail |= {"merged_into": PLAN_CALL, "changed": bool(plan.steps)}
        else:
            await self.recorder.mark(Stage.ENHANCE, StageStatus.SKIPPED, sub_question_id=sq.id)

    async def _stop(self, sq: SubQuestion, verdict: Verdict, rounds: int) -> None:
        """Stage 12, and the events of the planning stages when no round ran."""
        if rounds == 0:
            reason = (
                "first answer sufficient"
                if verdict.sufficient
                else _INFERENCE
                if verdict.inference
                else "no planning round allowed (max_rounds 0)"
            )
            for stage in (Stage.DECOMPOSE, Stage.PLAN, Stage.ENHANCE):
                where = None if stage is Stage.DECOMPOSE else sq.id
                async with self.recorder.stage(stage, sub_question_id=where) as scope:
                    scope.status = StageStatus.SKIPPED
                    scope.detail["reason"] = reason
        if verdict.sufficient:
            async with self.recorder.stage(Stage.NO_ANSWER, sub_question_id=sq.id) as scope:
                scope.status = StageStatus.SKIPPED
                scope.detail["reason"] = "sufficient"
            return
        async with self.recorder.stage(Stage.NO_ANSWER, sub_question_id=sq.id) as scope:
            scope.detail |= {"rounds": rounds, "missing": verdict.missing, "steps_done": len(sq.done)}
            scope.detail["reason"] = (
                _INFERENCE if verdict.inference else "no new step" if self.stalled else "round limit"
            )

    async def _finish(self, sq: SubQuestion, best: Verdict) -> Answer:
        """Stage 13: the answer call answered the whole question; a partial answer stands when no round did better."""
        async with self.recorder.stage(Stage.COMBINE) as scope:
            scope.detail["merged_into"] = ANSWER_CALL
            sq.answer = best.answer
            if best.answer is not None:
                scope.detail["sufficient"] = best.sufficient
                return self.answer_of(best.answer, AnswerStatus.ANSWERED)
            scope.status = StageStatus.EMPTY
            sq.evidence = {}
            if sq.failures:
                return self.answer_of(NO_ANSWER, AnswerStatus.ERROR, error="; ".join(sq.failures))
            return self.answer_of(NO_ANSWER, AnswerStatus.NO_ANSWER)


def _interleave(groups: list[list[Triplet]]) -> list[Triplet]:
    """One triplet of each group in turn (each step's best first), unique by id."""
    out: dict[str, Triplet] = {}
    for rank in range(max((len(g) for g in groups), default=0)):
        for group in groups:
            if rank < len(group) and group[rank].id not in out:
                out[group[rank].id] = group[rank]
    return list(out.values())


def _headings(laid: list[Section]) -> dict[int, str]:
    """The headings of laid-out lines, by the index of the line each comes before."""
    out: dict[int, str] = {}
    at = 0
    for section in laid:
        if section.heading:
            out[at] = section.heading
        at += len(section.lines)
    return out
