"""What the QA tasks share: the few-shot message layout, list cleaning and the "nothing found" convention."""

from __future__ import annotations

import re
from abc import abstractmethod
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, model_validator

from services.ids import normalize_text
from services.llm.task import LLMTask, TaskOutputError
from services.ports import LLMMessage

OutT = TypeVar("OutT", bound=BaseModel)
T = TypeVar("T")

# Shared by every prompt: the model is a reader of the user's memory, not an oracle.
GROUNDING = "Use only the text given here, never your own knowledge. Reply with JSON only."
EMPTY_MEMORY = "(nothing found)"
NOT_FOUND = "not found"

_BULLET = re.compile(r"^\s*(?:[-*•]+(?=\s)|\(?\d{1,2}[.):](?=\s)|step\s*\d{1,2}\s*[.:)-])\s*", re.IGNORECASE)
_NO_INFO = re.compile(
    r"^(?:<\|?\s*)?(?:not\s*enough\w*\s*info\w*|no\s*(?:relevant\s*)?info(?:rmation)?|not\s*found|unknown|none|"
    r"n/?a|no\s*answer|i\s*(?:do\s*not|don't)\s*know|cannot\s*(?:be\s*)?(?:answer|determine)\w*)"
    r"(?:\s*\|?>)?[\s.!]*$",
    re.IGNORECASE,
)


def is_no_info(text: str) -> bool:
    """True for the many ways a model says it found nothing (including the reference's ``<|NotEnoughtInfo|>``)."""
    return not text.strip() or bool(_NO_INFO.match(text.strip()))


_WORD = re.compile(r"\w+", re.UNICODE)
# Function words, and words an answer may add without new facts ("Yes, both are ...", "Likely no, since ..."): not
# evidence of anything.
# fmt: off
_FUNCTION_WORDS = frozenset({
    "a", "an", "and", "are", "as", "at", "be", "been", "both", "but", "by", "did", "do", "does", "for", "from",
    "had", "has", "have", "he", "her", "him", "his", "how", "i", "in", "is", "it", "its", "of", "on", "or", "she",
    "so", "that", "the", "their", "them", "then", "there", "these", "they", "this", "those", "to", "was", "we",
    "were", "what", "when", "where", "which", "who", "whom", "whose", "why", "will", "with", "yes", "no", "not",
    "also", "same", "different", "answer", "found", "than", "likely", "unlikely", "probably", "since", "because"
})
# fmt: on


def content_words(text: str) -> set[str]:
    return {w for w in _WORD.findall(text.casefold()) if w not in _FUNCTION_WORDS}


def names_in(text: str) -> set[str]:
    """Content words written capitalised, not counting the first word: the names a question is about."""
    words = _WORD.findall(text)[1:]
    return {w.casefold() for w in words if w[0].isupper()} & content_words(text)


def grounded(answer: str, sources: Sequence[str], question: str, min_share: float = 0.5) -> bool:
    """Whether the words an answer adds to its question come from the sources: a cheap guard against a small
    model answering from its own knowledge (e.g. naming a country the memory never mentions)."""
    new = content_words(answer) - content_words(question)
    if not new:
        return True
    known = set().union(*(content_words(s) for s in sources)) if sources else set()
    return len(new & known) / len(new) >= min_share


def clean_items(items: Iterable[str], limit: int | None = None, max_chars: int = 300) -> list[str]:
    """Strip bullets and numbering, drop blanks and case/space duplicates, keep order."""
    seen: set[str] = set()
    out: list[str] = []
    for item in items:
        text = _BULLET.sub("", item).strip().strip('"').strip()
        key = normalize_text(text)
        if not any(c.isalnum() for c in key) or key in seen or len(text) > max_chars:
            continue
        seen.add(key)
        out.append(text)
        if limit is not None and len(out) >= limit:
            break
    return out


def memory_block(lines: Sequence[str]) -> str:
    return "\n".join(f"- {line}" for line in lines) if lines else EMPTY_MEMORY


def numbered(lines: Sequence[str]) -> str:
    return "\n".join(f"{i}. {line}" for i, line in enumerate(lines, 1)) if lines else EMPTY_MEMORY


class ListOutput(BaseModel):
    """An output whose only field is a list: a bare JSON list is accepted as that field."""

    @model_validator(mode="before")
    @classmethod
    def _bare_list(cls, data: Any) -> Any:
        if isinstance(data, list) and len(cls.model_fields) == 1:
            return {next(iter(cls.model_fields)): data}
        return data


class FoundAnswer(BaseModel):
    found: bool
    answer: str


def found_answer(output: FoundAnswer, sources: Sequence[str], question: str) -> str | None:
    """The answer text, or None when the model found nothing (flag or wording) or its answer is not grounded."""
    answer = output.answer.strip()
    if not output.found or is_no_info(answer) or not grounded(answer, sources, question):
        return None
    return answer


class PromptTask(LLMTask[OutT, T]):
    """A task prompted as: rules (system), one worked example (user/assistant), then the real input."""

    system: ClassVar[str]
    example_input: ClassVar[str]
    example_output: ClassVar[BaseModel]

    @abstractmethod
    def render(self, inputs: Any) -> str: ...

    def messages(self, inputs: Any) -> list[LLMMessage]:
        return [
            LLMMessage(role="system", content=f"{self.system}\n{GROUNDING}"),
            LLMMessage(role="user", content=self.example_input),
            LLMMessage(role="assistant", content=self.example_output.model_dump_json()),
            LLMMessage(role="user", content=self.render(inputs)),
        ]


def require(items: list[str], what: str) -> list[str]:
    if not items:
        raise TaskOutputError(f"no usable {what} in the output")
    return items
