"""The scripted LLM of ``memstream eval --llm scripted``: memorize's and the simple QA's rules plus word-overlap
judges. It exercises the harness end to end in seconds; its numbers measure nothing about quality."""

from __future__ import annotations

import re
from typing import Any

from evaluation.metrics import normalize_answer
from services.llm.scripted import ScriptedLLM, rule_based_llm
from services.ports import LLMRequest

_FIELD = re.compile(r"^(GOLD|ANSWER|FACT): (.*)$", re.MULTILINE)


def _fields(request: LLMRequest) -> dict[str, str]:
    return dict(_FIELD.findall(request.messages[-1].content))


def rule_judge(request: LLMRequest) -> dict[str, Any]:
    """CORRECT when a gold answer's words are all in the answer."""
    fields = _fields(request)
    answer = set(normalize_answer(fields.get("ANSWER", "")).split())
    golds = [set(normalize_answer(g).split()) for g in fields.get("GOLD", "").split(" | ")]
    correct = any(g and g <= answer for g in golds)
    return {
        "reason": "rule: gold words in the answer" if correct else "rule: gold words missing",
        "verdict": "CORRECT" if correct else "WRONG",
    }


def rule_retention(request: LLMRequest) -> dict[str, Any]:
    """CORRECT when most of the fact's words are in the context."""
    content = request.messages[-1].content
    context, _, fact = content.partition("\nFACT: ")
    words = set(normalize_answer(fact).split())
    shown = set(normalize_answer(context).split())
    correct = bool(words) and len(words & shown) >= 0.7 * len(words)
    return {"reason": "rule: word overlap", "verdict": "CORRECT" if correct else "WRONG"}


def eval_llm() -> ScriptedLLM:
    llm = rule_based_llm()
    llm.responders.update({"judge": rule_judge, "judge_retention": rule_retention})
    return llm
