"""The planning engine: today's PAI-2 pipeline, one LLM call per stage and step (``MEMSTREAM_QA_ENGINE=planning``).
About 10 calls a question with the default model; the fast engine (``services.qa.fast``) is the default."""

from __future__ import annotations

from schemas.events import Answer, Query
from services.qa.answer import AnswerRoom
from services.qa.base import Engine, OnText, QAConfig, RunBase, SubQuestion, run_all
from services.qa.plan import PlanRoom
from services.qa.stages import StageRecorder


class PlanningQA(Engine):
    """Stages 1-13 in order: decompose, then per sub-question plan and search step by step, then combine."""

    def new_run(self, query: Query, config: QAConfig, recorder: StageRecorder) -> RunBase:
        return _PlanningRun(self, query, config, recorder)


class _PlanningRun(PlanRoom, AnswerRoom):
    async def execute(self, on_text: OnText | None) -> Answer:
        retriever = self.qa.retriever(self.config.retriever)  # fail fast, before any LLM call
        texts = await self.decompose()
        self.sub_questions = [SubQuestion(id=f"sq{i}", text=t) for i, t in enumerate(texts, 1)]
        await run_all(self.solve(sq, retriever) for sq in self.sub_questions)
        return await self.combine(on_text)
