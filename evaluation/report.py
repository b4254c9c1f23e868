"""Aggregate the scored rows into results, and write them as ``report.md`` with PNG plots (matplotlib, Agg)."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from evaluation.metrics import mean

Row = dict[str, Any]
_SCRIPTED_NOTE = (
    "**The LLM was scripted (rule-based stand-ins):** these numbers test the harness, they measure nothing about "
    "answer or memory quality."
)


def _r(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def _recall_keys(dicts: Iterable[dict[str, Any]]) -> list[str]:
    """``recall@k`` (and ``triple_recall@k``) keys, k ascending."""
    keys = {k for d in dicts for k in d if "recall@" in k}
    return sorted(keys, key=lambda k: (k.split("@")[0], int(k.split("@")[1])))


def _recalls(rows: list[Row]) -> dict[str, float | None]:
    keys = _recall_keys(rows)
    return {k: _r(mean(r.get(k) for r in rows)) for k in keys}


#: what a skipped row's reason means, for the report
SKIP_REASONS = {
    "does_not_fit": "the user's whole raw memory does not fit the model's context window (never sent truncated)",
    "simple_engine_ignores_options": "the simple QA engine has no plan, clue-queries, traversal or episodic "
    "switch, so this ablation would change nothing (run it with --engine planning)",
}


def _answers(all_rows: list[Row]) -> dict[str, Any]:
    rows = [r for r in all_rows if not r.get("skipped")]  # a skipped question has no answer to score
    judged = [r["judge"] for r in rows if r.get("judge") is not None]
    n = len(rows)
    prompts = [r["prompt_tokens"] for r in all_rows if r.get("prompt_tokens") is not None]
    stage_names = sorted({s for r in rows for s in r.get("stages_ms", {})})
    return {
        "n": n,
        "f1": _r(mean(r["f1"] for r in rows)),
        "em": _r(mean(r["em"] for r in rows)),
        "judge_accuracy": _r(sum(judged) / len(judged)) if judged else None,
        "judged": len(judged),
        "judge_failed": sum(1 for r in rows if "judge" in r and r["judge"] is None),
        "no_answer_rate": _r(sum(r["no_answer"] for r in rows) / n) if n else None,
        "errors": sum(1 for r in rows if r["status"] == "error"),
        "seconds_per_question": _r(mean(r["seconds"] for r in rows), 2),
        "llm_per_question": {
            k: _r(mean(r["llm"].get(k) for r in rows), 2)
            for k in ("calls", "cached", "tokens_in", "tokens_out", "tokens_cached", "seconds")
        },
        "stage_ms": {s: _r(mean(r["stages_ms"].get(s) for r in rows), 1) for s in stage_names},
        "skipped": dict(Counter(r["skipped"] for r in all_rows if r.get("skipped"))),
        "prompt_tokens": {"min": min(prompts), "max": max(prompts)} if prompts else None,
        "available_tokens": next((r["available_tokens"] for r in all_rows if "available_tokens" in r), None),
        **_recalls(rows),
    }


def _grouped(rows: Iterable[Row], kind: str, score: Any) -> dict[str, Any]:
    by_mode: dict[str, list[Row]] = defaultdict(list)
    for row in rows:
        if row["kind"] == kind:
            by_mode[row["mode"]].append(row)
    out: dict[str, Any] = {}
    for mode, mode_rows in by_mode.items():
        by_category: dict[str, list[Row]] = defaultdict(list)
        for row in mode_rows:
            by_category[row["category"]].append(row)
        out[mode] = {"all": score(mode_rows), "by_category": {c: score(r) for c, r in sorted(by_category.items())}}
    return out


def _retention(rows: list[Row]) -> dict[str, Any]:
    judged = [r["judge"] for r in rows if r.get("judge") is not None]
    return {"n": len(rows), "retained": _r(sum(judged) / len(judged)) if judged else None, "judged": len(judged)}


#: the temporal questions' date scores (``evaluation.temporal.dated``), in report order
DATE_KEYS = ("date_evidence", "date_evidence_t_valid", "date_t_valid", "date_text")


def _dates(rows: list[Row]) -> dict[str, Any]:
    """How many of the questions whose answer names a date have it in their context, each way it is scored."""
    dated = [r for r in rows if "date_t_valid" in r]
    if not dated:
        return {}
    return {"dated_n": len(dated), **{k: sum(bool(r.get(k)) for r in dated) for k in DATE_KEYS}}


def _retrieval(rows: list[Row]) -> dict[str, Any]:
    return {"n": len(rows), **_recalls(rows), "ms": _r(mean(r["ms"] for r in rows), 1), **_dates(rows)}


def summarize(rows: Iterable[Row]) -> dict[str, Any]:
    rows = list(rows)
    return {
        "retrieval": _grouped(rows, "retrieval", _retrieval),
        "answers": _grouped(rows, "answer", _answers),
        "retention": _grouped(rows, "retention", _retention),
    }


def _table(header: list[str], lines: list[list[Any]]) -> str:
    def cell(v: Any) -> str:
        return "–" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))

    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(cell(v) for v in line) + " |" for line in lines]
    return "\n".join(out)


def _plot_bars(path: Path, title: str, groups: dict[str, dict[str, float | None]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = sorted({k for g in groups.values() for k in g})
    fig, ax = plt.subplots(figsize=(max(5.0, 1.4 * len(groups) * max(1, len(series)) / 2), 3.6))
    width = 0.8 / max(1, len(series))
    for n, name in enumerate(series):
        xs = [i + n * width for i in range(len(groups))]
        ax.bar(xs, [g.get(name) or 0.0 for g in groups.values()], width, label=name)
    ax.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(groups))], list(groups), fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(folder: Path, results: dict[str, Any]) -> Path:
    run = results["run"]
    lines = [f"# memstream eval: {run['dataset']}", ""]
    if run["llm"] == "scripted":
        lines += [_SCRIPTED_NOTE, ""]
    lines += [
        f"- data: `{run['data']}`; {run['events']} events memorized, {run['questions']} questions; "
        f"{run['answered_sample']} answered end to end (seed {run['seed']})",
        f"- model: {run['llm']} `{run['model']}`; judge: `{run['judge_model']}`; QA engine: {run['qa_engine']}; "
        f"embedder: {run['embedder']}; retrieval budget {run['budget']} triplets",
        f"- machine: {run['machine']}; finished {run['finished_at']}",
        "",
        "## Memory build",
        "",
    ]
    builds = {"memory": results["ingest"]} | {f"memory[{k}]": v for k, v in results.get("ingest_ablations", {}).items()}
    head = ["memory", "batch", "events", "memorized", "dead letters", "wall s", "LLM calls/msg", "tokens in/msg"]
    lines += [
        _table(
            [*head, "tokens out/msg", "LLM s/msg"],
            [
                [
                    name,
                    ingest.get("batch"),
                    ingest["events"],
                    ingest["memorized"],
                    ingest["dead_letters"],
                    ingest["wall_s"],
                    *(ingest.get("per_message", {}).get(k) for k in ("calls", "tokens_in", "tokens_out", "seconds")),
                ]
                for name, ingest in builds.items()
            ],
        ),
        "",
        *(
            f"- {name}: model calls per message by task: "
            + ", ".join(f"{task} {n}" for task, n in ingest["calls_per_message_by_task"].items())
            for name, ingest in builds.items()
            if ingest.get("calls_per_message_by_task")
        ),
        "",
    ]
    retrieval = results["retrieval"]
    if retrieval:
        keys = _recall_keys(m["all"] for m in retrieval.values())
        lines += ["## Retrieval (no LLM; seeds from the question by the system's matcher)", ""]
        lines += [
            _table(
                ["retriever", "n", *keys, "ms"],
                [[m, v["all"]["n"], *(v["all"].get(k) for k in keys), v["all"]["ms"]] for m, v in retrieval.items()],
            ),
            "",
        ]
        first = "recall@10" if "recall@10" in keys else (keys[-1] if keys else None)
        if first:
            cats = sorted({c for v in retrieval.values() for c in v["by_category"]})
            lines += [f"{first} by category:", ""]
            lines += [
                _table(
                    ["retriever", *cats],
                    [[m, *(v["by_category"].get(c, {}).get(first) for c in cats)] for m, v in retrieval.items()],
                ),
                "",
            ]
            _plot_bars(
                folder / "retrieval.png",
                "evidence recall@k",
                {m: {k: v["all"].get(k) for k in keys} for m, v in retrieval.items()},
            )
            lines += ["![retrieval](retrieval.png)", ""]
        dated = {m: v["all"] for m, v in retrieval.items() if v["all"].get("dated_n")}
        if dated:
            lines += [
                "Temporal questions whose answer names a date: how many contexts carry it (`evaluation/temporal.py`):"
                " a thesis or message of an evidence turn with the date (by its `t_valid` or its words; by `t_valid`"
                " alone), and any item with the date by `t_valid` or by its words.",
                "",
                _table(
                    ["retriever", "questions", "evidence", "evidence by t_valid", "any by t_valid", "any by words"],
                    [[m, v["dated_n"], *(v[k] for k in DATE_KEYS)] for m, v in dated.items()],
                ),
                "",
            ]
    answers = results["answers"]
    if answers:
        lines += _answer_section(folder, answers, run.get("ablations", {}))
    retention = results["retention"]
    if retention:
        lines += ["## Retention (MINE: the share of gold facts the judge finds in what memory returns)", ""]
        lines += [
            _table(
                ["retriever", "facts", "judged", "retained"],
                [[m, v["all"]["n"], v["all"]["judged"], v["all"]["retained"]] for m, v in retention.items()],
            ),
            "",
        ]
        _plot_bars(
            folder / "retention.png",
            "MINE retention",
            {m: {"retained": v["all"]["retained"]} for m, v in retention.items()},
        )
        lines += ["![retention](retention.png)", ""]
    lines += [
        "Per-question rows (answers, contexts, the judge's reasons): `rows.jsonl`; all numbers: `results.json`.",
        "",
    ]
    path = folder / "report.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


#: the cost of a mode's question counts its cache hits at what they cost when made: the modes of one run share the
#: cache, and whichever ran first would otherwise look dear and the others free
_ANSWER_HEAD = ["F1", "EM", "judge", "no answer", "LLM calls/q", "tokens/q"]


def _answer_cells(a: dict[str, Any], recalls: list[str]) -> list[Any]:
    """One mode's (or one category's) scores: the answer context's recall@k, F1, EM, judge accuracy, the no-answer
    rate and the cost per question."""
    llm = a["llm_per_question"]
    calls = None if llm["calls"] is None else llm["calls"] + (llm["cached"] or 0)
    tokens = (
        None if llm["tokens_in"] is None else sum(llm[k] or 0 for k in ("tokens_in", "tokens_out", "tokens_cached"))
    )
    cells = [a["f1"], a["em"], a["judge_accuracy"], a["no_answer_rate"], calls, tokens]
    return [*(a.get(k) for k in recalls), *cells]


def _skip_note(mode: str, a: dict[str, Any]) -> list[str]:
    out = []
    for reason, count in a["skipped"].items():
        line = f"- `{mode}`: {count} question(s) skipped, {reason}: {SKIP_REASONS.get(reason, reason)}"
        if reason == "does_not_fit" and a["prompt_tokens"]:
            tokens = a["prompt_tokens"]
            line += (
                f"; its prompts need about {tokens['min']}–{tokens['max']} tokens (estimate: characters / 3) and "
                f"{a['available_tokens']} are available (llm_context less the answer's room)"
            )
        out.append(line)
    return out


def _answer_section(folder: Path, answers: dict[str, Any], ablations: dict[str, Any]) -> list[str]:
    """The baselines and every ablation side by side, overall and per category, and which were skipped and why."""
    recalls = [k for k in _recall_keys(v["all"] for v in answers.values()) if k in ("recall@5", "recall@10")]
    lines = ["## Answers end to end", ""]
    if ablations:
        lines += ["Ablations (variants of `memory`, same run, same LLM cache):", ""]
        lines += [f"- `{mode}`: {json.dumps(switches)}" for mode, switches in ablations.items()]
        lines += [""]
    head = ["mode", "n", "skipped", *recalls, *_ANSWER_HEAD, "errors", "s/question"]
    rows = [
        [m, a["n"], sum(a["skipped"].values()), *_answer_cells(a, recalls), a["errors"], a["seconds_per_question"]]
        for m, v in answers.items()
        for a in [v["all"]]
    ]
    lines += [_table(head, rows), ""]
    lines += ["Recall is of the answer's own context (none for the modes that retrieve nothing).", ""]
    notes = [line for m, v in answers.items() for line in _skip_note(m, v["all"])]
    lines += ["Skipped (recorded in rows.jsonl, never scored):", "", *notes, ""] if notes else ["Skipped: none.", ""]
    lines += ["By category:", ""]
    lines += [
        _table(
            ["mode", "category", "n", *recalls, *_ANSWER_HEAD],
            [
                [m, c, a["n"], *_answer_cells(a, recalls)]
                for m, v in answers.items()
                for c, a in v["by_category"].items()
                if a["n"]
            ],
        ),
        "",
    ]
    stages = {m: v["all"]["stage_ms"] for m, v in answers.items() if v["all"]["stage_ms"]}
    if stages:
        names = sorted({s for st in stages.values() for s in st})
        lines += [
            "Stage latencies (mean ms per question):",
            "",
            _table(["mode", *names], [[m, *(st.get(s) for s in names)] for m, st in stages.items()]),
            "",
        ]
    scored = {
        m: {"F1": v["all"]["f1"], "EM": v["all"]["em"], "judge": v["all"]["judge_accuracy"]}
        for m, v in answers.items()
        if v["all"]["n"]
    }
    if not scored:  # every mode skipped: nothing to plot
        return lines
    _plot_bars(folder / "answers.png", "answers", scored)
    return [*lines, "![answers](answers.png)", ""]
