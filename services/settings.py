"""All configuration, from the environment (prefix ``MEMSTREAM_``) or a ``.env`` file."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SecretsSettingsSource,
    SettingsConfigDict,
)

from schemas.validation import DEFAULT_MAX_BODY_BYTES

#: Where secret files are read from when MEMSTREAM_SECRETS_DIR is unset (a Kubernetes Secret mounted there).
DEFAULT_SECRETS_DIR = Path("/run/secrets/memstream")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MEMSTREAM_", env_file=".env", extra="ignore")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """The usual order (arguments, environment, .env, the ``_secrets_dir`` argument's files), then secret files:
        one per setting, named after its variable, in MEMSTREAM_SECRETS_DIR (else /run/secrets/memstream if any)."""
        configured = os.environ.get("MEMSTREAM_SECRETS_DIR")
        folder = Path(configured) if configured else DEFAULT_SECRETS_DIR if DEFAULT_SECRETS_DIR.is_dir() else None
        sources = [init_settings, env_settings, dotenv_settings, file_secret_settings]
        if folder is not None:
            sources.append(SecretsSettingsSource(settings_cls, secrets_dir=folder))
        return tuple(sources)

    data_dir: Path = Field(default=Path("./memstream-data"), description="Embedded store, broker logs, cache.")

    # Kafka
    broker: str | None = Field(default=None, description="bootstrap servers; unset: `up` starts the embedded Tansu")
    topic_prefix: str = "memstream"
    partitions: int = Field(default=4, ge=1)
    replication_factor: int = Field(default=1, ge=1)
    consumer_group: str = "memstream"
    broker_session_timeout_s: float = 8.0
    kafka_idempotence: bool = Field(
        default=True, description="idempotent producers; `up` turns it off for the embedded Tansu, which lacks it"
    )
    lag_probe_ends: bool = Field(
        default=False,
        description="find each partition's end from its last record when measuring lag: Tansu answers the last "
        "record batch's first offset + 1, so the rest of a batch would not count as waiting; `up` turns it on for it",
    )

    # Memory store: the embedded SQLite file, or Dgraph (graph, applied events, LLM cache) + Weaviate (vectors)
    store: Literal["sqlite", "remote"] = "sqlite"
    dgraph: str | None = Field(default=None, description="Dgraph alpha gRPC host:port, when store == 'remote'")
    weaviate_http: str | None = Field(default=None, description="Weaviate REST host:port, when store == 'remote'")
    weaviate_grpc: str | None = Field(default=None, description="Weaviate gRPC host:port, when store == 'remote'")
    weaviate_prefix: str = Field(default="Memstream", description="Weaviate collection names start with this")

    # Memorize micro-batching: one extraction call covers several messages of one user
    batch_max_messages: int = Field(default=8, ge=1, le=16)
    batch_token_budget: int = Field(default=1200, ge=64, description="approximate input tokens per extraction")
    batch_wait_s: float = Field(default=0.5, ge=0.0, description="how long one take from the topic waits to fill")
    batch_max_hold_s: float = Field(
        default=3.0, ge=0.0, description="how long a user's partial batch is held for more of their messages"
    )
    extraction_attempts: int = Field(default=3, ge=1)
    extraction_output: Literal["compact", "json", "lines"] = Field(
        default="compact",
        description="compact: facts as [sentence, object, when, kind, temporal], subject and relation read off the "
        "sentence (half the generated tokens); json: every field keyed (the design before 4 December); lines: the "
        "compact fields as text lines under a grammar (llama.cpp only)",
    )
    extraction_stop_repeats: bool = Field(
        default=True,
        description="stop an extraction call at a fact it already wrote for the batch and ask for the rest in a "
        "second call with the same prompt (compact output; greedy decoding repeats facts, a quarter of its tokens)",
    )
    extraction_lean: bool = Field(
        default=False,
        description="compact output: the model may leave out a fact's when and kind where they are empty and FACT "
        "(a fifth of the generated text in a whole run)",
    )
    document_chunk_chars: int = Field(default=1500, ge=200)
    document_part_tokens: int = Field(
        default=300, ge=50, description="an uploaded file (Markdown, HTML, PDF) is cut into parts of this many tokens"
    )
    document_part_overlap_tokens: int = Field(default=40, ge=0, description="tokens a part repeats of the one before")
    invalidation_candidates: int = Field(
        default=3, ge=0, description="known theses per new fact judged for contradiction (0: no duplicate checks)"
    )
    resolve_check: bool = Field(
        default=True,
        description="act on a verdict that ends or refutes a known thesis only when a second question (could one "
        "person say both?) agrees",
    )
    resolve_untrusted_after: int = Field(
        default=3,
        ge=0,
        description="after this many resolve_check calls in a row whose control pairs the model answered wrong, "
        "its contradiction verdicts act on nothing: stop asking for them (0: always ask)",
    )
    resolve_untrusted_skip: int = Field(
        default=20, ge=1, description="batches with candidate pairs not sent to the model before it is asked again"
    )
    resolve_by_meaning: bool = Field(
        default=True,
        description="judge pairs found only by meaning (no shared relation) with the model; off, only those whose "
        "known thesis is a prediction are (the rest could only be merged as a repeat: 'updates' on them is not "
        "acted on)",
    )
    contradiction_min_similarity: float = Field(
        default=0.75,
        ge=0.0,
        le=1.0,
        description="cosine at which a known thesis of the same subject, relating it to another entity, is judged "
        "with a new fact",
    )
    duplicate_min_similarity: float = Field(
        default=0.9, ge=0.0, le=1.0, description="cosine at which a known thesis of the same subject is the same fact"
    )
    entity_candidates: int = Field(
        default=3, ge=0, description="known objects per new entity name judged as the same entity (0: exact names only)"
    )
    entity_name_min_score: float = Field(
        default=80.0,
        ge=0.0,
        le=100.0,
        description="name similarity (services.memorize.entities.name_score, 0-100) making two names a candidate pair",
    )
    entity_min_similarity: float = Field(
        default=0.85, ge=0.0, le=1.0, description="cosine of two names' vectors making them a candidate pair"
    )

    # Models
    llm: Literal["local", "ollama", "scripted"] = "local"
    llm_model: str = "qwen2.5-coder-1.5b-instruct-q4_k_m"
    llm_model_path: Path | None = Field(default=None, description="GGUF file for the local LLM")
    llm_context: int = 8192
    llm_threads: int | None = Field(
        default=None, ge=1, description="local model threads (unset: all cores while others leave them free, else half)"
    )
    llm_speculative: Literal["none", "ngram", "ngram-mod", "draft"] = Field(
        default="none", description="local model speculative decoding (docs/benchmarks.md, 'Model time')"
    )
    llm_draft_model: str = Field(
        default="qwen2.5-coder-0.5b-instruct-q4_k_m", description="draft model, with llm_speculative=draft"
    )
    llm_stall_timeout_s: float = Field(
        default=300.0, gt=0, description="a call that produced no token for this long is retried, then fails"
    )
    llm_timeout_s: float | None = Field(
        default=None, gt=0, description="cap on a whole call (unset: none; slow machines make calls slow)"
    )
    llm_max_concurrency: int = Field(
        default=5,
        ge=1,
        description="model calls in flight per process (local: slots decoded together); memorize holds all but one "
        "(at 1 it shares the one slot: a question may wait for a memorize call to end)",
    )
    backend_outage_s: float = Field(
        default=600.0,
        ge=0,
        description="how long a worker's call waits for an unreachable graph store, vector store or model server "
        "(processing pauses meanwhile) before its events are dead-lettered, to be replayed",
    )
    llm_retries: int = Field(default=2, ge=0)
    scripted_llm: str | None = Field(
        default=None, description="'module:function' returning a ScriptedLLM, when llm == 'scripted' (tests, demos)"
    )
    ollama_host: str = "http://127.0.0.1:11434"
    embedder: Literal["minilm", "static", "ollama"] = Field(
        default="minilm",
        description="minilm: all-MiniLM-L6-v2 (int8 ONNX); static: a token table distilled from it, ~90x faster, a "
        "little less recall (docs/benchmarks.md); ollama: embed_model served by Ollama",
    )
    embed_model: str = "all-minilm"

    # Gateway
    host: str = "127.0.0.1"
    port: int = 8420
    max_body_bytes: int = Field(
        default=DEFAULT_MAX_BODY_BYTES, ge=1024, description="larger request bodies get 413 before they are read"
    )
    worker_web_port: int = 6066
    outbox_check_interval_s: float = Field(
        default=10.0, gt=0, description="how often the gateway prunes memorized events from its outbox"
    )

    # Messaging connectors (docs/connectors.md): each platform's secret, and the memstream user its messages go to
    slack_signing_secret: SecretStr | None = Field(default=None, description="Slack app's signing secret (secret)")
    slack_user: str | None = Field(default=None, description="memstream user of the one Slack workspace")
    slack_workspaces: dict[str, str] = Field(
        default_factory=dict, description='more workspaces: {"T0123": "user"} (team id -> memstream user)'
    )
    slack_bot_token: SecretStr | None = Field(
        default=None, description="bot token (xoxb-...) to answer app mentions in their thread (secret)"
    )
    slack_api_url: str = Field(default="https://slack.com/api/", description="Slack Web API base URL")
    telegram_secret_token: SecretStr | None = Field(
        default=None, description="the secret_token given to Telegram's setWebhook (secret)"
    )
    telegram_user: str | None = Field(default=None, description="memstream user of the Telegram bot's chats")
    telegram_bot_token: SecretStr | None = Field(
        default=None, description="the bot's token from BotFather, to answer /ask and replies to it (secret)"
    )
    telegram_api_url: str = Field(default="https://api.telegram.org/bot", description="Telegram Bot API base URL")
    telegram_chats: dict[str, str] = Field(
        default_factory=dict, description='chats of their own: {"-1001234": "user"} (chat id -> memstream user)'
    )
    webhook_secret: SecretStr | None = Field(default=None, description="HMAC key of the generic webhook (secret)")
    webhook_user: str | None = Field(default=None, description="memstream user of the generic webhook's messages")
    connector_replay_window_s: int = Field(
        default=300, ge=30, description="signed requests older (or newer) than this are refused as replays"
    )

    # Authentication: API keys (hashed in a file) and OIDC/JWT bearer tokens; see docs/security.md
    auth_keys_file: Path | None = Field(default=None, description="API key hashes (unset: data_dir/auth/api-keys.json)")
    oidc_issuer: str | None = Field(default=None, description="accepted JWT issuer (iss); unset: no JWTs accepted")
    oidc_audience: str | None = Field(default=None, description="required JWT audience (aud)")
    oidc_jwks_url: str | None = Field(default=None, description="the issuer's JWKS URL")
    oidc_jwks_file: Path | None = Field(default=None, description="a JWKS file, instead of the URL")
    oidc_algorithms: list[str] = Field(default=["RS256", "ES256"], description="accepted JWT signature algorithms")
    oidc_users_claim: str = Field(default="memstream_users", description="claim with the users a token acts for")
    oidc_scopes_claim: str = Field(default="scope", description="claim with the token's scopes (space-separated)")
    oidc_leeway_s: float = Field(default=30.0, ge=0, description="clock skew allowed on exp/nbf/iat")
    metrics_public: bool = Field(default=False, description="/metrics without a credential")
    rate_writes_per_min: int = Field(default=6000, ge=0, description="events a credential writes a minute (0: any)")
    rate_questions_per_min: int = Field(default=60, ge=0, description="questions a credential asks a minute (0: any)")

    # Transport security to Kafka, Dgraph and Weaviate (docs/security.md "Transport security"). Each secret may
    # also come from a file named after its variable, lower case (e.g. memstream_kafka_password), in secrets_dir.
    secrets_dir: Path | None = Field(
        default=None, description=f"folder of secret files (unset: {DEFAULT_SECRETS_DIR} when it exists)"
    )
    kafka_security_protocol: Literal["PLAINTEXT", "SASL_PLAINTEXT", "SASL_SSL", "SSL"] = Field(
        default="PLAINTEXT", description="how every Kafka client (gateway, workers, admin, lag sensor) connects"
    )
    kafka_sasl_mechanism: Literal["SCRAM-SHA-256", "SCRAM-SHA-512", "PLAIN"] = Field(
        default="SCRAM-SHA-256", description="SASL mechanism, when the protocol is SASL_*"
    )
    kafka_username: str | None = Field(default=None, description="SASL user, when the protocol is SASL_*")
    kafka_password: SecretStr | None = Field(default=None, description="SASL password (secret)")
    kafka_ssl_cafile: Path | None = Field(default=None, description="CA bundle that signed the brokers' certificates")
    kafka_ssl_certfile: Path | None = Field(default=None, description="client certificate (PEM), for mTLS")
    kafka_ssl_keyfile: Path | None = Field(default=None, description="client private key (PEM), for mTLS")
    dgraph_user: str | None = Field(default=None, description="Dgraph ACL user to log in as (alter needs guardians)")
    dgraph_password: SecretStr | None = Field(default=None, description="that user's password (secret)")
    dgraph_namespace: int = Field(default=0, ge=0, description="Dgraph namespace to log in to")
    dgraph_token: SecretStr | None = Field(
        default=None, description="alpha's --security token=, sent as auth-token with schema changes (secret)"
    )
    weaviate_api_key: SecretStr | None = Field(default=None, description="Weaviate API key (secret)")

    # QA
    qa_engine: Literal["fast", "planning", "simple"] = Field(
        default="fast",
        description="PAI-2 stages in a few calls (a first answer, a planning round where evidence is missing), "
        "the planning pipeline of one call per stage and step, or one retrieve-and-answer call",
    )
    qa_max_rounds: int = Field(
        default=1, ge=0, le=4, description="fast engine: planning rounds after an insufficient first answer"
    )
    qa_top_k: int = 12
    # flat over theses and the messages they came from: on conversations (LoCoMo) it found the evidence far more
    # often than any walk (recall@10 0.71 against beamsearch's 0.40, docs/evaluation.md); walks win whole-chain
    # recall from one query on multi-hop documents (2Wiki), where the planner's decomposition asks one hop a step
    qa_retriever: str = Field(default="flat", description="flat, beamsearch, watercircles, astar, tog2, ...")
    qa_max_steps: int = Field(default=5, ge=1, le=12)
    qa_max_clue_queries: int = Field(default=4, ge=1, le=8)
    qa_plan_enhancement: bool = True
    qa_decomposition: bool = True
    qa_infer_answers: bool = Field(
        default=True, description='fast engine: a "would X ...?" question answered by inference ("Likely no, since")'
    )
    qa_episodic_context: bool = Field(
        default=True, description="show the messages themselves beside the theses (what extraction missed)"
    )
    # off: p95 at 1M triplets 52-78 ms against 92-104 on (benchmarks/qa_scale.py); the answers tie in the rounds
    # measured, off against on: LoCoMo 7 rounds, one partly right answer lost; 2Wiki 8 rounds, one right answer
    # gained (docs/evaluation.md, "... on 30 2Wiki questions (6 December)")
    qa_near_match_clues: bool = Field(
        default=False,
        description="fast engine's rounds: a name matched exactly is also replaced by its near matches in clue-queries",
    )
    # on: 2Wiki (seed 1, 26 questions) 6 (+2) right against 4, 18.5 s a question against 43.2; LoCoMo (29
    # questions) the same answers by our reading, 18.2 s against 19.1 (docs/evaluation.md, 7 December)
    qa_chain_context: bool = Field(
        default=True,
        description="fast engine: the first answer's lines grouped along the question's chain (its names' lines, "
        "then the lines of what those name, then the rest), by the graph, no call",
    )
    # on: 2Wiki (seed 1, 26 questions) 10 (+2) right against the chain's 6 (+2) and the planning engine's 8 (+1), 2.00
    # calls and 19.7 s a question against 1.65 and 18.2; LoCoMo (29) no question cut; MuSiQue (8) 2 cut, no grade
    # changed (docs/evaluation.md, "the question's first link asked on its own")
    qa_first_link: bool = Field(
        default=True,
        description='fast engine with the chain: a question\'s first link ("the director of film X") asked on its '
        "own, found from its words without a call, and the rest asked of the link's answer",
    )
    log_level: str = "INFO"
    log_json: bool | None = Field(default=None, description="None: JSON unless stderr is a terminal")

    def topic(self, name: str) -> str:
        return f"{self.topic_prefix}.{name}"

    @property
    def store_path(self) -> Path:
        return self.data_dir / "memory.sqlite3"

    @property
    def outbox_path(self) -> Path:
        return self.data_dir / "gateway" / "outbox.sqlite3"

    @property
    def connector_versions_path(self) -> Path:
        return self.data_dir / "gateway" / "connector-versions.sqlite3"


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
