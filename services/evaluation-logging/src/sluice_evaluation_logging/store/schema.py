"""The tables of evaluation-logging's store and their numbered migrations, the same on SQLite and
PostgreSQL (sluice-common's sqlstore applies them once each, recording them in `schema_migrations`).

Records and scores are separate tables linked by event id. A score computed later (similarity)
has a row in `pending_scores`, written in the same transaction as its record.

An applied migration is never edited: a database created by an older version opens with this one
by applying only the migrations it lacks. A change of schema is a new numbered migration.
"""

from __future__ import annotations

# (version, description, statements); {blob} is the binary column type of the backend.
MIGRATIONS: tuple[tuple[int, str, tuple[str, ...]], ...] = (
    (
        1,
        "records and scores",
        (
            """CREATE TABLE records (
                event_id TEXT PRIMARY KEY,
                tenant TEXT NOT NULL,
                model TEXT NOT NULL,
                priority_class INTEGER NOT NULL,
                request_id TEXT NOT NULL,
                finish_reason INTEGER NOT NULL,
                error_code TEXT NOT NULL,
                input_tokens INTEGER NOT NULL,
                output_tokens INTEGER NOT NULL,
                latency_ms DOUBLE PRECISION NOT NULL,
                ttft_ms DOUBLE PRECISION NOT NULL,
                started_at DOUBLE PRECISION NOT NULL,
                finished_at DOUBLE PRECISION NOT NULL,
                stored_at DOUBLE PRECISION NOT NULL,
                text_logged BOOLEAN NOT NULL,
                event {blob} NOT NULL
            )""",
            "CREATE INDEX records_tenant_time ON records (tenant, finished_at, event_id)",
            "CREATE INDEX records_tenant_model_time ON records (tenant, model, finished_at)",
            """CREATE TABLE scores (
                event_id TEXT NOT NULL REFERENCES records (event_id) ON DELETE CASCADE,
                name TEXT NOT NULL,
                value DOUBLE PRECISION NOT NULL,
                passed BOOLEAN NOT NULL,
                skipped BOOLEAN NOT NULL,
                detail TEXT NOT NULL,
                PRIMARY KEY (event_id, name)
            )""",
            "CREATE INDEX scores_name_value ON scores (name, value)",
        ),
    ),
    (
        2,
        "pending scores (computed off the consume path)",
        (
            """CREATE TABLE pending_scores (
                event_id TEXT NOT NULL REFERENCES records (event_id) ON DELETE CASCADE,
                name TEXT NOT NULL,
                queued_at DOUBLE PRECISION NOT NULL,
                not_before DOUBLE PRECISION NOT NULL,
                attempts INTEGER NOT NULL,
                PRIMARY KEY (event_id, name)
            )""",
            "CREATE INDEX pending_scores_due ON pending_scores (name, not_before)",
            # No query reads scores by (name, value): thresholds are correlated by event id and use
            # the primary key. This index cost an update per score row (8-9 per event) on the
            # consume path and bought nothing.
            "DROP INDEX scores_name_value",
        ),
    ),
    (
        3,
        "prompt tokens served from the engine's prefix cache",
        (
            # Records stored before engines reported it count none (their events have no such field).
            "ALTER TABLE records ADD COLUMN cached_tokens INTEGER NOT NULL DEFAULT 0",
        ),
    ),
    (
        4,
        "the trace id of the request behind each record",
        # Records stored before tracing have none.
        ("ALTER TABLE records ADD COLUMN trace_id TEXT NOT NULL DEFAULT ''",),
    ),
    (
        5,
        "the request's end user and metadata (OpenAI's user and metadata), queryable",
        (
            # Records stored before have neither ("user" is reserved in PostgreSQL: end_user).
            "ALTER TABLE records ADD COLUMN end_user TEXT NOT NULL DEFAULT ''",
            "CREATE INDEX records_tenant_user_time ON records (tenant, end_user, finished_at)",
            # One row per pair: a filter on key=value is an indexed lookup on both backends alike.
            """CREATE TABLE record_metadata (
                event_id TEXT NOT NULL REFERENCES records (event_id) ON DELETE CASCADE,
                name TEXT NOT NULL,
                value TEXT NOT NULL,
                PRIMARY KEY (event_id, name)
            )""",
            "CREATE INDEX record_metadata_pair ON record_metadata (name, value)",
        ),
    ),
)

LATEST_VERSION = MIGRATIONS[-1][0]

# The records table's columns in the order RecordRow is read and written (sql.record_params, sql.row_from).
RECORD_COLUMNS = (
    "event_id, tenant, model, priority_class, request_id, finish_reason, error_code, input_tokens, output_tokens,"
    " latency_ms, ttft_ms, started_at, finished_at, stored_at, text_logged, event, cached_tokens, trace_id, end_user"
)
SCORE_COLUMNS = "event_id, name, value, passed, skipped, detail"
PENDING_COLUMNS = "event_id, name, queued_at, not_before, attempts"
METADATA_COLUMNS = "event_id, name, value"
