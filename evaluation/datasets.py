"""Evaluation datasets as memory events (what memorize ingests) and questions (what QA answers).

Every loader takes any file of its format (``--data FILE``); defaults live under ``--data-dir`` (../shared/data).
Gold evidence is named by event ids: the chat turns or paragraphs whose memory (episodes, and the theses derived
from them) a good context contains. 2WikiMultihopQA adds its gold triples.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from schemas.events import ChatMessage, Document
from services import ids
from services.ingest.locomo import locomo_messages

MemoryEvent = ChatMessage | Document

#: Documents have no time of their own; a fixed one keeps prompts, and so the LLM cache keys, the same across runs.
DOCUMENT_TIME = datetime(2024, 1, 1, tzinfo=UTC)
#: LoCoMo's category numbers (the Mem0 paper's names); 5 is adversarial (unanswerable), left out by default.
LOCOMO_CATEGORIES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop", 5: "adversarial"}


@dataclass(frozen=True)
class EvalQuestion:
    id: str
    user_id: str
    text: str
    answers: list[str]  # the gold answer first, then its aliases
    category: str
    evidence: list[str] = field(default_factory=list)  # gold event ids
    triples: list[tuple[str, str, str]] = field(default_factory=list)  # 2Wiki gold triples
    #: the question has no answer in the data (LoCoMo's adversarial ones): right is saying so
    unanswerable: bool = False


@dataclass
class Dataset:
    name: str
    events: list[MemoryEvent]
    questions: list[EvalQuestion]
    #: MINE: the questions are facts to be retained (judged against what memory returns for them), not asked
    retention: bool = False


def _read(path: Path) -> Any:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def _sample(items: Sequence[Any], n: int | None, seed: int) -> list[Any]:
    """``n`` items drawn with ``seed``, in their file order (all when n is None or large)."""
    if n is None or n >= len(items):
        return list(items)
    chosen = sorted(random.Random(seed).sample(range(len(items)), n))
    return [items[i] for i in chosen]


def _document(prefix: str, user_id: str, title: str, text: str) -> Document:
    doc_id = f"{prefix}:{ids.digest(title, text)}"
    return Document(
        event_id=doc_id,
        user_id=user_id,
        event_time=DOCUMENT_TIME,
        document_id=doc_id,
        title=title[:1000] or None,
        text=text,
    )


_SESSION_OF = re.compile(r"D(\d+):\d+$")
#: a corpus title's trailing disambiguator: "Goodbye, Franziska (1941 film)", "George Pearson (filmmaker)"
_DISAMBIGUATOR = re.compile(r"\s*\([^()]*\)\s*$")


def locomo_session(turn_id: str) -> int:
    """The session number of a LoCoMo dialogue id ("D3:5" -> 3; also the tail of an event id "locomo:conv-26:D3:5");
    0 for an id not of that form (a few evidence ids are malformed), which no session limit excludes."""
    found = _SESSION_OF.search(turn_id.strip())
    return int(found.group(1)) if found else 0


def load_locomo(
    path: Path, samples: set[str] | None = None, adversarial: bool = False, sessions: int | None = None
) -> Dataset:
    """Each conversation its own user; turns as chat events at their session's date; QA with evidence turns.
    ``sessions``: only the first N sessions of each, and the questions whose evidence lies all within them (a
    long conversation's memory is built in order, so its first sessions can be scored while the rest is built)."""
    data = _read(path)
    events: list[MemoryEvent] = []
    questions: list[EvalQuestion] = []
    for index, sample in enumerate(data if isinstance(data, list) else [data]):
        sid = str(sample.get("sample_id") or f"sample-{index}")
        if samples and sid not in samples:
            continue
        user = f"eval-locomo-{sid}"
        events.extend(
            m for m in locomo_messages(sample, user) if sessions is None or locomo_session(m.event_id) <= sessions
        )
        for n, qa in enumerate(sample.get("qa", [])):
            category = int(qa.get("category", 0))
            if category == 5 and not adversarial:
                continue
            if sessions is not None and any(locomo_session(e) > sessions for e in qa.get("evidence", []) if e):
                continue
            answer = "No answer" if category == 5 else str(qa.get("answer", ""))
            evidence = [f"locomo:{sid}:{e}".replace(" ", "_") for e in qa.get("evidence", []) if e]
            questions.append(
                EvalQuestion(
                    id=f"{sid}:q{n}",
                    user_id=user,
                    text=str(qa["question"]),
                    answers=[answer],
                    category=LOCOMO_CATEGORIES.get(category, str(category)),
                    evidence=evidence,
                    unanswerable=category == 5,
                )
            )
    return Dataset("locomo", events, questions)


def load_mine(path: Path, questions: int | None = None, seed: int = 0) -> Dataset:
    """MINE: each essay one document of its own user; its 15 gold facts are what memory should retain."""
    data = _read(path)
    essays = list(enumerate(zip(data["essays"], data["answers"], strict=True)))
    events: list[MemoryEvent] = []
    facts: list[EvalQuestion] = []
    for index, (essay, answers) in _sample(essays, questions, seed):
        user = f"eval-mine-{index}"
        text = str(essay["content"]).strip().strip("`").strip()
        doc = _document("mine", user, str(essay.get("topic", "")), text)
        events.append(doc)
        for n, item in enumerate(answers):
            fact = str(item["answer"] if isinstance(item, dict) else item)
            facts.append(EvalQuestion(f"mine{index}:f{n}", user, fact, [fact], "retention", [doc.event_id]))
    return Dataset("mine", events, facts, retention=True)


def _documents_dataset(
    name: str,
    records: list[dict[str, Any]],
    question: Callable[[dict[str, Any], str, dict[str, str]], EvalQuestion],
    paragraphs: Callable[[dict[str, Any]], list[tuple[str, str]]],
) -> Dataset:
    """One user for the whole corpus subset: the chosen questions' paragraphs, each once."""
    user = f"eval-{name}"
    docs: dict[str, Document] = {}
    by_title: dict[str, str] = {}
    out: list[EvalQuestion] = []
    for record in records:
        for title, text in paragraphs(record):
            if not text.strip():
                continue
            doc = _document(name, user, title, text)
            docs.setdefault(doc.event_id, doc)
            by_title.setdefault(ids.normalize_name(title), doc.event_id)
        out.append(question(record, user, by_title))
    return Dataset(name, list(docs.values()), out)


def load_hotpotqa(path: Path, questions: int | None = None, seed: int = 0) -> Dataset:
    """HotpotQA (distractor format): the question's context paragraphs as documents; gold: supporting titles."""

    def question(r: dict[str, Any], user: str, by_title: dict[str, str]) -> EvalQuestion:
        titles = dict.fromkeys(ids.normalize_name(str(t)) for t, _ in r.get("supporting_facts", []))
        evidence = [by_title[t] for t in titles if t in by_title]
        return EvalQuestion(str(r["_id"]), user, r["question"], [str(r["answer"])], str(r.get("type", "")), evidence)

    def paragraphs(r: dict[str, Any]) -> list[tuple[str, str]]:
        return [(str(title), "".join(sentences).strip()) for title, sentences in r.get("context", [])]

    return _documents_dataset("hotpotqa", _sample(_read(path), questions, seed), question, paragraphs)


def load_musique(path: Path, questions: int | None = None, seed: int = 0) -> Dataset:
    """MuSiQue: its paragraphs as documents; gold: those marked ``is_supporting``; answers with aliases."""

    def question(r: dict[str, Any], user: str, by_title: dict[str, str]) -> EvalQuestion:
        supporting = [p for p in r.get("paragraphs", []) if p.get("is_supporting")]
        evidence = [_document("musique", user, *paragraph(p)).event_id for p in supporting]
        hops = str(r["id"]).split("__", 1)[0]
        answers = [str(r["answer"]), *map(str, r.get("answer_aliases", []))]
        return EvalQuestion(str(r["id"]), user, r["question"], answers, hops, evidence)

    def paragraph(p: dict[str, Any]) -> tuple[str, str]:
        return str(p["title"]), str(p["paragraph_text"]).strip()

    def paragraphs(r: dict[str, Any]) -> list[tuple[str, str]]:
        return [paragraph(p) for p in r.get("paragraphs", [])]

    return _documents_dataset("musique", _sample(_read(path), questions, seed), question, paragraphs)


def load_2wiki(path: Path, corpus: Path, questions: int | None = None, seed: int = 0) -> Dataset:
    """2WikiMultihopQA: questions with gold triples; their paragraphs are the corpus passages titled by a triple's
    subject or object (the file gives no per-question context). A name no passage is titled by exactly is looked up
    without the corpus titles' disambiguator: the triple says "Goodbye, Franziska", the passage is titled "Goodbye,
    Franziska (1941 film)" (105 of the 600 questions' names; all such passages are taken, as a reader would)."""
    exact: dict[str, list[tuple[str, str]]] = {}
    plain: dict[str, list[tuple[str, str]]] = {}
    for p in _read(corpus):
        title = str(p["title"])
        exact.setdefault(ids.normalize_name(title), []).append((title, str(p["text"])))
        plain.setdefault(ids.normalize_name(_DISAMBIGUATOR.sub("", title)), []).append((title, str(p["text"])))

    def names(r: dict[str, Any]) -> list[str]:
        return list(dict.fromkeys(ids.normalize_name(str(x)) for s, _, o in r.get("evidence", []) for x in (s, o)))

    def paragraphs(r: dict[str, Any]) -> list[tuple[str, str]]:
        return [p for n in names(r) for p in exact.get(n) or plain.get(n, [])]

    def question(r: dict[str, Any], user: str, by_title: dict[str, str]) -> EvalQuestion:
        triples = [(str(s), str(rel), str(o)) for s, rel, o in r.get("evidence", [])]
        titles = dict.fromkeys(ids.normalize_name(title) for title, _ in paragraphs(r))
        evidence = [by_title[t] for t in titles if t in by_title]
        return EvalQuestion(
            str(r["id"]), user, r["question"], [str(r["answer"])], str(r.get("question_type", "")), evidence, triples
        )

    return _documents_dataset("2wiki", _sample(_read(path), questions, seed), question, paragraphs)


#: dataset name -> default file(s) under the data dir
DEFAULT_FILES = {
    "locomo": ("locomo/locomo_dev7.json",),
    "mine": ("mine/mine_dev70.json",),
    "hotpotqa": ("hotpotqa/hotpotqa_train100_hipporag.json",),
    "musique": ("musique/musique_train100_hipporag.json",),
    "2wiki": ("2wikimultihopqa/questions_dev600.json", "2wikimultihopqa/corpus.json"),
}
NAMES = tuple(DEFAULT_FILES)


def load(
    name: str,
    data_dir: Path,
    data: Path | None = None,
    corpus: Path | None = None,
    questions: int | None = None,
    seed: int = 0,
    samples: set[str] | None = None,
    adversarial: bool = False,
    sessions: int | None = None,
) -> Dataset:
    """The named dataset from ``data`` (or its default file under ``data_dir``). LoCoMo keeps every question of
    the chosen conversations (``--questions`` samples the answered ones later); the others take ``questions``
    records and only their paragraphs."""
    if name not in DEFAULT_FILES:
        raise ValueError(f"unknown dataset {name!r}; known: {', '.join(NAMES)}")
    files = DEFAULT_FILES[name]
    path = data or data_dir / files[0]
    if name == "locomo":
        return load_locomo(path, samples, adversarial, sessions)
    if name == "mine":
        return load_mine(path, questions, seed)
    if name == "hotpotqa":
        return load_hotpotqa(path, questions, seed)
    if name == "musique":
        return load_musique(path, questions, seed)
    return load_2wiki(path, corpus or data_dir / files[1], questions, seed)
