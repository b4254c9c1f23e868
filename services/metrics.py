"""Prometheus metrics, defined once. Modules import the metric they update; nobody re-declares one."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

# LLM usage, by model and task (the LLM layer updates these for every call)
LLM_CALLS = Counter("memstream_llm_calls_total", "LLM calls", ["model", "task", "outcome"])
LLM_TOKENS = Counter("memstream_llm_tokens_total", "LLM tokens", ["model", "task", "direction"])
LLM_LATENCY = Histogram("memstream_llm_latency_seconds", "LLM call latency", ["model", "task"], buckets=_LATENCY)
LLM_CACHE = Counter("memstream_llm_cache_total", "LLM cache lookups", ["task", "result"])
LLM_IN_FLIGHT = Gauge(
    "memstream_llm_in_flight",
    "LLM calls holding a model slot now (queued ones excluded)",
    ["model"],
    multiprocess_mode="livesum",
)

# Memorize
MEMORIZE_EVENTS = Counter("memstream_memorize_events_total", "Events memorized", ["kind", "outcome"])
MEMORIZE_BATCH_SIZE = Histogram(
    "memstream_memorize_batch_messages", "Messages per extraction call", buckets=(1, 2, 4, 8, 16, 32, 64)
)
MEMORY_UPDATES_REANNOUNCED = Counter(
    "memstream_memory_updates_reannounced_total",
    "Memory updates published again on replay: written before a crash, not yet marked announced",
)
EMBEDDING_CACHE = Counter(
    "memstream_embedding_cache_total", "Embedding lookups per user and text (hit: embedded before)", ["result"]
)
EMBEDDING_BATCH_TEXTS = Histogram(
    "memstream_embedding_batch_texts", "Texts per embedder call", buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256)
)
FORGETS = Counter("memstream_forgets_total", "Forget tombstones applied", ["scope", "outcome"])
FORGOTTEN = Counter("memstream_forgotten_total", "What forgets removed or repaired", ["what"])
MEMORIZE_CHANGES = Counter("memstream_memorize_changes_total", "Vertices/edges written", ["what"])
EXTRACTION_FAILURES = Counter("memstream_extraction_failures_total", "Extraction calls that failed", ["reason"])
EXTRACTION_REPEATS = Counter(
    "memstream_extraction_repeats_total",
    "Extraction calls stopped at a fact the model had already written for the batch (the rest asked for again)",
)
LLM_REJECTED = Counter(
    "memstream_llm_rejected_outputs_total",
    "Model outputs rejected by their task's checks (never cached)",
    ["task", "reason"],
)
MEMORIZE_NO_FACTS = Counter(
    "memstream_memorize_no_facts_total",
    "Messages memorized with no fact, by why: the model listed none, the checks dropped all, the model gave no entry",
    ["reason"],
)
RESOLVE_VERDICTS = Counter(
    "memstream_resolve_pairs_total", "New-fact/known-thesis pairs judged for contradiction, by verdict", ["verdict"]
)
ENTITY_MERGES = Counter(
    "memstream_entity_merges_total",
    "Entity names attached to an object of the same user under another name, by how the merge was settled",
    ["method"],
)
ENTITY_PAIRS = Counter(
    "memstream_entity_pairs_total",
    "Name pairs asked of the model for entity resolution, by verdict (failed: the call failed, nothing merged)",
    ["verdict"],
)
LABEL_OUTCOMES = Counter(
    "memstream_label_outcomes_total",
    "Judged pairs by what the label rules made of them (supersede, conflict, confirm, refute, keep)",
    ["outcome"],
)
FACTS_CUT = Counter(
    "memstream_extraction_facts_cut_total",
    "Extracted facts the sentence bound ended mid-sentence (kept as written, marked cut on the thesis)",
)
FACTS_DROPPED = Counter(
    "memstream_extraction_facts_dropped_total", "Extracted facts dropped by the deterministic checks", ["reason"]
)
STORE_WRITE_LATENCY = Histogram(
    "memstream_store_write_seconds", "Store write latency per change set", ["store"], buckets=_LATENCY
)
INGEST_TO_QUERYABLE = Histogram(
    "memstream_ingest_to_queryable_seconds", "Event time to memory committed", buckets=_LATENCY
)

# QA
QA_STAGE_LATENCY = Histogram(
    "memstream_qa_stage_seconds", "QA stage latency", ["stage", "stage_name"], buckets=_LATENCY
)
QA_LATENCY = Histogram("memstream_qa_seconds", "Question to answer latency", buckets=_LATENCY)
QA_ANSWERS = Counter("memstream_qa_answers_total", "Answers by outcome", ["status"])
QA_FIRST_TEXT = Histogram(
    "memstream_qa_first_text_seconds", "From a query's start to the first answer text streamed", buckets=_LATENCY
)
QA_CANCELLED = Counter(
    "memstream_qa_cancelled_total",
    "Queries cancelled: deleted by their asker or left by a disconnected one; `when` says whether LLM work was stopped",
    ["reason", "when"],
)
RETRIEVAL_SIZE = Histogram(
    "memstream_retrieval_triplets", "Triplets retrieved per call", ["retriever"], buckets=(0, 1, 5, 10, 20, 50, 100)
)

# Errors
DEAD_LETTERS = Counter("memstream_dead_letters_total", "Events sent to the dead-letter topic", ["topic", "reason"])
# set by the gateway's lag sensor; under `memstream up` (one metrics directory) the live processes' maximum
CONSUMER_LAG = Gauge(
    "memstream_consumer_lag",
    "Records the worker group has not committed yet",
    ["topic", "partition"],
    multiprocess_mode="livemax",
)
# set with it: messages a topic's workers have still to process, and the time to catch up at their recent rate
MEMORIZE_BACKLOG = Gauge(
    "memstream_memorize_backlog_messages", "Records waiting for the workers", ["topic"], multiprocess_mode="livemax"
)
# when the sensor read the offsets behind the two above (unix time): a reader that just sent messages knows whether
# the backlog it reads counts them
MEMORIZE_LAG_SAMPLED = Gauge(
    "memstream_memorize_lag_sampled_timestamp_seconds",
    "When the lag sensor last read the offsets (unix time)",
    multiprocess_mode="livemax",
)
MEMORIZE_CATCHUP = Gauge(
    "memstream_memorize_catchup_seconds",
    "Estimated seconds until the worker group has caught up (backlog / recent drain rate; -1: not draining)",
    ["topic"],
    multiprocess_mode="livemax",
)

MEMORIZE_WORKER_BACKLOG = Gauge(
    "memstream_memorize_worker_backlog_messages",
    "Records waiting in the partitions a worker holds (worker: its group member id)",
    ["worker"],
    multiprocess_mode="livemax",
)
MEMORIZE_WORKER_CATCHUP = Gauge(
    "memstream_memorize_worker_catchup_seconds",
    "Estimated seconds until a worker has caught up with its partitions (-1: records wait, none committed)",
    ["worker"],
    multiprocess_mode="livemax",
)

# The gateway's write-ahead outbox (streams/outbox.py)
OUTBOX_COMMITS = Counter("memstream_outbox_commits_total", "Outbox commits (fsyncs); each covers one or more requests")
OUTBOX_REPLAYED = Counter("memstream_outbox_replayed_total", "Outbox entries re-published into the broker")
OUTBOX_ENTRIES = Gauge(
    "memstream_outbox_entries", "Outbox entries not memorized yet, by state", ["state"], multiprocess_mode="livesum"
)
