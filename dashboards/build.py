"""Writes the Grafana dashboards in this folder from the panel lists below: `python dashboards/build.py`.

The JSON files are what Grafana (and the k8s ConfigMap) load; this script is their source, so a change is made
here and the files regenerated (tests/test_dashboards_prometheus.py fails when they differ). Every query reads the
metrics memstream exports (services/metrics.py, services/observability/metrics.py, the LLM layers, the gateway).
Trace-derived series (memstream_trace_*) and the lag gauge are reported alike by every gateway, so their queries
take ``max`` across instances, never ``sum``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"


@dataclass
class Panel:
    title: str
    description: str
    targets: list[tuple[str, str]]  # (PromQL, legend)
    unit: str = "short"
    kind: str = "timeseries"
    width: int = 12
    height: int = 8
    extra: dict[str, Any] = field(default_factory=dict)


def rate(metric: str, by: str, selector: str = "", agg: str = "sum") -> str:
    return f"{agg} by ({by}) (rate({metric}{selector}[{RATE}]))"


def quantile(q: float, histogram: str, by: str = "", selector: str = "", agg: str = "sum") -> str:
    labels = ", ".join(["le", *[b.strip() for b in by.split(",") if b.strip()]])
    return f"histogram_quantile({q}, {agg} by ({labels}) (rate({histogram}_bucket{selector}[{RATE}])))"


def mean(histogram: str, by: str, agg: str = "sum") -> str:
    return f"{agg} by ({by}) (rate({histogram}_sum[{RATE}])) / {agg} by ({by}) (rate({histogram}_count[{RATE}]))"


INGESTION = [
    Panel(
        "Events memorized",
        "Chat messages and documents per second, by outcome (memorized, duplicate, extraction_failed, store_failed).",
        [(rate("memstream_memorize_events_total", "kind, outcome"), "{{kind}} {{outcome}}")],
        unit="ops",
    ),
    Panel(
        "Accepted by the gateway",
        "Events the gateway validated and produced, per second.",
        [(rate("memstream_gateway_events_total", "kind"), "{{kind}}")],
        unit="ops",
    ),
    Panel(
        "Ingest to queryable",
        "From an event's arrival at memstream to its memory being committed.",
        [
            (quantile(0.5, "memstream_ingest_to_queryable_seconds"), "p50"),
            (quantile(0.95, "memstream_ingest_to_queryable_seconds"), "p95"),
        ],
        unit="s",
    ),
    Panel(
        "Messages per extraction call",
        "Micro-batching at work: how many messages share one LLM extraction call.",
        [
            (mean("memstream_memorize_batch_messages", "instance"), "mean"),
            (quantile(0.95, "memstream_memorize_batch_messages"), "p95"),
        ],
    ),
    Panel(
        "Store write latency",
        "One change set (graph and vectors) written, p95 by store.",
        [(quantile(0.95, "memstream_store_write_seconds", "store"), "{{store}} p95")],
        unit="s",
    ),
    Panel(
        "Graph changes written",
        "Vertices, edges and thesis invalidations written per second.",
        [(rate("memstream_memorize_changes_total", "what"), "{{what}}")],
        unit="ops",
    ),
    Panel(
        "Extraction failures",
        "Extraction calls whose output stayed invalid after the retries (the batch is then split).",
        [(rate("memstream_extraction_failures_total", "reason"), "{{reason}}")],
        unit="ops",
    ),
    Panel(
        "Memorized in the last hour",
        "Events committed to memory over the last hour.",
        [('sum(increase(memstream_memorize_events_total{outcome="memorized"}[1h]))', "events")],
        kind="stat",
        width=6,
        height=6,
    ),
]

QA = [
    Panel(
        "Question to answer",
        "QA latency, from the query agent taking a question to its answer.",
        [(quantile(0.5, "memstream_qa_seconds"), "p50"), (quantile(0.95, "memstream_qa_seconds"), "p95")],
        unit="s",
    ),
    Panel(
        "Answers by outcome",
        "Answers per second: answered, no_answer, error.",
        [(rate("memstream_qa_answers_total", "status"), "{{status}}")],
        unit="ops",
    ),
    Panel(
        "Stage latency (p95)",
        "Each of the 13 PAI-2 stages (the minimal QA runs 6 and 13 only).",
        [(quantile(0.95, "memstream_qa_stage_seconds", "stage, stage_name"), "{{stage}} {{stage_name}}")],
        unit="s",
    ),
    Panel(
        "Time spent per stage",
        "Seconds spent in each stage per second: where the QA time goes.",
        [(rate("memstream_qa_stage_seconds_sum", "stage_name"), "{{stage_name}}")],
        unit="s",
    ),
    Panel(
        "Stage outcomes",
        "Stage events per second by status (ok, empty, skipped, error), from the assembled traces.",
        [(rate("memstream_trace_stage_events_total", "stage_name, status", agg="max"), "{{stage_name}} {{status}}")],
        unit="ops",
    ),
    Panel(
        "Retrieval sizes",
        "Mean vertices matched (match) and triplets retrieved (traversal) and kept (filter) per stage run.",
        [(mean("memstream_trace_retrieved", "stage_name, what", agg="max"), "{{stage_name}} {{what}}")],
    ),
    Panel(
        "First answer text",
        "From the query agent taking a question to the first piece of its answer shown to streaming readers.",
        [
            (quantile(0.5, "memstream_qa_first_text_seconds"), "p50"),
            (quantile(0.95, "memstream_qa_first_text_seconds"), "p95"),
        ],
        unit="s",
    ),
    Panel(
        "Questions cancelled",
        "Cancelled by their asker (deleted) or left by a disconnected one; stopped while answering or before it began.",
        [(rate("memstream_qa_cancelled_total", "reason, when"), "{{reason}} {{when}}")],
        unit="ops",
    ),
]

LLM = [
    Panel(
        "LLM calls",
        "Calls per second by model, task and outcome (ok, cached, error, cancelled).",
        [(rate("memstream_llm_calls_total", "model, task, outcome"), "{{model}} {{task}} {{outcome}}")],
        unit="ops",
    ),
    Panel(
        "Tokens",
        "Tokens per second by model and direction (cache hits cost none).",
        [(rate("memstream_llm_tokens_total", "model, direction"), "{{model}} {{direction}}")],
    ),
    Panel(
        "LLM latency (p95)",
        "Model time per call, by model and task.",
        [(quantile(0.95, "memstream_llm_latency_seconds", "model, task"), "{{model}} {{task}}")],
        unit="s",
    ),
    Panel(
        "Model busy",
        "Model-seconds per second: 1.0 is one model slot busy all the time (the cost of a local model).",
        [(rate("memstream_llm_latency_seconds_sum", "model"), "{{model}}")],
        unit="percentunit",
    ),
    Panel(
        "Cache",
        "LLM cache lookups per second, hits and misses.",
        [(rate("memstream_llm_cache_total", "result"), "{{result}}")],
        unit="ops",
    ),
    Panel(
        "Cache hit ratio",
        "Share of LLM requests answered from the cache.",
        [
            (
                f'sum(rate(memstream_llm_cache_total{{result="hit"}}[{RATE}])) '
                f"/ sum(rate(memstream_llm_cache_total[{RATE}]))",
                "hit ratio",
            )
        ],
        unit="percentunit",
    ),
    Panel(
        "Estimated cost",
        "Tokens per hour times the price per million tokens set above (0 for a local model).",
        [
            (
                f"sum by (model) (rate(memstream_llm_tokens_total[{RATE}])) * 3600 * $usd_per_million_tokens / 1e6",
                "{{model}}",
            )
        ],
        unit="currencyUSD",
    ),
    Panel(
        "Tokens per QA stage",
        "Which stages of the QA pipeline spend the tokens, from the assembled traces.",
        [
            (
                rate("memstream_trace_stage_tokens_total", "stage_name, direction", agg="max"),
                "{{stage_name}} {{direction}}",
            )
        ],
    ),
]

KAFKA = [
    Panel(
        "Consumer lag",
        "Records the worker group has not committed yet, per topic and partition.",
        [("max by (topic, partition) (memstream_consumer_lag)", "{{topic}}[{{partition}}]")],
        width=24,
    ),
    Panel(
        "Waiting for memorize, per worker",
        "Records waiting in the partitions each worker holds (the group's total beside them): memory is current at 0.",
        [
            ("max by (worker) (memstream_memorize_worker_backlog_messages)", "{{worker}}"),
            ("max by (topic) (memstream_memorize_backlog_messages)", "all: {{topic}}"),
        ],
    ),
    Panel(
        "Time to catch up, per worker",
        "Records waiting / the rate each worker committed at since the last sample; -1: records wait, none committed.",
        [
            ("max by (worker) (memstream_memorize_worker_catchup_seconds)", "{{worker}}"),
            ("max by (topic) (memstream_memorize_catchup_seconds)", "all: {{topic}}"),
        ],
        unit="s",
    ),
    Panel(
        "Lag per topic",
        "Total uncommitted records of each topic the workers consume.",
        [("sum by (topic) (max by (topic, partition) (memstream_consumer_lag))", "{{topic}}")],
    ),
    Panel(
        "Arrivals and memorized",
        "Messages and documents accepted vs. memorized per second: a lasting gap is a growing backlog.",
        [
            (f'sum(rate(memstream_gateway_events_total{{kind!="query"}}[{RATE}]))', "accepted"),
            (f"sum(rate(memstream_memorize_events_total[{RATE}]))", "memorized"),
        ],
        unit="ops",
    ),
    Panel(
        "Trace delay",
        "Stage event emitted by a worker to assembled in the gateway (how live the trace page is).",
        [(quantile(0.95, "memstream_trace_delay_seconds", agg="max"), "p95")],
        unit="s",
    ),
    Panel(
        "Largest lag",
        "The most lagging partition.",
        [("max(memstream_consumer_lag)", "records")],
        kind="stat",
        width=6,
        height=6,
    ),
    Panel(
        "Trace streams",
        "Live trace streams (SSE) closed per second, by how they ended.",
        [(rate("memstream_trace_streams_total", "outcome", agg="max"), "{{outcome}}")],
        unit="ops",
    ),
]

ERRORS = [
    Panel(
        "Backends up",
        "1 while the graph store, vector store, model server and embedder answer; 0 while a worker's calls to one fail "
        "and are being retried: processing waits for it (MEMSTREAM_BACKEND_OUTAGE_S), lag grows, nothing is dropped.",
        [("min by (backend) (memstream_backend_up)", "{{backend}}")],
        width=24,
    ),
    Panel(
        "Dead letters",
        "Events sent to the dead-letter topic per second, by reason and source topic.",
        [(rate("memstream_dead_letters_total", "reason, topic"), "{{reason}} {{topic}}")],
        unit="ops",
    ),
    Panel(
        "Dead letters in the last hour",
        "By reason.",
        [("sum by (reason) (increase(memstream_dead_letters_total[1h]))", "{{reason}}")],
        kind="bargauge",
    ),
    Panel(
        "Extraction failures",
        "Extraction calls that failed validation after their retries.",
        [(rate("memstream_extraction_failures_total", "reason"), "{{reason}}")],
        unit="ops",
    ),
    Panel(
        "LLM errors",
        "Calls that raised (the model backend failed) or were cancelled.",
        [
            (
                rate("memstream_llm_calls_total", "model, task, outcome", '{outcome=~"error|cancelled"}'),
                "{{model}} {{task}} {{outcome}}",
            )
        ],
        unit="ops",
    ),
    Panel(
        "LLM retries",
        "Calls retried after a transport error or timeout.",
        [(rate("memstream_llm_retries_total", "model, task"), "{{model}} {{task}}")],
        unit="ops",
    ),
    Panel(
        "Error answers",
        "Share of answers with status error.",
        [
            (
                f'sum(rate(memstream_qa_answers_total{{status="error"}}[{RATE}])) '
                f"/ sum(rate(memstream_qa_answers_total[{RATE}]))",
                "error share",
            )
        ],
        unit="percentunit",
    ),
    Panel(
        "Stage errors",
        "QA stage runs that ended in error, per stage.",
        [(rate("memstream_trace_stage_events_total", "stage_name", '{status="error"}', agg="max"), "{{stage_name}}")],
        unit="ops",
    ),
    Panel(
        "Rejected requests",
        "Requests the gateway refused as invalid (422), by route.",
        [(rate("memstream_gateway_rejected_total", "route"), "{{route}}")],
        unit="ops",
    ),
]

PRICE_VARIABLE = {
    "name": "usd_per_million_tokens",
    "label": "USD per million tokens",
    "description": "Price used by the cost panel; 0 for a local model",
    "type": "textbox",
    "query": "0",
    "current": {"text": "0", "value": "0"},
    "hide": 0,
}

DASHBOARDS: dict[str, tuple[str, str, list[Panel], list[dict[str, Any]]]] = {
    "ingestion.json": ("memstream-ingestion", "memstream · Ingestion", INGESTION, []),
    "qa-stages.json": ("memstream-qa", "memstream · QA stages", QA, []),
    "llm.json": ("memstream-llm", "memstream · LLM usage and cost", LLM, [PRICE_VARIABLE]),
    "kafka-lag.json": ("memstream-kafka", "memstream · Kafka lag", KAFKA, []),
    "errors.json": ("memstream-errors", "memstream · Errors and dead letters", ERRORS, []),
}


def panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    targets = [
        {"refId": chr(ord("A") + n), "datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "range": True}
        for n, (expr, legend) in enumerate(panel.targets)
    ]
    options: dict[str, Any] = (
        {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True}, "tooltip": {"mode": "multi"}}
        if panel.kind == "timeseries"
        else {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}}
    )
    return {
        "id": panel_id,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": panel.height, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "options": options,
        "targets": targets,
        **panel.extra,
    }


def dashboard(uid: str, title: str, panels: list[Panel], variables: list[dict[str, Any]]) -> dict[str, Any]:
    laid_out = []
    x = y = row_height = 0
    for n, panel in enumerate(panels, 1):
        if x + panel.width > 24:
            x, y, row_height = 0, y + row_height, 0
        laid_out.append(panel_json(panel, n, x, y))
        x += panel.width
        row_height = max(row_height, panel.height)
    datasource_variable = {
        "name": "datasource",
        "label": "Data source",
        "type": "datasource",
        "query": "prometheus",
        "current": {},
        "hide": 0,
    }
    return {
        "uid": uid,
        "title": title,
        "tags": ["memstream"],
        "editable": True,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "browser",
        "annotations": {"list": []},
        "links": [{"type": "dashboards", "tags": ["memstream"], "asDropdown": True, "title": "memstream"}],
        "templating": {"list": [datasource_variable, *variables]},
        "panels": laid_out,
    }


def render() -> dict[str, str]:
    """File name -> JSON text of every dashboard."""
    return {
        name: json.dumps(dashboard(uid, title, panels, variables), indent=2) + "\n"
        for name, (uid, title, panels, variables) in DASHBOARDS.items()
    }


def main() -> int:
    for name, text in render().items():
        (HERE / name).write_text(text)
        sys.stdout.write(f"wrote dashboards/{name}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
