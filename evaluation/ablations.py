"""The paper's ablations as variants of the memory mode in one run: ``memstream eval --ablation SPEC``.

A spec is one or more switches joined by commas (``no_enhancement``, ``clues=2``, ``no_enhancement,clues=2``); its
rows are the mode ``memory[SPEC]``, scored exactly like ``memory``. ``engine=NAME`` answers with another QA engine
(``fast``, ``planning``, ``simple``) over the same memory and LLM cache: ``--ablation engine=planning`` puts today's
planning engine beside the default on the same questions, in one run. Every switch but ``no_batching`` is a per-query
option (``QueryOptions``, what ``memstream ask --no-enhancement`` sends), so the variant asks the run's one engine
and shares its memory and LLM cache: only the calls the switch changes reach the model. ``no_batching`` needs a
memory of its own, memorized one message per call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from schemas.events import QueryOptions
from services.retrieval.registry import available

#: ``NAME`` / ``no_NAME``: the planning QA's switches
SWITCHES = {
    "enhancement": "plan_enhancement",
    "decomposition": "decomposition",
    "episodic": "episodic_context",
    "inference": "infer_answers",
    "near_matches": "near_match_clues",
    "chain": "chain_context",
    "first_link": "first_link",
}
#: ``NAME=N``: its counts
COUNTS = {"clues": "max_clue_queries", "steps": "max_steps", "top_k": "filter_top_k", "rounds": "max_rounds"}
ENGINES = ("fast", "planning", "simple")


def _bounds(field: str) -> str:
    """``lo..hi`` of a count, as ``QueryOptions`` bounds it (the query refuses what the ablation would)."""
    metadata = QueryOptions.model_fields[field].metadata
    low = next(m.ge for m in metadata if hasattr(m, "ge"))
    high = next(m.le for m in metadata if hasattr(m, "le"))
    return f"{low}..{high}"


#: every spec, as a refused one's error lists them (the one list: the CLI's help points here)
KNOWN = ", ".join(
    [
        f"engine={'|'.join(ENGINES)}",
        *(f"no_{name}, {name}" for name in SWITCHES),
        "flat (the flat retriever instead of the traversal)",
        "retriever=NAME",
        *(f"{name}={_bounds(field)}" for name, field in COUNTS.items()),
        "no_batching",
    ]
)


@dataclass(frozen=True)
class Ablation:
    spec: str
    options: QueryOptions
    batch: int | None = None  # memorize's batch size of its own memory; None: the run's memory
    engine: str | None = None  # the QA engine that answers (``MEMSTREAM_QA_ENGINE``); None: the run's

    @property
    def mode(self) -> str:
        return f"memory[{self.spec}]"


def _switch(part: str, options: dict[str, Any]) -> None:
    key, has_value, value = part.partition("=")
    if part == "flat":
        options["retriever"] = "flat"
    elif key == "retriever" and value:
        # a query naming an unknown retriever is answered with an error: refused here, before anything runs
        unknown = [n for n in value.split("+") if n not in available()]
        if unknown:
            raise ValueError(f"unknown retriever(s) {unknown} in ablation; available: {', '.join(available())}")
        options["retriever"] = value
    elif key in COUNTS and has_value:
        try:
            options[COUNTS[key]] = int(value)
        except ValueError:
            raise ValueError(f"ablation {part!r}: {key} takes a whole number") from None
    elif part.removeprefix("no_") in SWITCHES:
        options[SWITCHES[part.removeprefix("no_")]] = not part.startswith("no_")
    else:
        raise ValueError(f"unknown ablation {part!r}; known: {KNOWN}")


def parse(spec: str) -> Ablation:
    """``spec`` as an ablation; ``ValueError`` naming the known switches when it is not one."""
    options: dict[str, Any] = {}
    batch = engine = None
    for part in (p.strip() for p in spec.split(",")):
        if part == "no_batching":
            batch = 1
        elif part.startswith("engine="):
            engine = part.removeprefix("engine=")
            if engine not in ENGINES:
                raise ValueError(f"ablation {part!r}: the engines are {', '.join(ENGINES)}")
        else:
            _switch(part, options)
    try:
        query_options = QueryOptions(**options)
    except ValidationError as exc:
        raise ValueError(f"ablation {spec!r}: {exc.errors()[0]['msg']}") from None
    return Ablation(spec.strip(), query_options, batch, engine)


def parse_all(specs: tuple[str, ...] | list[str]) -> list[Ablation]:
    """Each spec once, in the order given."""
    return [parse(s) for s in dict.fromkeys(s.strip() for s in specs)]
