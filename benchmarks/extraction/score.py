"""Score what memorize wrote against the gold facts of the same turns.

Matching, within one conversation session (a fact is often said over two turns, or shown in a photo one turn
before the text that names it):
- embeddings (MiniLM, cosine) of the gold fact and the extracted thesis, date suffix removed: at or above ``HIGH``
  it is a match, below ``LOW`` it is not;
- in between, a judge call decides (task ``judge``; each verdict is recorded with both texts and the similarity).
Recall: share of gold facts matched by some extracted thesis of their session. Precision: share of extracted
theses that match some gold fact of their session. Attribution: share of matched gold facts whose best thesis has
the same subject. Dates: share of gold facts with a resolved time whose best thesis carries that day or range
(each end within one day). Junk entities: share of object vertices whose name is not in their session's text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import date
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from benchmarks.extraction.gold import GoldFact, Turn
from services.domain import ChangeSet, Vertex, VertexKind
from services.llm.task import LLMTask, TaskFailed, run_task
from services.ports import LLM, Embedder, LLMMessage

HIGH = 0.80
LOW = 0.50
_DATE_SUFFIX = re.compile(r"\s*\([^()]*\d{4}[^()]*\)\.?$")
_WORD = re.compile(r"[a-z0-9]+")


class JudgeOut(BaseModel):
    model_config = ConfigDict(extra="ignore")

    same_person: Literal["yes", "no"]
    same_claim: Literal["yes", "no"]


class JudgeTask(LLMTask[JudgeOut, bool]):
    """Does the memory statement say the gold fact? One place for the judge prompt."""

    name = "judge"
    output_model = JudgeOut
    max_tokens = 48

    def messages(self, inputs: tuple[str, str]) -> list[LLMMessage]:
        gold, extracted = inputs
        return [
            LLMMessage(
                role="system",
                content="You check a memory against a fact. same_person: is B about the same person as A? "
                "same_claim: does B state what A states (wording may differ, B may add detail)? Answer each with "
                "yes or no. Output JSON only.",
            ),
            LLMMessage(role="user", content=f"A: {gold}\nB: {extracted}"),
        ]

    def postprocess(self, output: JudgeOut, inputs: Any) -> bool:
        # two narrow questions: a small judge asked one broad one accepts "Gina lost her job" for "Jon lost his job"
        return output.same_person == "yes" and output.same_claim == "yes"


@dataclass
class Extracted:
    vertex: Vertex
    session: tuple[str, int]

    @property
    def text(self) -> str:
        return _DATE_SUFFIX.sub("", self.vertex.name).strip()


@dataclass
class Scores:
    gold_facts: int = 0
    extracted: int = 0
    recalled: int = 0
    precise: int = 0
    attributed: int = 0
    dated_gold: int = 0
    dated_right: int = 0
    dated_recalled: int = 0  # dated gold facts that some thesis matched: the date is judged only where the fact is
    objects: int = 0
    junk_objects: int = 0
    judge_calls: int = 0
    recalled_by_embedding: int = 0  # without the judge: a lower bound that no judge's leniency inflates
    precise_by_embedding: int = 0
    judgements: list[dict[str, Any]] = field(default_factory=list)
    misses: list[dict[str, Any]] = field(default_factory=list)
    unmatched: list[str] = field(default_factory=list)
    junk: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        def share(a: int, b: int) -> float | None:
            return round(a / b, 3) if b else None

        return {
            "gold_facts": self.gold_facts,
            "extracted_theses": self.extracted,
            "fact_recall": share(self.recalled, self.gold_facts),
            "precision": share(self.precise, self.extracted),
            "attribution": share(self.attributed, self.recalled),
            "date_accuracy": share(self.dated_right, self.dated_gold),
            "dated_gold_facts": self.dated_gold,
            "date_accuracy_of_matched": share(self.dated_right, self.dated_recalled),
            "dated_matched": self.dated_recalled,
            "junk_entity_rate": share(self.junk_objects, self.objects),
            "objects": self.objects,
            "judge_calls": self.judge_calls,
            "fact_recall_embedding_only": share(self.recalled_by_embedding, self.gold_facts),
            "precision_embedding_only": share(self.precise_by_embedding, self.extracted),
        }


def _same_subject(gold: str, vertex: Vertex) -> bool:
    subject = vertex.props.get("subject", "")
    return bool(subject) and (
        subject.casefold() == gold.casefold() or subject.split()[0].casefold() == gold.split()[0].casefold()
    )


def _date_right(gold: GoldFact, vertex: Vertex) -> bool:
    if gold.start is None or gold.end is None or "when_start" not in vertex.props:
        return False
    start, end = date.fromisoformat(vertex.props["when_start"]), date.fromisoformat(vertex.props["when_end"])
    return abs((start - gold.start).days) <= 1 and abs((end - gold.end).days) <= 1


def _grounded(name: str, text: str) -> bool:
    words = [w for w in _WORD.findall(name.casefold()) if len(w) > 2] or _WORD.findall(name.casefold())
    return bool(words) and any(w[:5] in text for w in words)


async def score(
    turns: list[Turn], change_sets: list[ChangeSet], embedder: Embedder, judge: LLM | None = None
) -> Scores:
    session_of = {t.event_id: (t.sample_id, t.session) for t in turns}
    theses: dict[str, Extracted] = {}
    objects: dict[str, tuple[Vertex, tuple[str, int]]] = {}
    for cs in change_sets:
        for v in cs.vertices:
            where = session_of.get(v.props.get("event_id", ""))
            if where is None:
                continue
            if v.kind is VertexKind.THESIS:
                theses.setdefault(v.id, Extracted(v, where))
            elif v.kind is VertexKind.OBJECT:
                objects.setdefault(v.id, (v, where))
        for v in cs.vertices:  # objects carry no event id: place them by the change set's first event
            if v.kind is VertexKind.OBJECT and v.id not in objects and cs.event_ids:
                where = session_of.get(cs.event_ids[0])
                if where is not None:
                    objects[v.id] = (v, where)
    result = Scores(extracted=len(theses))
    session_text: dict[tuple[str, int], str] = {}
    for t in turns:
        key = (t.sample_id, t.session)
        session_text[key] = session_text.get(key, "") + f" {t.speaker} {t.text}".casefold()
    for vertex, where in objects.values():
        result.objects += 1
        if not _grounded(vertex.name, session_text.get(where, "")):
            result.junk_objects += 1
            result.junk.append(vertex.name)

    gold = [(t, f) for t in turns for f in t.facts]
    result.gold_facts = len(gold)
    extracted = list(theses.values())
    if not extracted:
        result.misses = [{"dia_id": t.dia_id, "gold": f.text} for t, f in gold]
        return result
    gold_vecs = np.array(await embedder.embed([f.text for _, f in gold]))
    ext_vecs = np.array(await embedder.embed([e.text for e in extracted]))
    sims = gold_vecs @ ext_vecs.T
    same_session = np.array([[(t.sample_id, t.session) == e.session for e in extracted] for t, _ in gold])
    sims = np.where(same_session, sims, -1.0)
    verdicts: dict[tuple[int, int], bool] = {}

    async def matches(g: int, e: int) -> bool:
        sim = float(sims[g, e])
        if sim >= HIGH:
            return True
        if sim < LOW or judge is None:
            return False
        if (g, e) not in verdicts:
            try:
                out = await run_task(judge, _JUDGE, (gold[g][1].text, extracted[e].text), attempts=2)
                verdict = bool(out.value)
                result.judge_calls += out.calls
            except TaskFailed:
                verdict = False
            verdicts[(g, e)] = verdict
            result.judgements.append(
                {"gold": gold[g][1].text, "extracted": extracted[e].text, "similarity": round(sim, 3), "same": verdict}
            )
        return verdicts[(g, e)]

    result.recalled_by_embedding = int((sims.max(axis=1) >= HIGH).sum())
    result.precise_by_embedding = int((sims.max(axis=0) >= HIGH).sum())
    precise: set[int] = set()
    for g, (turn, fact) in enumerate(gold):
        order = np.argsort(-sims[g])[:3]
        hit = None
        for e in order:
            if sims[g, e] < LOW:
                break
            if await matches(g, int(e)):
                hit = int(e)
                break
        if fact.start is not None:
            result.dated_gold += 1
        if hit is None:
            result.misses.append({"dia_id": turn.dia_id, "sample": turn.sample_id, "gold": fact.text})
            continue
        precise.add(hit)
        result.recalled += 1
        result.attributed += int(_same_subject(fact.subject, extracted[hit].vertex))
        result.dated_recalled += int(fact.start is not None)
        result.dated_right += int(_date_right(fact, extracted[hit].vertex))
    for e in range(len(extracted)):
        if e in precise:
            continue
        for g in np.argsort(-sims[:, e])[:2]:
            if sims[g, e] >= LOW and await matches(int(g), e):
                precise.add(e)
                break
        else:
            result.unmatched.append(extracted[e].vertex.name)
    result.precise = len(precise)
    return result


_JUDGE = JudgeTask()
