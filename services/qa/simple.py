"""Minimal QA path: retrieve the user's theses by similarity, answer with the LLM from them only.

Scripted-LLM contract (task name ``answer``): reply ``{"answer": "...", "found": true|false}``; the prompt's last
user message lists the memory as lines ``"- [date] thesis"`` (``Vertex.context``: an opinion or prediction
with its label and holder, marks such as "conflicts with: ..." after it) after ``MEMORY:`` and the question after
``QUESTION:``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated

from pydantic import BaseModel, ConfigDict, StringConstraints

from schemas.events import Answer, AnswerStatus, EvidenceTriplet, Query, StageEvent, StageStatus
from services import metrics
from services.domain import Vertex, VertexKind
from services.llm.task import LLMTask, TaskFailed, run_task
from services.ports import LLM, Embedder, GraphStore, LLMMessage, VectorStore
from services.qa.base import Emit, Shown
from services.qa.streaming import streamed


class AnswerOut(BaseModel):
    model_config = ConfigDict(extra="ignore")

    answer: Annotated[str, StringConstraints(strip_whitespace=True, min_length=1, max_length=2000)]
    found: bool = True


@dataclass(frozen=True)
class AnswerInput:
    question: str
    memory: list[Vertex]


SYSTEM = """You answer questions about a user's conversations using ONLY the MEMORY lines (dated statements).
Prefer the most recent statement when they disagree, but a line that "conflicts with" another is disputed: give
both. An OPINION or PREDICTION line is what its holder thought or expected: say whose and when ("Ben thought in
March that ..."), and whether it was confirmed or refuted. If MEMORY does not contain the answer, reply found=false and
answer "No answer". Be brief: a phrase or one sentence. Output JSON only."""


class AnswerTask(LLMTask[AnswerOut, AnswerOut]):
    name = "answer"
    output_model = AnswerOut
    max_tokens = 200

    def messages(self, inputs: AnswerInput) -> list[LLMMessage]:
        memory = "\n".join(f"- {v.context}" for v in inputs.memory) or "(empty)"
        return [
            LLMMessage(role="system", content=SYSTEM),
            LLMMessage(role="user", content=f"MEMORY:\n{memory}\nQUESTION: {inputs.question}"),
        ]


class SimpleQA:
    def __init__(self, graph: GraphStore, vectors: VectorStore, embedder: Embedder, llm: LLM, top_k: int = 12) -> None:
        self.graph = graph
        self.vectors = vectors
        self.embedder = embedder
        self.llm = llm
        self.top_k = top_k
        self.task = AnswerTask()

    async def answer(
        self, query: Query, emit: Emit | None = None, on_text: Callable[[str], None] | None = None
    ) -> Answer:
        started = time.perf_counter()
        trace_id = f"tr_{query.query_id}"

        async def stage(number: int, name: str, t0: float, status: StageStatus, **fields: int) -> None:
            duration = time.perf_counter() - t0
            metrics.QA_STAGE_LATENCY.labels(stage=str(number), stage_name=name).observe(duration)
            if emit is not None:
                await emit(
                    StageEvent(
                        event_id=f"{query.query_id}:{number}",
                        user_id=query.user_id,
                        event_time=query.event_time,
                        query_id=query.query_id,
                        trace_id=trace_id,
                        stage=number,
                        stage_name=name,
                        started_at=datetime.now(UTC),
                        duration_ms=duration * 1000,
                        status=status,
                        **fields,
                    )
                )

        t0 = time.perf_counter()
        vector = (await self.embedder.embed([query.question]))[0]
        # theses and the messages themselves: what extraction missed is still found in the words said
        kinds = [VertexKind.THESIS.value, VertexKind.EPISODIC.value]
        hits = await self.vectors.search(query.user_id, kinds, vector, query.question, k=self.top_k * 3)
        found = await self.graph.get_vertices(query.user_id, [h.id for h in hits])
        memory = [found[h.id] for h in hits if h.id in found and found[h.id].valid_at(query.as_of)][: self.top_k]
        await stage(6, "traversal", t0, StageStatus.OK if memory else StageStatus.EMPTY, vertices=len(memory))

        t0 = time.perf_counter()
        evidence = [EvidenceTriplet(id=v.id, text=v.text, kind=v.kind.value) for v in memory]
        shown = Shown(on_text)
        try:
            inputs = AnswerInput(query.question, memory)
            result = await run_task(self.llm, self.task, inputs, on_text=streamed(shown.listener))
        except TaskFailed as exc:
            await stage(13, "combine", t0, StageStatus.ERROR)
            shown.last("")
            return self._answer(query, trace_id, "", AnswerStatus.ERROR, evidence, started, 0, str(exc))
        status = AnswerStatus.ANSWERED if result.value.found and memory else AnswerStatus.NO_ANSWER
        text = result.value.answer if status is AnswerStatus.ANSWERED else "No answer"
        shown.last(text)
        await stage(
            13,
            "combine",
            t0,
            StageStatus.OK,
            llm_calls=result.calls,
            tokens_in=result.tokens_in,
            tokens_out=result.tokens_out,
            vertices=len(memory),
        )
        return self._answer(query, trace_id, text, status, evidence, started, result.calls, None)

    @staticmethod
    def _answer(
        query: Query,
        trace_id: str,
        text: str,
        status: AnswerStatus,
        evidence: list[EvidenceTriplet],
        started: float,
        llm_calls: int,
        error: str | None,
    ) -> Answer:
        return Answer.to(
            query,
            trace_id=trace_id,
            answer=text,
            status=status,
            evidence=evidence,
            duration_ms=(time.perf_counter() - started) * 1000,
            llm_calls=llm_calls,
            error=error,
        )
