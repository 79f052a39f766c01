"""evaluation-logging settings, from SLUICE_EVALLOG_* environment variables."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sluice_common.amqp import DEFAULT_AMQP_URL
from sluice_common.config import ClientTLS, ServerConfig, nested, require

ENV_PREFIX = "SLUICE_EVALLOG_"


@dataclass(frozen=True)
class EvalLogConfig(ServerConfig):
    port: int = 50081
    metrics_port: int = 9104
    # TOML file of tenants and their hashed API keys: the same file the gateway reads.
    tenants_file: Path = Path("")
    amqp_url: str = DEFAULT_AMQP_URL
    # Exchange and queue names start with this (see sluice_common.amqp.EventTopology).
    amqp_prefix: str = "sluice"
    # Unacked messages the broker may hand this consumer at once.
    prefetch: int = 512
    # A batch is stored (one transaction) and acked (one multiple-ack) when it has this many
    # events or its first event has waited batch_delay_s.
    batch_max: int = 256
    batch_delay_s: float = 0.05
    # PostgreSQL DSN (postgresql://user@host:port/db); empty means SQLite at sqlite_path.
    database_url: str = ""
    pg_schema: str = "evallog"
    sqlite_path: Path = Path("evallog.sqlite3")
    # Worker processes for the CPU-heavy evaluators (repetition, pii, json_validity), off the event
    # loop; 0 runs them on the loop (for comparison). One suits a small pod: the service process
    # itself needs the other core; raise it where evaluation, not storing, is the bottleneck.
    eval_processes: int = 1
    # Evaluator settings.
    latency_slo_ms: float = 30_000.0
    ttft_slo_ms: float = 2_000.0
    repetition_ngram: int = 4
    repetition_max_ratio: float = 0.5
    # The adapter's Embed serves the prompt-to-answer similarity evaluator.
    adapter_url: str = "127.0.0.1:50061"
    # TLS to the adapter, off by default: ADAPTER_TLS and ADAPTER_TLS_* (as the gateway's).
    adapter_tls: ClientTLS = nested(ClientTLS)
    embedding_model: str = "all-minilm-l6-v2"
    similarity_sample_rate: float = 0.1
    similarity_min: float = 0.2
    # reference_similarity (ScoreCompletions, `sluice eval`): the output-to-reference cosine that passes.
    reference_similarity_min: float = 0.5
    # ScoreCompletions calls one tenant may have in flight (each up to 1000 items, two Embed calls
    # per item on the shared adapter, CPU in the consumer's pool); one more is RESOURCE_EXHAUSTED
    # with RetryInfo. `sluice eval` makes one call at a time.
    score_max_concurrent_per_tenant: int = 2
    embed_timeout_s: float = 10.0
    # Similarity is computed off the consume path: events per Embed call (two texts each), and how
    # long a claim on pending markers lasts before another replica (or the next process) may take them.
    similarity_batch_max: int = 64
    similarity_lease_s: float = 60.0
    # While the consumer has a backlog, the similarity task waits up to this long before each batch.
    similarity_max_pause_s: float = 2.0

    def __post_init__(self) -> None:
        require(str(self.tenants_file) not in ("", "."), f"{ENV_PREFIX}TENANTS_FILE is required: the TOML file of tenants")
        require(self.tenants_file.is_file(), f"{ENV_PREFIX}TENANTS_FILE={self.tenants_file} does not exist")
        require(self.prefetch >= 1, f"{ENV_PREFIX}PREFETCH must be >= 1, got {self.prefetch}")
        require(
            1 <= self.batch_max <= self.prefetch,
            f"{ENV_PREFIX}BATCH_MAX must be in 1..PREFETCH ({self.prefetch}), got {self.batch_max}",
        )
        require(0 <= self.batch_delay_s <= 10, f"{ENV_PREFIX}BATCH_DELAY_S must be in [0, 10], got {self.batch_delay_s}")
        require(
            0.0 <= self.similarity_sample_rate <= 1.0,
            f"{ENV_PREFIX}SIMILARITY_SAMPLE_RATE must be in [0, 1], got {self.similarity_sample_rate}",
        )
        require(
            -1.0 <= self.reference_similarity_min <= 1.0,
            f"{ENV_PREFIX}REFERENCE_SIMILARITY_MIN must be a cosine in [-1, 1], got {self.reference_similarity_min}",
        )
        require(
            1 <= self.similarity_batch_max <= 1024,
            f"{ENV_PREFIX}SIMILARITY_BATCH_MAX must be in 1..1024, got {self.similarity_batch_max}",
        )
        require(
            self.similarity_lease_s > self.embed_timeout_s,
            f"{ENV_PREFIX}SIMILARITY_LEASE_S must be longer than {ENV_PREFIX}EMBED_TIMEOUT_S ({self.embed_timeout_s}), got"
            f" {self.similarity_lease_s}: a claim's one Embed call must end within its lease",
        )
        require(
            0 <= self.similarity_max_pause_s <= 60,
            f"{ENV_PREFIX}SIMILARITY_MAX_PAUSE_S must be in [0, 60], got {self.similarity_max_pause_s}",
        )
        require(
            1 <= self.score_max_concurrent_per_tenant <= 1024,
            f"{ENV_PREFIX}SCORE_MAX_CONCURRENT_PER_TENANT must be in 1..1024, got {self.score_max_concurrent_per_tenant}",
        )
        require(0 <= self.eval_processes <= 64, f"{ENV_PREFIX}EVAL_PROCESSES must be in 0..64, got {self.eval_processes}")
        require(self.repetition_ngram >= 1, f"{ENV_PREFIX}REPETITION_NGRAM must be >= 1, got {self.repetition_ngram}")
        require(
            self.database_url == "" or self.database_url.startswith(("postgres://", "postgresql://")),
            f"{ENV_PREFIX}DATABASE_URL must be empty (SQLite) or a postgresql:// DSN",
        )
        require(self.pg_schema.isidentifier(), f"{ENV_PREFIX}PG_SCHEMA must be a plain identifier, got {self.pg_schema!r}")
