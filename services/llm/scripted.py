"""A deterministic LLM for tests and benchmarks: answers each task from a script, never claims quality."""

from __future__ import annotations

import asyncio
import importlib
import json
import re
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any

from services.ports import LLM, LLMRequest, LLMResponse

Responder = Callable[[LLMRequest], str | dict[str, Any]]


#: how many of its latest requests a scripted LLM keeps
CALLS_KEPT = 1000


class ScriptedLLM(LLM):
    """Replies per task name: a queue of canned replies, or a function of the request.

    ``delay_s`` simulates model latency; ``calls`` records every request for assertions. With ``stream``, a request
    with an ``on_text`` listener gets its reply in pieces of ``piece_chars``, ``piece_delay_s`` apart, as a model
    decodes; ``pieces_sent`` counts them (a cancelled call stops sending). Without, the listener hears nothing.
    """

    def __init__(
        self,
        responders: dict[str, Responder] | None = None,
        model: str = "scripted",
        delay_s: float = 0.0,
        stream: bool = False,
        piece_chars: int = 4,
        piece_delay_s: float = 0.0,
    ) -> None:
        self.model = model
        self.responders: dict[str, Responder] = dict(responders or {})
        self.queues: dict[str, deque[str]] = defaultdict(deque)
        self.delay_s = delay_s
        self.stream = stream
        self.piece_chars = max(1, piece_chars)
        self.piece_delay_s = piece_delay_s
        self.pieces_sent = 0
        # the latest requests, for tests to inspect; bounded, since a soak or a demo worker runs it for hours
        self.calls: deque[LLMRequest] = deque(maxlen=CALLS_KEPT)
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
            text, stopped = _stopped(text, request, self.piece_chars)
            if self.stream and request.on_text is not None:
                await self._stream(text, request.on_text)
        finally:
            self.in_flight -= 1
        prompt = sum(len(m.content) for m in request.messages)
        return LLMResponse(
            text=text,
            model=self.model,
            tokens_in=prompt // 4,
            tokens_out=len(text) // 4,
            finish_reason="stop_rule" if stopped else None,
        )

    async def _stream(self, text: str, on_text: Callable[[str], None]) -> None:
        for end in range(self.piece_chars, len(text) + self.piece_chars, self.piece_chars):
            await asyncio.sleep(self.piece_delay_s)  # the model's time per piece; a cancel lands here
            on_text(text[:end])
            self.pieces_sent += 1


def _stopped(text: str, request: LLMRequest, piece_chars: int) -> tuple[str, bool]:
    """The reply as a model stopped by ``request.stop_when`` would give it: cut after the first piece at which the
    rule fires (pieces of ``piece_chars``, as it streams)."""
    if request.stop_when is None:
        return text, False
    for end in range(piece_chars, len(text) + piece_chars, piece_chars):
        if request.stop_when(text[:end]):
            return text[:end], True
    return text, False


def load_scripted_llm(spec: str) -> LLM:
    """``module:function`` -> the LLM that function returns (tests and demos run workers with a scripted LLM)."""
    module_name, _, attr = spec.partition(":")
    factory = getattr(importlib.import_module(module_name), attr or "make_llm")
    llm: LLM = factory()
    return llm


_WORD = re.compile(r"[A-Za-z0-9']+")
_CAPITAL = re.compile(r"\b[A-Z][a-zA-Z0-9'-]+(?:\s+[A-Z][a-zA-Z0-9'-]+)*")
_STOP = {"I", "I'm", "The", "A", "An", "It", "We", "You", "He", "She", "They", "My", "Our", "This", "That", "Wow"}
_ITEM = re.compile(r'^\[(\d+)\] (?:document (?:"(.*)", )?|([^,]{1,80}), )[A-Za-z]+ \d{1,2} [A-Za-z]+ \d{4}: (.*)$')


def _last_user(request: LLMRequest, marker: str = "") -> str:
    """The last user message containing ``marker`` (a retry appends feedback after the real input)."""
    return next(m.content for m in reversed(request.messages) if m.role == "user" and marker in m.content)


def rule_extract(request: LLMRequest) -> dict[str, Any]:
    """A content-derived stand-in for the ``extract`` task: one fact per message (its text, attributed to the
    speaker), the first capitalised word as its object.

    Deterministic and instant: for pipeline tests and throughput benchmarks, never for quality claims.
    """
    messages = []
    for line in _last_user(request, "[1] ").splitlines():
        match = _ITEM.match(line)
        if not match:
            continue
        number, title, speaker, text = match.groups()
        entities = [e for e in _CAPITAL.findall(text) if e not in _STOP and e != speaker][:3]
        subject = speaker or (entities[0] if entities else title or "document")
        fact = f"{speaker}: {text}" if speaker else text
        messages.append(
            {
                "m": int(number),
                "facts": [
                    {
                        "subject": subject,
                        "fact": fact[:200],
                        "relation": "mentioned" if entities else "",
                        "object": entities[0] if entities else "",
                        "when": "",
                        "kind": "FACT",
                        "temporal": "DYNAMIC",
                    }
                ],
            }
        )
    return {"messages": messages}


_PAIR = re.compile(r"^\[(\d+)\] NEW \([^)]*\): (.*)\n\s+KNOWN \([^)]*\): (.*)$", re.MULTILINE)


def rule_resolve(request: LLMRequest) -> dict[str, Any]:
    """Stand-in for the ``resolve`` task: "same" for equal words, else "compatible" (never invalidates)."""
    pairs = []
    for number, new, known in _PAIR.findall(request.messages[-1].content):
        same = _WORD.findall(new.lower()) == _WORD.findall(known.lower())
        pairs.append({"p": int(number), "verdict": "same" if same else "compatible"})
    return {"pairs": pairs}


def rule_resolve_check(request: LLMRequest) -> dict[str, Any]:
    """Stand-in for the ``resolve_check`` task: answers its control pairs right (the task's contract: the pair that
    holds together comes first, the one that does not last) and agrees with every verdict it is asked about
    ("not_both"), so that a script's ``resolve`` verdicts act as written."""
    numbers = [int(n) for n, _, _ in _PAIR.findall(request.messages[-1].content)]
    return {"pairs": [{"p": n, "verdict": "both_true" if n == min(numbers) else "not_both"} for n in numbers]}


_NAMES = re.compile(r'^\[(\d+)\] A: "(.*)" \(.*\)\n\s+B: "(.*)" \(.*\)$', re.MULTILINE)


def rule_same_entity(request: LLMRequest) -> dict[str, Any]:
    """Stand-in for the ``same_entity`` task: a nickname when one name's words start the other's ("Mel" /
    "Melanie"), else another entity."""
    pairs = []
    for number, a, b in _NAMES.findall(request.messages[-1].content):
        short, long = sorted((_WORD.findall(a.lower()), _WORD.findall(b.lower())), key=len)
        same = (
            bool(short)
            and len(short) == len(long)
            and all(y.startswith(x) or x.startswith(y) for x, y in zip(short, long, strict=True))
        )
        pairs.append({"p": int(number), "verdict": "nickname" if same else "other"})
    return {"pairs": pairs}


#: The rule-based responders for memorize's tasks.
MEMORIZE_RULES = {
    "extract": rule_extract,
    "resolve": rule_resolve,
    "resolve_check": rule_resolve_check,
    "same_entity": rule_same_entity,
}


def _best_line(memory: str, question: str) -> str | None:
    """The memory line (``- ...``) sharing most words of four letters or more with the question."""
    words = {w.lower() for w in _WORD.findall(question) if len(w) > 3}
    best, score = None, 0
    for line in memory.splitlines():
        if not line.startswith("- "):
            continue
        overlap = len(words & {w.lower() for w in _WORD.findall(line)})
        if overlap > score:
            best, score = line[2:], overlap
    return best


def rule_answer(request: LLMRequest) -> dict[str, Any]:
    """Stand-in for the simple QA's ``answer`` task: the memory line sharing most words with the question."""
    memory, _, question = _last_user(request, "QUESTION:").partition("QUESTION:")
    best = _best_line(memory, question)
    return {"answer": best or "No answer", "found": best is not None}


def rule_answer_check(request: LLMRequest) -> dict[str, Any]:
    """Stand-in for the fast QA's ``answer_check`` task: the same line, sufficient when there is one."""
    memory, _, question = _last_user(request, "\nQuestion: ").partition("\nQuestion: ")
    best = _best_line(memory, question.split("\n", 1)[0])
    return {"answer": best or "No answer", "sufficient": best is not None, "missing": "" if best else "the answer"}


def rule_search_plan(request: LLMRequest) -> dict[str, Any]:
    """Stand-in for the fast QA's ``search_plan`` task: the question itself, searched once more."""
    question = _last_user(request, "Question: ").split("Question: ", 1)[1].split("\n", 1)[0]
    return {"sub_questions": [question], "steps": [{"query": question, "names": []}]}


def rule_based_llm(delay_s: float = 0.0) -> ScriptedLLM:
    answers = {"answer": rule_answer, "answer_check": rule_answer_check, "search_plan": rule_search_plan}
    return ScriptedLLM({**MEMORIZE_RULES, **answers}, model="scripted-rules", delay_s=delay_s)
