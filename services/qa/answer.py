"""The answer room: the final answer of the planning engine from its sub-answers (stage 13)."""

from __future__ import annotations

from schemas.events import Answer, AnswerStatus, StageStatus
from services.llm.task import TaskFailed
from services.qa.base import NO_ANSWER, OnText, RunBase
from services.qa.stages import Stage
from services.qa.streaming import streamed
from services.qa.tasks import CombineInput, CombineTask, Finding


class AnswerRoom(RunBase):
    async def combine(self, on_text: OnText | None = None) -> Answer:
        async with self.recorder.stage(Stage.COMBINE) as scope:
            answered = [sq for sq in self.sub_questions if sq.answer is not None]
            if not answered:
                failed = [f for sq in self.sub_questions for f in sq.failures]
                scope.status = StageStatus.EMPTY
                if failed:
                    return self.answer_of(NO_ANSWER, AnswerStatus.ERROR, error="; ".join([*self.errors, *failed]))
                return self.answer_of(NO_ANSWER, AnswerStatus.NO_ANSWER)
            if len(self.sub_questions) == 1:
                scope.detail["combined"] = False  # one sub-question: its answer is the answer
                return self.answer_of(answered[0].answer or NO_ANSWER, AnswerStatus.ANSWERED)
            # the one call that writes the final text: its answer streams as the model writes it
            findings = [Finding(query=sq.text, answer=sq.answer) for sq in self.sub_questions]
            try:
                text = await self.task(
                    scope,
                    CombineTask(),
                    CombineInput(question=self.query.question, sub_answers=findings),
                    streamed(on_text),
                )
            except TaskFailed as exc:
                joined = " ".join(sq.answer for sq in answered if sq.answer)
                return self.answer_of(joined, AnswerStatus.ANSWERED, error=f"combine failed, sub-answers joined: {exc}")
            if text is None:
                scope.status = StageStatus.EMPTY
                return self.answer_of(NO_ANSWER, AnswerStatus.NO_ANSWER)
            return self.answer_of(text, AnswerStatus.ANSWERED)
