"""One LLM task = its prompt, its JSON schema and its parser, in one place.

``run_task`` asks with schema-constrained output, validates, and on invalid output retries a bounded number of
times, telling the model what was wrong. It never returns half-parsed data: either a validated value or
``TaskFailed`` with the reason, which callers turn into a dead letter or a stage error.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ValidationError

from services.logging import get_logger
from services.metrics import LLM_REJECTED
from services.ports import LLM, LLMMessage, LLMRequest, StopRule

log = get_logger(__name__)

T = TypeVar("T")
OutT = TypeVar("OutT", bound=BaseModel)


@functools.cache
def _schema_of(model: type[BaseModel]) -> str:
    """An output model's JSON schema, generated once (pydantic builds it anew on every call: ~0.5 ms a call)."""
    return json.dumps(model.model_json_schema())


_THINK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
_FENCE = re.compile(r"^\s*```(?:json)?\s*|\s*```\s*$", re.IGNORECASE)


class TaskOutputError(ValueError):
    """The model's output does not satisfy the task's contract."""


class TaskFailed(RuntimeError):
    def __init__(self, task: str, reason: str, attempts: int, last_output: str | None = None) -> None:
        super().__init__(f"{task}: {reason} (after {attempts} attempt(s))")
        self.task = task
        self.reason = reason
        self.attempts = attempts
        self.last_output = last_output


def load_json_object(text: str) -> Any:
    """Parse model output as JSON, tolerating think-tags and code fences that some local models add."""
    cleaned = _FENCE.sub("", _THINK.sub("", text)).strip()
    try:
        return json.loads(cleaned)
    except json.JSONDecodeError as exc:
        start, end = cleaned.find("{"), cleaned.rfind("}")
        if 0 <= start < end:
            try:
                return json.loads(cleaned[start : end + 1])
            except json.JSONDecodeError:
                pass
        raise TaskOutputError(f"not valid JSON: {exc.msg} at char {exc.pos}") from exc


@dataclass
class TaskResult(Generic[T]):
    value: T
    calls: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    cached_calls: int = 0
    raw: list[str] = field(default_factory=list)


class LLMTask(ABC, Generic[OutT, T]):
    """Subclass per task: set ``name`` and ``output_model``, write ``messages`` and optionally ``postprocess``."""

    name: str
    output_model: type[OutT]
    max_tokens: int = 1024

    @abstractmethod
    def messages(self, inputs: Any) -> list[LLMMessage]: ...

    def postprocess(self, output: OutT, inputs: Any) -> T:
        """Semantic checks and conversion; raise ``TaskOutputError`` to make the call retry."""
        return output  # type: ignore[return-value]

    def json_schema(self, inputs: Any = None) -> dict[str, Any]:
        """The output schema; a task may narrow it per call (fixed entry counts, the refs it was shown)."""
        return json.loads(_schema_of(self.output_model))  # a fresh copy: a caller may narrow it in place

    def grammar(self, inputs: Any = None) -> str | None:
        """A GBNF grammar the output is written in instead of JSON (llama.cpp only; ``parse`` then reads the text);
        None: the JSON schema constrains it."""
        return None

    def parse(self, text: str, inputs: Any) -> T:
        data = load_json_object(text)
        try:
            output = self.output_model.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "<root>"
            raise TaskOutputError(f"schema violation at {where}: {first['msg']}") from exc
        return self.postprocess(output, inputs)


def numbered_pairs_schema(
    schema: dict[str, Any], count: int, allowed: Sequence[Sequence[str]] | None = None
) -> dict[str, Any]:
    """A pair-judging task's output schema (``{"pairs": [{"p", "verdict"}]}``, the entry model ``PairOut``)
    narrowed to exactly ``count`` pairs, each with its number fixed: decoding can neither skip nor repeat one.
    ``allowed``: per pair, the verdicts it may have (default: the entry model's)."""
    entry = schema["$defs"]["PairOut"]
    numbered = []
    for n in range(1, count + 1):
        verdict = entry["properties"]["verdict"]
        if allowed is not None:
            verdict = {"type": "string", "enum": list(allowed[n - 1])}
        properties = {**entry["properties"], "p": {"const": n}, "verdict": verdict}
        numbered.append({**entry, "properties": properties, "required": ["p", "verdict"]})
    pairs = {"type": "array", "prefixItems": numbered, "minItems": count, "maxItems": count}
    return {**schema, "properties": {"pairs": pairs}, "required": ["pairs"]}


#: Sampling for attempts after a rejected output: greedy decoding would give the same answer again, and a replayed
#: dead letter must be able to come out differently from the run that dead-lettered it.
RETRY_TEMPERATURE = 0.6


async def run_task(
    llm: LLM,
    task: LLMTask[Any, T],
    inputs: Any,
    attempts: int = 3,
    on_text: Callable[[str], None] | None = None,
    stop_when: StopRule | None = None,
) -> TaskResult[T]:
    """Ask, validate, retry with the error shown. Only an accepted output is cached (``llm.accept``).
    ``on_text``: streaming listener (``LLMRequest.on_text``); a retry starts its text again from "".
    ``stop_when``: ends each attempt early (``LLMRequest.stop_when``); the task's ``parse`` reads what came."""
    messages = task.messages(inputs)
    grammar = task.grammar(inputs)
    schema = None if grammar is not None else task.json_schema(inputs)
    shape = "valid JSON matching the schema" if grammar is None else "the required format"
    result: TaskResult[Any] = TaskResult(value=None)
    last_error = "no attempt made"
    last_text: str | None = None
    for attempt in range(1, max(1, attempts) + 1):
        request = LLMRequest(
            task=task.name,
            messages=messages,
            json_schema=schema,
            grammar=grammar,
            max_tokens=task.max_tokens,
            temperature=0.0 if attempt == 1 else RETRY_TEMPERATURE,
            seed=None if attempt == 1 else secrets.randbelow(2**31),
            validated=True,
            metadata={"attempt": str(attempt)},
            on_text=on_text,
            stop_when=stop_when,
        )
        if on_text is not None and attempt > 1:
            on_text("")
        response = await llm.complete(request)
        result.calls += 0 if response.cached else 1
        result.cached_calls += 1 if response.cached else 0
        result.tokens_in += response.tokens_in
        result.tokens_out += response.tokens_out
        result.raw.append(response.text)
        last_text = response.text
        try:
            result.value = task.parse(response.text, inputs)
        except TaskOutputError as exc:
            last_error = str(exc)
            if response.finish_reason == "length":
                last_error += " (output cut off by the token limit)"
            rejected(task.name, last_error)
            # Show the model its mistake: this also changes the prompt, so no cache could replay the bad answer.
            messages = [
                *task.messages(inputs),
                LLMMessage(role="assistant", content=response.text[:2000]),
                LLMMessage(
                    role="user",
                    content=f"That output was rejected: {last_error}. Reply again with only {shape}, shorter "
                    "if needed.",
                ),
            ]
            continue
        if not response.cached:
            await llm.accept(request, response)
        return result
    raise TaskFailed(task.name, last_error, attempts, last_text)


def rejected(task: str, reason: str) -> None:
    """Count and log a rejected model output (never cached, never passed on)."""
    kind = reason.split(":", 1)[0].split(" (", 1)[0][:40]
    LLM_REJECTED.labels(task, kind).inc()
    log.warning("llm_output_rejected", task=task, reason=reason[:300])
