"""Metrics the trace feed derives from the stage events it assembles (the design emits stage events "for tracing
and metrics"): stage outcomes, retrieval sizes and LLM tokens per QA stage, and how late traces are.

Every gateway consumes every stage event, so with several gateways each reports the same figures: aggregate them
with ``max by (...)`` across instances, never ``sum``.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

TRACE_STAGE_EVENTS = Counter(
    "memstream_trace_stage_events_total", "QA stage events assembled into traces", ["stage_name", "status"]
)
TRACE_RETRIEVED = Histogram(
    "memstream_trace_retrieved",
    "Vertices or triplets a QA stage found (match: vertices; traversal, filter: triplets)",
    ["stage_name", "what"],
    buckets=(0, 1, 2, 5, 10, 20, 50, 100, 200),
)
TRACE_STAGE_TOKENS = Counter(
    "memstream_trace_stage_tokens_total", "LLM tokens per QA stage", ["stage_name", "direction"]
)
TRACE_DELAY = Histogram(
    "memstream_trace_delay_seconds",
    "Stage event emitted to assembled in the gateway's trace (how live the trace page is)",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
TRACE_STREAMS = Counter("memstream_trace_streams_total", "Trace streams (SSE) closed, by how they ended", ["outcome"])

#: which count of a stage event is its retrieval size
RETRIEVAL_STAGES = {"match": "vertices", "traversal": "triplets", "filter": "triplets"}
