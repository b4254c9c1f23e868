"""The plan room of the planning engine (today's PAI-2 pipeline, ``MEMSTREAM_QA_ENGINE=planning``): decompose the
question (stage 1), plan each sub-question (2), and search it step by step (11, the search room's 3-8), asking
after each step whether the findings suffice (9), rewriting the steps left (10), up to the step limit (12). One LLM
call per stage and step; sub-questions run concurrently."""

from __future__ import annotations

from schemas.events import StageStatus
from services import ids
from services.llm.task import TaskFailed
from services.qa.base import Step, SubQuestion
from services.qa.search import SearchRoom
from services.qa.stages import Stage
from services.qa.tasks import (
    DecomposeInput,
    DecomposeTask,
    EnhanceInput,
    EnhanceTask,
    PlanInput,
    PlanTask,
    SufficiencyInput,
    SufficiencyTask,
)
from services.retrieval.base import Retriever


class PlanRoom(SearchRoom):
    async def decompose(self) -> list[str]:
        question = self.query.question
        if not self.config.decomposition:
            await self.recorder.mark(Stage.DECOMPOSE, StageStatus.SKIPPED)
            return [question]
        async with self.recorder.stage(Stage.DECOMPOSE) as scope:
            try:
                inputs = DecomposeInput(question=question, max_sub_questions=self.config.max_sub_questions)
                texts = await self.task(scope, DecomposeTask(), inputs)
            except TaskFailed as exc:
                self.errors.append(str(exc))
                texts = [question]  # degrade: the question itself is the only sub-question
            scope.detail["sub_questions"] = texts
            return texts

    async def solve(self, sq: SubQuestion, retriever: Retriever) -> None:
        ctx = {"sub_question_id": sq.id}
        async with self.recorder.stage(Stage.PLAN, **ctx) as scope:
            try:
                texts = await self.task(scope, PlanTask(), PlanInput(question=sq.text, max_steps=self.config.max_steps))
            except TaskFailed as exc:
                sq.failures.append(str(exc))
                texts = [sq.text]  # degrade: one step, the sub-question itself
            sq.pending = [sq.new_step(t) for t in texts]
            scope.detail["steps"] = texts
        self.plan_history.append(sq.plan)

        while sq.pending and len(sq.done) < self.config.max_steps:
            step = sq.pending.pop(0)
            async with self.recorder.stage(Stage.NEXT_STEP, step_id=step.id, **ctx) as scope:
                scope.detail["step"] = step.text
            step.answer = await self.search_step(sq, step, retriever)
            sq.done.append(step)
            if await self._sufficient(sq, step):
                return
            if len(sq.done) >= self.config.max_steps:
                break
            await self._enhance(sq, step)

        async with self.recorder.stage(Stage.NO_ANSWER, **ctx) as scope:
            scope.detail["steps_done"] = len(sq.done)
            scope.detail["reason"] = "step limit" if len(sq.done) >= self.config.max_steps else "plan exhausted"

    async def _sufficient(self, sq: SubQuestion, step: Step) -> bool:
        async with self.recorder.stage(Stage.SUFFICIENCY, sub_question_id=sq.id, step_id=step.id) as scope:
            if step.answer is None:
                # Nothing new was learnt, so the last verdict (not enough) stands: save the call.
                scope.status = StageStatus.SKIPPED
                return False
            own = ids.normalize_text(sq.text)
            if any(ids.normalize_text(s.text) == own for s in sq.pending):
                # The plan still holds the question itself: its search comes before any verdict. Asked "Where does
                # Tom work now?" after "Who is Tom?" had found "a chemistry teacher" (said in April), the default
                # model judged that sufficient and never reached the step that would have found September's job.
                scope.status = StageStatus.SKIPPED
                scope.detail["reason"] = "the question's own step is still to come"
                return False
            try:
                steps_left = min(len(sq.pending), self.config.max_steps - len(sq.done))
                inputs = SufficiencyInput(question=sq.text, findings=sq.findings, steps_left=steps_left)
                answer = await self.task(scope, SufficiencyTask(), inputs)
            except TaskFailed as exc:
                sq.failures.append(str(exc))
                return False  # degrade: keep searching
            asked = [s for s in sq.done if s.answer and ids.normalize_text(s.text) == own]
            if answer is not None and asked and asked[-1].answer != answer:
                # A step that asked the question itself found its answer: that is the answer. Given "Who is Maya?"
                # and "Where does Maya work now?" found, the default model answered the second with the first.
                scope.detail["answer_of_step"] = asked[-1].id
                answer = asked[-1].answer
            scope.detail["sufficient"] = answer is not None
            sq.answer = answer
            return answer is not None

    async def _enhance(self, sq: SubQuestion, step: Step) -> None:
        ctx = {"sub_question_id": sq.id, "step_id": step.id}
        if not self.config.plan_enhancement:
            await self.recorder.mark(Stage.ENHANCE, StageStatus.SKIPPED, **ctx)
            return
        async with self.recorder.stage(Stage.ENHANCE, **ctx) as scope:
            inputs = EnhanceInput(
                question=sq.text,
                done=sq.findings,
                remaining=[s.text for s in sq.pending],
                max_steps=self.config.max_steps - len(sq.done),
            )
            try:
                texts = await self.task(scope, EnhanceTask(), inputs)
            except TaskFailed as exc:
                sq.failures.append(str(exc))
                return  # degrade: keep the plan as it is
            if not texts or texts == inputs.remaining:
                scope.detail["changed"] = False
                return
            sq.revision += 1
            old = {ids.normalize_text(s.text): s for s in sq.pending}
            sq.pending = [old.get(ids.normalize_text(t)) or sq.new_step(t) for t in texts]
            scope.detail["changed"] = True
            scope.detail["steps"] = texts
        self.plan_history.append(sq.plan)
