"""gateway settings, from SLUICE_GATEWAY_* environment variables.

One set of variables for the gateway's two roles, in blocks: `SharedSettings` (what both the
gateway front and its job worker use: tenants, peers, events, jobs), `FrontSettings` (the HTTP
front beside the gRPC port) and `WorkerSettings` (the job worker, WORKER_*). Each role loads its
own config (`GatewayConfig`, `WorkerConfig`): the shared block and its own, nothing of the other's."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from sluice_common.adaptive_timeout import TimeoutPolicy
from sluice_common.amqp_publisher import BROKER_MAX_MESSAGE_BYTES
from sluice_common.config import ClientTLS, ServerConfig, ServiceConfig, nested, require

ENV_PREFIX = "SLUICE_GATEWAY_"
# SLUICE_GATEWAY_HTTP_PORT's "bind a free port and say which" (0 is "off").
ANY_HTTP_PORT = -1
# The longest completion window a job may ask for (and the default may be): a week. A job's state
# and its results stay in the store until it ends, so a bound keeps forgotten jobs from lingering.
MAX_COMPLETION_WINDOW_S = 7 * 24 * 3600.0
# Of the broker's consumer timeout (WORKER_CONSUMER_TIMEOUT_S), what a row message's time unacked
# keeps free for storing and telling its result and the ack; and the least share a row may wait for
# a slot before the worker hands its message back unstarted, so that the row ceiling fits in the rest.
CONSUMER_TIMEOUT_SETTLE_SHARE = 0.05
CONSUMER_TIMEOUT_SLOT_WAIT_SHARE = 0.10


@dataclass(frozen=True)
class SharedSettings:
    """What the gateway front and its job worker both use (variables without a block prefix)."""

    adapter_url: str = "127.0.0.1:50061"
    # TOML file of tenants and their hashed API keys (see config/tenants.example.toml).
    tenants_file: Path = Path("")
    # max_tokens when a request omits it (gRPC 0, HTTP absent): the model's remaining context after
    # the prompt, capped by this (and by the model's max_output_tokens).
    default_max_tokens: int = 1024
    # The deadline of a request whose client set none (gRPC without a timeout; every HTTP request):
    # DEFAULT_DEADLINE_MULTIPLIER x (p99 time to first token + max_tokens x p99 time per token), or x
    # the p99 of Embed calls, over the last DEFAULT_DEADLINE_WINDOW requests, within FLOOR_S and
    # CEILING_S; CEILING_S until MIN_SAMPLES requests have been seen (default_deadline.py). The
    # ceiling frees a stuck call within the hour while never cutting a long generation on a busy CPU.
    default_deadline_multiplier: float = 2.0
    default_deadline_window: int = 1000
    default_deadline_min_samples: int = 50
    default_deadline_floor_s: float = 30.0
    default_deadline_ceiling_s: float = 3600.0
    # How often the model list is re-read from the adapter.
    models_refresh_s: float = 30.0
    # How long startup waits for the adapter to list its models, then the process exits; 0: for ever
    # (NOT_SERVING on readiness meanwhile, SERVING on liveness), so that a pod started during an
    # adapter or Triton outage does not crash-loop.
    adapter_wait_s: float = 0.0
    # CompletionEvents to RabbitMQ after each stream (evaluation-logging consumes them); empty: off.
    amqp_url: str = "amqp://guest:guest@127.0.0.1:5672/"
    # Exchange and queue names start with this (see sluice_common.amqp.EventTopology).
    amqp_prefix: str = "sluice"
    # Unconfirmed events held in memory; past it they go to events_spill_file (read back later).
    events_outbox_size: int = 10_000
    events_max_in_flight: int = 256
    # Empty: <temp dir>/sluice-gateway-<port>-events.spill.
    events_spill_file: str = ""
    # SubmitJob's AdmittedJobs past the job publisher's outbox, read back on the next start. Empty:
    # <temp dir>/sluice-gateway-<port>-jobs.spill (set it where several gateways share a temp dir,
    # or where the port is chosen at start, 0: the next start would not find the file).
    jobs_spill_file: str = ""
    # TLS to the adapter (ADAPTER_TLS_*), off by default: on when ADAPTER_TLS is true or any file is
    # set. The CA verifies the adapter (empty: system roots); cert and key are the gateway's identity
    # for mutual TLS; the server name overrides the name checked against the adapter's certificate.
    adapter_tls: ClientTLS = nested(ClientTLS)
    # The rate-limit service asked for a lease before each Generate; empty: no rate limiting.
    ratelimit_url: str = "127.0.0.1:50071"
    # When it cannot be reached within RATELIMIT_TIMEOUT_S (and the request's deadline):
    # "closed" answers UNAVAILABLE, "open" admits without a lease.
    ratelimit_policy: str = "closed"
    ratelimit_timeout_s: float = 0.5
    # The longest a lease is asked to live at a time: a call that runs longer renews it, and the
    # leases of a gateway that dies free their capacity within this.
    ratelimit_lease_ttl_s: float = 60.0
    # TLS to rate-limit, as for the adapter above.
    ratelimit_tls: ClientTLS = nested(ClientTLS)
    # Bulk jobs (issue 6). Their state: SQLite at JOBS_SQLITE_PATH (shared by the gateway and the job
    # workers of one host), or PostgreSQL (schema "jobs") when JOBS_POSTGRES_DSN is set.
    jobs_sqlite_path: Path = Path("sluice-jobs.sqlite3")
    jobs_postgres_dsn: str = ""
    jobs_max_rows: int = 100_000
    # The largest job SubmitJob and POST /v1/batches take, as the one AdmittedJob message the job
    # workers are handed (a batch's is about 90% of its input file); a larger one is refused before
    # it is recorded. At most BROKER_MAX_MESSAGE_BYTES, RabbitMQ 4's default max_message_size:
    # the broker closes the channel on a larger message.
    jobs_max_message_bytes: int = 8 * 1024 * 1024
    # A job's completion window when its JobRequest sets none (OpenAI's is 24 h): rows not started
    # when it ends are reported failed with code EXPIRED.
    jobs_completion_window_s: float = 86400.0

    def default_deadline_policy(self) -> TimeoutPolicy:
        return TimeoutPolicy(
            self.default_deadline_multiplier,
            self.default_deadline_floor_s,
            self.default_deadline_ceiling_s,
            self.default_deadline_window,
            self.default_deadline_min_samples,
        )

    def __post_init__(self) -> None:
        names = [f"{ENV_PREFIX}DEFAULT_DEADLINE_{n}" for n in ("MULTIPLIER", "FLOOR_S", "CEILING_S", "WINDOW", "MIN_SAMPLES")]
        problems = self.default_deadline_policy().problems(*names)
        require(not problems, "; ".join(problems))
        require(str(self.tenants_file) not in ("", "."), f"{ENV_PREFIX}TENANTS_FILE is required: the TOML file of tenants")
        require(self.tenants_file.is_file(), f"{ENV_PREFIX}TENANTS_FILE={self.tenants_file} does not exist")
        require(
            self.ratelimit_policy in ("closed", "open"),
            f"{ENV_PREFIX}RATELIMIT_POLICY must be closed or open, got {self.ratelimit_policy!r}",
        )
        require(self.adapter_wait_s >= 0, f"{ENV_PREFIX}ADAPTER_WAIT_S must be >= 0 (0: wait for ever), got {self.adapter_wait_s}")
        require(self.ratelimit_timeout_s > 0, f"{ENV_PREFIX}RATELIMIT_TIMEOUT_S must be > 0, got {self.ratelimit_timeout_s}")
        require(self.ratelimit_lease_ttl_s >= 1, f"{ENV_PREFIX}RATELIMIT_LEASE_TTL_S must be >= 1, got {self.ratelimit_lease_ttl_s}")
        require(self.default_max_tokens >= 1, f"{ENV_PREFIX}DEFAULT_MAX_TOKENS must be >= 1, got {self.default_max_tokens}")
        require(self.events_outbox_size >= 1, f"{ENV_PREFIX}EVENTS_OUTBOX_SIZE must be >= 1, got {self.events_outbox_size}")
        require(self.events_max_in_flight >= 1, f"{ENV_PREFIX}EVENTS_MAX_IN_FLIGHT must be >= 1, got {self.events_max_in_flight}")
        require(self.jobs_max_rows >= 1, f"{ENV_PREFIX}JOBS_MAX_ROWS must be >= 1, got {self.jobs_max_rows}")
        require(
            1024 <= self.jobs_max_message_bytes <= BROKER_MAX_MESSAGE_BYTES,
            f"{ENV_PREFIX}JOBS_MAX_MESSAGE_BYTES must be in [1024, {BROKER_MAX_MESSAGE_BYTES}] (RabbitMQ's default max_message_size),"
            f" got {self.jobs_max_message_bytes}",
        )
        require(
            0 < self.jobs_completion_window_s <= MAX_COMPLETION_WINDOW_S,
            f"{ENV_PREFIX}JOBS_COMPLETION_WINDOW_S must be > 0 and <= {MAX_COMPLETION_WINDOW_S:.0f}, got {self.jobs_completion_window_s}",
        )


@dataclass(frozen=True)
class FrontSettings:
    """The gateway front's HTTP API beside its gRPC port (the gRPC port, metrics port and server TLS
    are GatewayConfig's own, from ServerConfig)."""

    # The OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/embeddings,
    # /v1/models) on this port, on the gateway's event loop beside gRPC; 0 (the default): off, so
    # that every gateway already deployed or started by a script keeps its ports; `make run` and the
    # test stack set 8080 or ANY_HTTP_PORT (-1: a free port, named in the log line `ports_bound`).
    # Request bodies larger than HTTP_MAX_BODY_BYTES get 413.
    http_port: int = 0
    http_max_body_bytes: int = 4 * 1024 * 1024
    # The largest file POST /v1/files stores (a batch input file, JSONL; kept in the job store's
    # database); larger uploads get 413. OpenAI's own bound is 200 MB.
    files_max_bytes: int = 100 * 1024 * 1024

    def __post_init__(self) -> None:
        require(
            ANY_HTTP_PORT <= self.http_port <= 65535,
            f"{ENV_PREFIX}HTTP_PORT must be in [-1, 65535] (0: off; -1: any free port), got {self.http_port}",
        )
        require(self.http_max_body_bytes >= 1024, f"{ENV_PREFIX}HTTP_MAX_BODY_BYTES must be >= 1024, got {self.http_max_body_bytes}")
        require(self.files_max_bytes >= 1024, f"{ENV_PREFIX}FILES_MAX_BYTES must be >= 1024, got {self.files_max_bytes}")


@dataclass(frozen=True)
class WorkerSettings:
    """The job-worker role's own settings, from WORKER_*."""

    # The job-worker role (`python -m sluice_gateway.jobs.worker`): its health/metrics ports, rows unacked
    # at once (prefetch: the adaptive concurrency's bound, at most this), the adaptive concurrency's
    # start and ceiling, one row's deadline, transient errors retried in-process (capped exponential
    # backoff with jitter) before the row goes back to the broker, and deliveries after which a row is
    # dead-lettered.
    port: int = 50052
    metrics_port: int = 9106
    prefetch: int = 128
    concurrency_initial: int = 4
    concurrency_max: int = 64
    # The broker's consumer (delivery acknowledgement) timeout on the job queues: RabbitMQ's
    # consumer_timeout (30 min unless rabbitmq.conf says otherwise), or the consumer-timeout policy on
    # the queues. A message unacked longer makes the broker close the worker's channel and requeue
    # every row on it. The worker cannot ask the broker, so it is told: it keeps a row waiting for a
    # slot no longer than what leaves room for an attempt at the row ceiling (then hands the message
    # back unstarted), starts no retry or wait that would end past hold_s (then hands the message
    # back with where the row's retries stand), and refuses a ceiling this cannot cover.
    consumer_timeout_s: float = 1800.0
    # A row attempt's deadline follows this worker's rolling p99s and the row's own max_tokens
    # (row_deadline.py), between the floor and the ceiling; the ceiling is for long work (a
    # 1,024-token row on a busy CPU replica takes minutes). Until enough rows have been seen: at
    # least WORKER_ROW_TIMEOUT_S, longer for a long row (max_tokens x WORKER_ROW_WARMUP_PER_TOKEN_S,
    # about a CPU replica's pace per stream with its batch full, times the multiplier).
    row_timeout_s: float = 120.0
    row_timeout_floor_s: float = 30.0
    # The ceiling fits RabbitMQ's default consumer timeout (with WORKER_CONSUMER_TIMEOUT_S): a longer one
    # needs the broker's raised too (docs/operators/configuration.md).
    row_timeout_ceiling_s: float = 1500.0
    row_warmup_per_token_s: float = 0.25
    row_attempts: int = 4
    retry_base_s: float = 0.25
    retry_cap_s: float = 10.0
    delivery_limit: int = 5

    @property
    def hold_s(self) -> float:
        """How long after its delivery a row message may still be held unacked with work going on
        (a wait, an attempt): what the consumer timeout leaves beside the settling of a result. No
        attempt or wait that would end later is started: the message is handed back first."""
        return self.consumer_timeout_s * (1 - CONSUMER_TIMEOUT_SETTLE_SHARE)

    @property
    def slot_wait_s(self) -> float:
        """How long a row message may wait (unacked) for a slot, or for the worker that runs its row,
        before the worker hands it back unstarted: what hold_s leaves beside an attempt at the ceiling."""
        return self.hold_s - self.row_timeout_ceiling_s

    def row_timeout_policy(self, default_deadline: TimeoutPolicy) -> TimeoutPolicy:
        """The default deadline's multiplier, window and warm-up, with the row timeout's bounds."""
        return replace(default_deadline, floor_s=self.row_timeout_floor_s, ceiling_s=self.row_timeout_ceiling_s)

    def __post_init__(self) -> None:
        # The row timeout policy's other values are the default deadline's, checked with it.
        require(
            0 < self.row_timeout_floor_s <= self.row_timeout_ceiling_s,
            f"{ENV_PREFIX}WORKER_ROW_TIMEOUT_FLOOR_S must be > 0 and <= {ENV_PREFIX}WORKER_ROW_TIMEOUT_CEILING_S,"
            f" got {self.row_timeout_floor_s} and {self.row_timeout_ceiling_s}",
        )
        require(self.prefetch >= 1, f"{ENV_PREFIX}WORKER_PREFETCH must be >= 1, got {self.prefetch}")
        most_s = self.consumer_timeout_s * (1 - CONSUMER_TIMEOUT_SETTLE_SHARE - CONSUMER_TIMEOUT_SLOT_WAIT_SHARE)
        require(
            self.consumer_timeout_s > 0 and self.row_timeout_ceiling_s <= most_s,
            f"{ENV_PREFIX}WORKER_ROW_TIMEOUT_CEILING_S ({self.row_timeout_ceiling_s:g}) must be <= {most_s:g}"
            f" ({1 - CONSUMER_TIMEOUT_SETTLE_SHARE - CONSUMER_TIMEOUT_SLOT_WAIT_SHARE:.0%} of {ENV_PREFIX}WORKER_CONSUMER_TIMEOUT_S,"
            f" {self.consumer_timeout_s:g}): RabbitMQ closes the worker's channel on a row message unacked past its consumer timeout,"
            " requeueing every row on it; lower the ceiling, or raise the broker's consumer_timeout (rabbitmq.conf) or the job"
            " queues' consumer-timeout policy and WORKER_CONSUMER_TIMEOUT_S with it",
        )
        require(
            1 <= self.concurrency_initial <= self.concurrency_max,
            f"{ENV_PREFIX}WORKER_CONCURRENCY_INITIAL must be in [1, WORKER_CONCURRENCY_MAX], got {self.concurrency_initial}",
        )
        require(
            0 < self.row_timeout_s <= self.row_timeout_ceiling_s,
            f"{ENV_PREFIX}WORKER_ROW_TIMEOUT_S must be > 0 and <= {ENV_PREFIX}WORKER_ROW_TIMEOUT_CEILING_S,"
            f" got {self.row_timeout_s} and {self.row_timeout_ceiling_s}",
        )
        require(
            self.row_warmup_per_token_s > 0,
            f"{ENV_PREFIX}WORKER_ROW_WARMUP_PER_TOKEN_S must be > 0, got {self.row_warmup_per_token_s}",
        )
        require(self.row_attempts >= 1, f"{ENV_PREFIX}WORKER_ROW_ATTEMPTS must be >= 1, got {self.row_attempts}")
        require(
            0 < self.retry_base_s <= self.retry_cap_s,
            f"{ENV_PREFIX}WORKER_RETRY_BASE_S must be > 0 and <= WORKER_RETRY_CAP_S, got {self.retry_base_s}",
        )
        require(self.delivery_limit >= 1, f"{ENV_PREFIX}WORKER_DELIVERY_LIMIT must be >= 1, got {self.delivery_limit}")


@dataclass(frozen=True)
class GatewayConfig(ServerConfig):
    """The gateway front's settings: ServerConfig's own (host, logs, drain grace, the gRPC and
    metrics ports and server TLS) and the blocks it uses."""

    port: int = 50051
    metrics_port: int = 9101
    shared: SharedSettings = nested(SharedSettings, env="")
    front: FrontSettings = nested(FrontSettings, env="")


@dataclass(frozen=True)
class WorkerConfig(ServiceConfig):
    """The job worker's settings: ServiceConfig's host, logs and drain grace (its ports are
    WORKER_PORT and WORKER_METRICS_PORT, and its health server has no TLS), the shared block and its
    own. The front's settings (its ports and server TLS among them) are neither read nor checked
    here, nor the worker's by the front."""

    shared: SharedSettings = nested(SharedSettings, env="")
    worker: WorkerSettings = nested(WorkerSettings)
