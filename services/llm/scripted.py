"""A deterministic LLM for tests and benchmarks: answers each task from a script, never claims quality."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any

from services.ports import LLM, LLMRequest, LLMResponse

Responder = Callable[[LLMRequest], str | dict[str, Any]]


class ScriptedLLM(LLM):
    """Replies per task name: a queue of canned replies, or a function of the request.

    ``delay_s`` simulates model latency; ``calls`` records every request for assertions.
    """

    def __init__(
        self,
        responders: dict[str, Responder] | None = None,
        model: str = "scripted",
        delay_s: float = 0.0,
    ) -> None:
        self.model = model
        self.responders: dict[str, Responder] = dict(responders or {})
        self.queues: dict[str, deque[str]] = defaultdict(deque)
        self.delay_s = delay_s
        self.calls: list[LLMRequest] = []
        self.in_flight = 0
        self.max_in_flight = 0

    def queue(self, task: str, *replies: str | dict[str, Any]) -> None:
        for reply in replies:
            self.queues[task].append(reply if isinstance(reply, str) else json.dumps(reply))

    def calls_for(self, task: str) -> list[LLMRequest]:
        return [c for c in self.calls if c.task == task]

    async def complete(self, request: LLMRequest) -> LLMResponse:
        self.calls.append(request)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            if self.queues[request.task]:
                text = self.queues[request.task].popleft()
            elif request.task in self.responders:
                reply = self.responders[request.task](request)
                text = reply if isinstance(reply, str) else json.dumps(reply)
            else:
                raise LookupError(f"scripted LLM has no reply for task {request.task!r}")
        finally:
            self.in_flight -= 1
        prompt = sum(len(m.content) for m in request.messages)
        return LLMResponse(text=text, model=self.model, tokens_in=prompt // 4, tokens_out=len(text) // 4)
