"""`memstream eval` end to end with the scripted LLM: results JSON, a Markdown report with plots, and a rerun that
makes no new LLM call (rows resumed; with the rows gone, every call answered by the LLM cache).

The scripted LLM's scores test the harness only; nothing here asserts a quality number."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from evaluation.run import EvalConfig, evaluate
from memstream.cli import app
from tests.test_eval_datasets import TINY_LOCOMO, write


def run_cli(*args: str) -> dict[str, Any]:
    result = CliRunner().invoke(app, ["eval", *args, "--no-progress"])
    assert result.exit_code == 0, result.output
    line = [x for x in result.output.splitlines() if x.startswith("{")][-1]
    calls: dict[str, Any] = json.loads(line)["this_run_llm"]
    return calls


@pytest.fixture(autouse=True)
def _no_env_llm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MEMSTREAM_SCRIPTED_LLM", raising=False)
    monkeypatch.delenv("MEMSTREAM_QA_ENGINE", raising=False)


def test_eval_locomo_writes_results_and_report_and_a_rerun_calls_no_model(tmp_path: Path) -> None:
    data = write(tmp_path, "tiny.json", TINY_LOCOMO)
    results = tmp_path / "results"
    args = ("locomo", "--data", str(data), "--llm", "scripted", "--results", str(results))
    first = run_cli(*args)
    assert first["calls"] > 0

    summary = json.loads((results / "results.json").read_text())
    assert summary["run"]["model"] == "scripted-rules" and summary["run"]["machine"]
    assert summary["ingest"]["memorized"] == 4 and summary["ingest"]["per_message"]["calls"] > 0
    assert set(summary["answers"]) == {"memory", "flat_rag", "full_context", "no_retrieval"}
    assert set(summary["retrieval"]) == {"beamsearch", "flat", "mixture", "raw_flat"}
    memory = summary["answers"]["memory"]["all"]
    assert memory["n"] == 3 and memory["judged"] == 3 and memory["llm_per_question"]["calls"] >= 1
    assert {"traversal", "combine"} <= set(memory["stage_ms"])
    assert set(summary["retrieval"]["flat"]["by_category"]) == {"single-hop", "temporal"}
    rows = [json.loads(line) for line in (results / "rows.jsonl").read_text().splitlines()]
    answered = [r for r in rows if r["kind"] == "answer"]
    assert len(answered) == 12 and all(r["judge_reason"] for r in answered)
    assert len([r for r in rows if r["kind"] == "retrieval"]) == 3 * 4

    report = (results / "report.md").read_text()
    assert "scripted" in report and "measure nothing" in report  # never presented as quality
    assert "scripted-rules" in report and "CPU cores" in report
    assert "![retrieval](retrieval.png)" in report
    assert (results / "retrieval.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (results / "answers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # resumed: memory built, every row scored, nothing asked again
    again = run_cli(*args)
    assert again["calls"] == 0 and again["cached"] == 0
    assert len((results / "rows.jsonl").read_text().splitlines()) == len(rows)
    # the rows gone (a new ablation): answers and verdicts come from the LLM cache, extraction is not redone
    (results / "rows.jsonl").unlink()
    cached = run_cli(*args)
    assert cached["calls"] == 0 and cached["cached"] > 0
    again_summary = json.loads((results / "results.json").read_text())
    assert again_summary["answers"]["memory"]["all"]["f1"] == memory["f1"]
    assert again_summary["ingest"]["per_message"] == summary["ingest"]["per_message"]  # the build's cost is kept


def test_a_row_cut_by_a_crash_is_scored_again(tmp_path: Path) -> None:
    data = write(tmp_path, "tiny.json", TINY_LOCOMO)
    results = tmp_path / "results"
    args = ("locomo", "--data", str(data), "--llm", "scripted", "--results", str(results), "--mode", "memory")
    run_cli(*args)
    lines = (results / "rows.jsonl").read_text().splitlines()
    (results / "rows.jsonl").write_text("\n".join(lines[:-1]) + "\n" + lines[-1][: len(lines[-1]) // 2])
    again = run_cli(*args)
    assert again["cached"] >= 1  # the cut question answered again (from the cache)
    keys = [json.loads(x)["key"] for x in (results / "rows.jsonl").read_text().splitlines()]
    assert sorted(keys) == sorted(json.loads(x)["key"] for x in lines)


def test_retrieval_only_makes_no_answer_call(tmp_path: Path) -> None:
    data = write(tmp_path, "tiny.json", TINY_LOCOMO)
    args = ("locomo", "--data", str(data), "--llm", "scripted", "--results", str(tmp_path / "r"), "--no-answers")
    run_cli(*args)
    summary = json.loads((tmp_path / "r" / "results.json").read_text())
    assert summary["answers"] == {} and summary["retrieval"]["beamsearch"]["all"]["n"] == 3
    assert set(summary["run"]["this_run_llm"]["memorize"]) and "answers" not in summary["run"]["this_run_llm"]


async def test_mine_retention_judges_each_fact_against_what_memory_returns(tmp_path: Path) -> None:
    data = {
        "essays": [{"topic": "Bees", "content": "Bees make honey in Hives.\n\nThe Queen lays eggs."}],
        "answers": [[{"answer": "Bees make honey in Hives."}, {"answer": "Penguins cannot fly."}]],
    }
    config = EvalConfig(
        dataset="mine", results=tmp_path / "r", data=write(tmp_path, "mine.json", data), llm="scripted", progress=False
    )
    results = await evaluate(config)
    rows = [json.loads(x) for x in (tmp_path / "r" / "rows.jsonl").read_text().splitlines()]
    assert [r["judge"] for r in rows] == [True, False]  # the essay's fact is retained, the foreign one not
    assert all(r["judge_reason"] and r["context"] for r in rows)
    assert results["retention"]["beamsearch"]["all"] == {"n": 2, "retained": 0.5, "judged": 2}
    assert (tmp_path / "r" / "retention.png").exists()
