"""Aggregate the scored rows into results, and write them as ``report.md`` with PNG plots (matplotlib, Agg)."""

from __future__ import annotations

from collections import defaultdict
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


def _answers(rows: list[Row]) -> dict[str, Any]:
    judged = [r["judge"] for r in rows if r.get("judge") is not None]
    n = len(rows)
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
            k: _r(mean(r["llm"][k] for r in rows), 2) for k in ("calls", "cached", "tokens_in", "tokens_out", "seconds")
        },
        "stage_ms": {s: _r(mean(r["stages_ms"].get(s) for r in rows), 1) for s in stage_names},
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


def summarize(rows: Iterable[Row]) -> dict[str, Any]:
    rows = list(rows)
    return {
        "retrieval": _grouped(
            rows, "retrieval", lambda rs: {"n": len(rs), **_recalls(rs), "ms": _r(mean(r["ms"] for r in rs), 1)}
        ),
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
    ingest = results["ingest"]
    per = ingest.get("per_message", {})
    lines += [
        _table(
            [
                "events",
                "memorized",
                "dead letters",
                "wall s",
                "LLM calls/msg",
                "tokens in/msg",
                "tokens out/msg",
                "LLM s/msg",
            ],
            [
                [
                    ingest["events"],
                    ingest["memorized"],
                    ingest["dead_letters"],
                    ingest["wall_s"],
                    per.get("calls"),
                    per.get("tokens_in"),
                    per.get("tokens_out"),
                    per.get("seconds"),
                ]
            ],
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
    answers = results["answers"]
    if answers:
        lines += ["## Answers end to end", ""]
        head = ["mode", "n", "F1", "EM", "judge", "no answer", "errors", "s/question", "LLM calls/q", "tokens/q"]
        lines += [
            _table(
                head,
                [
                    [
                        m,
                        a["n"],
                        a["f1"],
                        a["em"],
                        a["judge_accuracy"],
                        a["no_answer_rate"],
                        a["errors"],
                        a["seconds_per_question"],
                        a["llm_per_question"]["calls"],
                        (a["llm_per_question"]["tokens_in"] or 0) + (a["llm_per_question"]["tokens_out"] or 0),
                    ]
                    for m, v in answers.items()
                    for a in [v["all"]]
                ],
            ),
            "",
        ]
        cats = sorted({c for v in answers.values() for c in v["by_category"]})
        lines += ["Judge accuracy (F1 where not judged) by category:", ""]
        lines += [
            _table(["mode", *cats], [[m, *(_best(v["by_category"].get(c)) for c in cats)] for m, v in answers.items()]),
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
        _plot_bars(
            folder / "answers.png",
            "answers",
            {
                m: {"F1": v["all"]["f1"], "EM": v["all"]["em"], "judge": v["all"]["judge_accuracy"]}
                for m, v in answers.items()
            },
        )
        lines += ["![answers](answers.png)", ""]
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


def _best(scores: dict[str, Any] | None) -> float | None:
    if not scores:
        return None
    return scores["judge_accuracy"] if scores["judge_accuracy"] is not None else scores["f1"]
