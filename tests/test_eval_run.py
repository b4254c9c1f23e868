"""`memstream eval` end to end with the scripted LLM: results JSON, a Markdown report with plots, and a rerun that
makes no new LLM call (rows resumed; with the rows gone, every call answered by the LLM cache).

The scripted LLM's scores test the harness only; nothing here asserts a quality number."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from evaluation import datasets
from evaluation.ablations import SWITCHES, parse
from evaluation.baselines import FullContext
from evaluation.run import RETRIEVERS, EvalConfig, evaluate, sample_questions
from memstream.cli import app
from schemas.events import Answer, Query, QueryOptions
from services.llm.scripted import ScriptedLLM
from services.ports import Stores
from services.qa.simple import AnswerInput, AnswerTask, SimpleQA
from services.settings import Settings
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
    assert summary["ingest"]["calls_per_message_by_task"]["extract"] > 0  # the checks after it counted apart
    assert set(summary["answers"]) == {"memory", "flat_rag", "full_context", "no_retrieval"}
    assert set(summary["retrieval"]) == {*RETRIEVERS, "raw_flat"} and "flat+episodic" in RETRIEVERS
    memory = summary["answers"]["memory"]["all"]
    assert memory["n"] == 3 and memory["judged"] == 3 and memory["llm_per_question"]["calls"] >= 1
    assert {"traversal", "combine"} <= set(memory["stage_ms"])
    assert set(summary["retrieval"]["flat"]["by_category"]) == {"single-hop", "temporal"}
    rows = [json.loads(line) for line in (results / "rows.jsonl").read_text().splitlines()]
    answered = [r for r in rows if r["kind"] == "answer"]
    assert len(answered) == 12 and all(r["judge_reason"] for r in answered)
    assert len([r for r in rows if r["kind"] == "retrieval"]) == 3 * 7  # 3 questions, 6 retrievers and the raw index

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


def test_an_unanswerable_question_is_right_only_when_no_answer_is_given(tmp_path: Path) -> None:
    # the judge's rubric marks "there is no answer" wrong: an adversarial question is scored by the harness instead
    data = write(tmp_path, "tiny.json", TINY_LOCOMO)
    results = tmp_path / "results"
    args = ("locomo", "--data", str(data), "--llm", "scripted", "--results", str(results), "--adversarial")
    run_cli(*args, "--mode", "memory", "--mode", "no_retrieval")
    rows = [json.loads(line) for line in (results / "rows.jsonl").read_text().splitlines()]
    adversarial = {r["mode"]: r for r in rows if r["kind"] == "answer" and r["category"] == "adversarial"}
    assert set(adversarial) == {"memory", "no_retrieval"}
    assert adversarial["no_retrieval"]["judge"] is True and adversarial["no_retrieval"]["no_answer"] is True
    for row in adversarial.values():
        assert row["judge"] is row["no_answer"] and row["judge_reason"].startswith("unanswerable")
        assert "judge_llm" not in row  # no judge call
    others = [r for r in rows if r["kind"] == "answer" and r["category"] != "adversarial"]
    assert others and all("judge_llm" in r for r in others)


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


def test_a_run_with_the_judge_judges_the_answers_a_run_without_it_kept(tmp_path: Path) -> None:
    data = write(tmp_path, "tiny.json", TINY_LOCOMO)
    results = tmp_path / "results"
    args = ("locomo", "--data", str(data), "--llm", "scripted", "--results", str(results), "--mode", "memory")
    run_cli(*args, "--no-judge")
    unjudged = {r["key"]: r for r in _rows(results) if r["kind"] == "answer"}
    assert len(unjudged) == 3 and not any("judge" in r for r in unjudged.values())

    judged = run_cli(*args)
    assert judged["calls"] == 3  # one verdict a question, no answer asked again
    rows = {r["key"]: r for r in _rows(results) if r["kind"] == "answer"}
    assert rows.keys() == unjudged.keys()
    for key, row in rows.items():
        assert row["judge"] in (True, False) and row["judge_reason"] and row["judge_llm"]["calls"] == 1
        assert {k: v for k, v in row.items() if not k.startswith("judge")} == unjudged[key]  # the answer as it was
    summary = json.loads((results / "results.json").read_text())
    assert summary["answers"]["memory"]["all"]["judged"] == 3
    assert run_cli(*args)["calls"] == 0  # judged once


def test_retrieval_only_makes_no_answer_call(tmp_path: Path) -> None:
    data = write(tmp_path, "tiny.json", TINY_LOCOMO)
    args = ("locomo", "--data", str(data), "--llm", "scripted", "--results", str(tmp_path / "r"), "--no-answers")
    run_cli(*args)
    summary = json.loads((tmp_path / "r" / "results.json").read_text())
    assert summary["answers"] == {} and summary["retrieval"]["beamsearch"]["all"]["n"] == 3
    assert set(summary["run"]["this_run_llm"]["memorize"]) and "answers" not in summary["run"]["this_run_llm"]
    # the one temporal question ("When did Alice adopt Rex?" -> 8 May 2023, said that day) is scored for its date:
    # the raw turn of that day is in the flat index's context
    raw = summary["retrieval"]["raw_flat"]["all"]
    assert raw["dated_n"] == 1 and raw["date_evidence"] == 1 and raw["date_t_valid"] == 1
    rows = [json.loads(line) for line in (tmp_path / "r" / "rows.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows if "date_t_valid" in r and r["mode"] == "raw_flat"] == ["conv-t:q2"]
    assert "Temporal questions whose answer names a date" in (tmp_path / "r" / "report.md").read_text()


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
    assert results["retention"]["flat"]["all"] == {"n": 2, "retained": 0.5, "judged": 2}  # theses, not the essay
    assert (tmp_path / "r" / "retention.png").exists()


def _rows(results: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (results / "rows.jsonl").read_text().splitlines()]


def test_ablations_and_full_context_are_modes_of_one_run(tmp_path: Path) -> None:
    data = write(tmp_path, "tiny.json", TINY_LOCOMO)
    results = tmp_path / "results"
    args = ["locomo", "--data", str(data), "--llm", "scripted", "--results", str(results)]
    args += ["--mode", "memory", "--mode", "full_context", "--ablation", "no_batching", "--ablation", "clues=2"]
    run_cli(*args)

    answered = [r for r in _rows(results) if r["kind"] == "answer"]
    by_mode = {m: [r for r in answered if r["mode"] == m] for m in {r["mode"] for r in answered}}
    assert set(by_mode) == {"memory", "full_context", "memory[no_batching]", "memory[clues=2]"}
    assert all(len(rows) == 3 for rows in by_mode.values())
    # the batch-1 memory is scored like memory: F1, judge, recall of its own context
    assert all("f1" in r and r["judge_reason"] and "recall@10" in r for r in by_mode["memory[no_batching]"])
    # the scripted run's engine is the simple QA, which has no clue-queries: stated, never scored as a result
    assert {r.get("skipped") for r in by_mode["memory[clues=2]"]} == {"simple_engine_ignores_options"}
    assert all("f1" not in r for r in by_mode["memory[clues=2]"])
    assert all(not r.get("skipped") and r["prompt_tokens"] > 0 for r in by_mode["full_context"])

    # batching off has its own memory and cost record: one extraction call per message, against one per batch
    assert (results / "memory-batch1.sqlite3").exists()
    batched = json.loads((results / "ingest.json").read_text())["per_message"]["calls"]
    single = json.loads((results / "ingest-batch1.json").read_text())["per_message"]["calls"]
    assert batched < 1.0 <= single
    summary = json.loads((results / "results.json").read_text())
    assert summary["ingest_ablations"]["batch=1"]["batch"] == 1 and summary["ingest"]["batch"] == 8
    assert {"beamsearch", "beamsearch[batch=1]"} <= set(summary["retrieval"])
    assert summary["answers"]["memory[clues=2]"]["all"]["skipped"] == {"simple_engine_ignores_options": 3}
    assert summary["run"]["ablations"] == {
        "memory[no_batching]": {"batch": 1},
        "memory[clues=2]": {"max_clue_queries": 2},
    }

    report = (results / "report.md").read_text()
    for mode in by_mode:
        assert f"| {mode} |" in report
    assert "| memory[batch=1] | 1 |" in report  # the build table
    assert "`memory[clues=2]`: 3 question(s) skipped, simple_engine_ignores_options" in report

    assert run_cli(*args)["calls"] == 0  # resumed: both memories built, every row there


def test_a_scripted_run_answers_with_the_fast_engine_and_counts_its_calls(tmp_path: Path) -> None:
    """The real fast engine in the harness (the rule-based stand-in answers its two tasks): each row has its answer
    and the calls it cost, at most four: the named lines', the chain's second call, one planning round's two."""
    data = write(tmp_path, "tiny.json", TINY_LOCOMO)
    results = tmp_path / "results"
    run_cli("locomo", "--data", str(data), "--llm", "scripted", "--engine", "fast", "--results", str(results),
            "--mode", "memory", "--no-judge")  # fmt: skip
    rows = [r for r in _rows(results) if r["kind"] == "answer"]
    assert len(rows) == 3 and all(r["status"] != "error" for r in rows)
    assert all(1 <= r["llm"]["calls"] + r["llm"]["cached"] <= 4 for r in rows)
    assert any(r["status"] == "answered" and r["stages_ms"].keys() >= {"summarise", "sufficiency"} for r in rows)
    assert json.loads((results / "results.json").read_text())["run"]["qa_engine"] == "fast"


def spy_on_engines(monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], dict[str, tuple[str, QueryOptions]]]:
    """The harness's engines replaced by simple ones that record it: the engine names built, and per mode the
    engine and options that answered it."""
    import evaluation.run as run

    built: list[str] = []
    answered: dict[str, tuple[str, QueryOptions]] = {}

    def spy_engine(settings: Settings, stores: Stores, embedder: Any, llm: Any) -> Any:
        built.append(settings.qa_engine)
        simple = SimpleQA(stores.graph, stores.vectors, embedder, llm)
        engine = settings.qa_engine

        class Spy:
            async def answer(self, query: Query, emit: Any = None, on_text: Any = None) -> Answer:
                answered[query.event_id.split(":")[1]] = (engine, query.options)
                return await simple.answer(query, emit, on_text)

        return Spy()

    monkeypatch.setattr(run, "build_engine", spy_engine)
    return built, answered


async def test_ablation_switches_reach_the_one_engine_as_query_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the planning engine the options ride on each query; the engine is built once per memory."""
    built, answered = spy_on_engines(monkeypatch)
    config = EvalConfig(
        dataset="locomo",
        results=tmp_path / "r",
        data=write(tmp_path, "tiny.json", TINY_LOCOMO),
        llm="scripted",
        engine="planning",
        modes=("memory",),
        ablations=("no_enhancement", "flat,no_episodic", "clues=2"),
        questions=1,
        judge=False,
        progress=False,
    )
    results = await evaluate(config)
    assert built == ["planning"]
    assert {mode: options for mode, (_, options) in answered.items()} == {
        "memory": QueryOptions(),
        "memory_no_enhancement_": QueryOptions(plan_enhancement=False),
        "memory_flat_no_episodic_": QueryOptions(retriever="flat", episodic_context=False),
        "memory_clues=2_": QueryOptions(max_clue_queries=2),
    }
    assert all(results["answers"][m]["all"]["n"] == 1 for m in ("memory[no_enhancement]", "memory[clues=2]"))


async def test_engines_answer_side_by_side_in_one_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``engine=NAME`` answers the same questions with another engine over the same memory: one engine built per
    name, each mode its own rows; a switch given with it reaches that engine as the query's option."""
    built, answered = spy_on_engines(monkeypatch)
    config = EvalConfig(
        dataset="locomo",
        results=tmp_path / "r",
        data=write(tmp_path, "tiny.json", TINY_LOCOMO),
        llm="scripted",
        engine="fast",
        modes=("memory",),
        ablations=("engine=planning", "engine=planning,no_enhancement", "engine=fast,steps=2"),
        questions=1,
        judge=False,
        progress=False,
    )
    results = await evaluate(config)
    assert built == ["fast", "planning"]
    assert answered == {
        "memory": ("fast", QueryOptions()),
        "memory_engine=planning_": ("planning", QueryOptions()),
        "memory_engine=planning_no_enhancement_": ("planning", QueryOptions(plan_enhancement=False)),
        "memory_engine=fast_steps=2_": ("fast", QueryOptions(max_steps=2)),
    }
    assert results["run"]["ablations"]["memory[engine=planning]"] == {"engine": "planning"}
    assert all(results["answers"][m]["all"]["n"] == 1 for m in ("memory", "memory[engine=planning]"))
    with pytest.raises(ValueError, match="engines are"):
        parse("engine=nope")


def test_full_context_sends_every_turn_with_speaker_and_date_when_it_fits(tmp_path: Path) -> None:
    events = datasets.load("locomo", tmp_path, write(tmp_path, "tiny.json", TINY_LOCOMO)).events
    full = FullContext(ScriptedLLM(), events, context_tokens=8192)
    query = Query(event_id="q", user_id=events[0].user_id, event_time=events[0].event_time, question="Where?")
    lines = [v.context for v in full.memory(query)]
    assert lines[0] == "[2023-05-08] Alice: I adopted a dog named Rex at the Portland shelter."
    assert len(lines) == 4 and full.fits(query)
    text = sum(len(m.content) for m in full.task.messages(AnswerInput("Where?", full.memory(query))))
    assert full.prompt_tokens(query) >= text / 3  # the estimate over-counts, never under
    assert not FullContext(ScriptedLLM(), events, context_tokens=full.prompt_tokens(query)).fits(query)


async def test_full_context_that_does_not_fit_is_skipped_with_its_token_estimate(tmp_path: Path) -> None:
    long = copy.deepcopy(TINY_LOCOMO)
    turn = "I talked at length about the garden, the weather and the neighbours' new fence. " * 12
    long[0]["conversation"]["session_2"] += [
        {"speaker": "Bob", "dia_id": f"D2:{n}", "text": f"{n}: {turn}"} for n in range(3, 33)
    ]
    config = EvalConfig(
        dataset="locomo",
        results=tmp_path / "r",
        data=write(tmp_path, "long.json", long),
        llm="scripted",
        modes=("full_context",),
        retrievers=("flat",),
        progress=False,
    )
    results = await evaluate(config)
    rows = [r for r in _rows(tmp_path / "r") if r["kind"] == "answer"]
    assert len(rows) == 3 and {r["skipped"] for r in rows} == {"does_not_fit"}
    assert all(r["prompt_tokens"] > r["available_tokens"] == 8192 - AnswerTask.max_tokens for r in rows)
    assert results["run"]["this_run_llm"]["answers"]["calls"] == 0  # nothing cut and sent instead
    assert results["answers"]["full_context"]["all"]["n"] == 0
    report = (tmp_path / "r" / "report.md").read_text()
    assert "`full_context`: 3 question(s) skipped, does_not_fit" in report and "are available" in report


def test_ablation_specs_parse_and_misspelt_ones_are_refused(tmp_path: Path) -> None:
    combined = parse("no_enhancement,clues=2")
    assert combined.mode == "memory[no_enhancement,clues=2]" and combined.batch is None
    assert combined.options == QueryOptions(plan_enhancement=False, max_clue_queries=2)
    assert parse("no_batching").batch == 1 and parse("retriever=beamsearch+flat").options.retriever == "beamsearch+flat"
    assert parse("top_k=6").options == QueryOptions(filter_top_k=6)
    assert parse("no_inference").options == QueryOptions(infer_answers=False)
    assert parse("no_near_matches").options == QueryOptions(near_match_clues=False)
    assert parse("rounds=2").options == QueryOptions(max_rounds=2)
    for bad in ("clues=9", "clues=two", "bogus", "retriever=nope", "top_k=0", "rounds=5"):
        with pytest.raises(ValueError):
            parse(bad)
    with pytest.raises(ValueError) as refused:  # the refusal lists every switch, with the bounds the query has
        parse("bogus")
    assert all(f"no_{name}, {name}" in str(refused.value) for name in SWITCHES)
    assert "rounds=0..4" in str(refused.value) and "clues=1..8" in str(refused.value)
    data = write(tmp_path, "tiny.json", TINY_LOCOMO)
    args = ["eval", "locomo", "--data", str(data), "--llm", "scripted", "--results", str(tmp_path / "r")]
    result = CliRunner().invoke(app, [*args, "--ablation", "x"])
    assert result.exit_code != 0 and "unknown ablation" in result.output
    assert not (tmp_path / "r").exists()  # refused before anything was memorized


def test_a_sample_per_category_draws_n_of_each_in_dataset_order() -> None:
    questions = [
        datasets.EvalQuestion(id=f"q{i}", user_id="u", text=f"question {i}", answers=["a"], category=category)
        for i, category in enumerate(["single-hop"] * 6 + ["temporal"] * 5 + ["multi-hop"] * 1)
    ]
    picked = sample_questions(questions, 2, seed=3, per_category=True)
    counts = {c: sum(q.category == c for q in picked) for c in ("single-hop", "temporal", "multi-hop")}
    assert counts == {"single-hop": 2, "temporal": 2, "multi-hop": 1}  # a category with fewer gives all it has
    assert [q.id for q in picked] == sorted((q.id for q in picked), key=lambda i: int(i[1:]))
    assert picked == sample_questions(questions, 2, seed=3, per_category=True)  # the seed decides
    assert len(sample_questions(questions, 2, seed=3)) == 2  # in all, as before
    assert sample_questions(questions, None, seed=3, per_category=True) == questions
