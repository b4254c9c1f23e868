"""The ``LLM`` port on an Ollama server, with JSON-schema constrained output and thinking switched off."""

from __future__ import annotations

import re
from typing import Any

from ollama import AsyncClient, ChatResponse, ResponseError

from services.adapters.ollama.errors import OllamaError, translate_errors
from services.adapters.ollama.schema import ollama_schema
from services.logging import get_logger
from services.ports import LLM, LLMRequest, LLMResponse

log = get_logger(__name__)

_THINK = re.compile(r"<think>.*?(?:</think>|\Z)", re.DOTALL | re.IGNORECASE)


class OllamaLLM(LLM):
    def __init__(
        self,
        model: str,
        *,
        host: str = "http://127.0.0.1:11434",
        stall_timeout_s: float = 300.0,
        num_ctx: int | None = None,
        seed: int = 0,
        keep_alive: str | None = None,
    ) -> None:
        self.model = model
        self.host = host
        self.num_ctx = num_ctx
        self.seed = seed
        self.keep_alive = keep_alive
        # Ollama rejects an explicit ``think`` for models without the capability; then we stop sending it.
        self.think: bool | None = False
        # Responses are streamed, so httpx's read timeout is the longest wait for the next piece: a stall limit,
        # not a cap on the whole call (a slow machine makes calls slow, not failed).
        self.client = AsyncClient(host=host, timeout=stall_timeout_s)

    def options(self, request: LLMRequest) -> dict[str, Any]:
        options: dict[str, Any] = {
            "temperature": request.temperature,
            "num_predict": request.max_tokens,
            "seed": self.seed if request.seed is None else request.seed,
        }
        if self.num_ctx:
            options["num_ctx"] = self.num_ctx
        return options

    async def _chat(self, request: LLMRequest) -> ChatResponse:
        pieces: list[str] = []
        last: ChatResponse | None = None
        stream = await self.client.chat(
            model=self.model,
            messages=[{"role": m.role, "content": m.content} for m in request.messages],
            format=None if request.json_schema is None else ollama_schema(request.json_schema),
            think=self.think,
            options=self.options(request),
            keep_alive=self.keep_alive,
            stream=True,
        )
        async for chunk in stream:
            pieces.append(chunk.message.content or "")
            if request.on_text is not None and chunk.message.content:
                request.on_text("".join(pieces))
            last = chunk
            if request.stop_when is not None and chunk.message.content and request.stop_when("".join(pieces)):
                close = getattr(stream, "aclose", None)  # an async generator: closing it ends the HTTP stream,
                if close is not None:  # and the server stops generating when its client goes
                    await close()
                last.done_reason = "stop_rule"  # no counts come before the last chunk: tokens are not reported
                break
        if last is None:
            raise ConnectionError(f"Ollama at {self.host} closed the stream without a response")
        last.message.content = "".join(pieces)
        return last

    async def complete(self, request: LLMRequest) -> LLMResponse:
        if request.grammar is not None:
            # Ollama takes a JSON schema, not a GBNF grammar; the tasks that ask for one are told apart by setting
            # (extraction_output), so this is a misconfiguration, said at once rather than answered unconstrained
            raise OllamaError(f"{request.task}: Ollama takes no GBNF grammar (set MEMSTREAM_EXTRACTION_OUTPUT=compact)")
        with translate_errors(self.host, self.model):
            try:
                response = await self._chat(request)
            except ResponseError as exc:
                if exc.status_code != 400 or "thinking" not in str(exc.error) or self.think is None:
                    raise
                log.info("ollama_think_unsupported", model=self.model)
                self.think = None
                response = await self._chat(request)
        # A model that thinks anyway reports it in .thinking (ignored) or, with old templates, inline in content.
        text = _THINK.sub("", response.message.content or "").strip()
        return LLMResponse(
            text=text,
            model=self.model,
            tokens_in=response.prompt_eval_count or 0,
            tokens_out=response.eval_count or 0,
            finish_reason=response.done_reason,
        )

    async def close(self) -> None:
        await self.client.close()
