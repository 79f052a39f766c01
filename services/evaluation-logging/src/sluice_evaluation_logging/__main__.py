"""`python -m sluice_evaluation_logging`: consume CompletionEvents, evaluate, store, answer queries."""

from __future__ import annotations

import structlog
from sluice.evallog.v1 import evallog_pb2, evallog_pb2_grpc

from sluice_common.amqp import EventTopology
from sluice_common.bootstrap import run_service
from sluice_common.loop_lag import monitor_loop_lag
from sluice_common.server import create_server, serve_until_signal
from sluice_common.tenants import TenantDirectory
from sluice_evaluation_logging.config import ENV_PREFIX, EvalLogConfig
from sluice_evaluation_logging.consumer import CompletionConsumer, ConsumerSettings
from sluice_evaluation_logging.embeddings import AdapterEmbedder
from sluice_evaluation_logging.eval_pool import EvalPool
from sluice_evaluation_logging.evaluators.base import EvalContext, EvalSettings
from sluice_evaluation_logging.queries import EvalLogQueries
from sluice_evaluation_logging.scoring import ScoreSlots
from sluice_evaluation_logging.servicer import EvalLogServicer
from sluice_evaluation_logging.similarity_worker import SimilarityWorker, WorkerSettings
from sluice_evaluation_logging.store import open_store

log = structlog.stdlib.get_logger("sluice.evallog")

SERVICE_NAME = evallog_pb2.DESCRIPTOR.services_by_name["EvalLogService"].full_name


def eval_settings(config: EvalLogConfig) -> EvalSettings:
    return EvalSettings(
        latency_slo_ms=config.latency_slo_ms,
        ttft_slo_ms=config.ttft_slo_ms,
        repetition_ngram=config.repetition_ngram,
        repetition_max_ratio=config.repetition_max_ratio,
        similarity_sample_rate=config.similarity_sample_rate,
        similarity_min=config.similarity_min,
        reference_similarity_min=config.reference_similarity_min,
    )


async def serve(config: EvalLogConfig) -> None:
    try:
        tenants = TenantDirectory.from_file(config.tenants_file)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"evaluation-logging: cannot load {ENV_PREFIX}TENANTS_FILE: {exc}") from None
    store = open_store(config.database_url, config.sqlite_path, config.pg_schema)
    try:
        await store.open()
    except Exception as exc:  # noqa: BLE001 - refuse to start without a store, with the reason
        where = "PostgreSQL (DATABASE_URL)" if config.database_url else f"SQLite at {config.sqlite_path}"
        raise SystemExit(f"evaluation-logging: cannot open the store, {where}: {exc}") from None
    embedder = AdapterEmbedder(config.adapter_url, config.embedding_model, config.embed_timeout_s, config.adapter_tls.for_channel())
    settings = eval_settings(config)
    # The CPU-heavy evaluators in worker processes, started (and warmed up) before consuming.
    pool = EvalPool(config.eval_processes) if config.eval_processes > 0 else None
    if pool is not None:
        try:
            await pool.start()
        except Exception as exc:  # noqa: BLE001 - refuse to start without the workers, with the reason
            raise SystemExit(f"evaluation-logging: cannot start {config.eval_processes} evaluation process(es): {exc}") from None
    consumer = CompletionConsumer(
        ConsumerSettings(
            url=config.amqp_url,
            topology=EventTopology(config.amqp_prefix),
            prefetch=config.prefetch,
            batch_max=config.batch_max,
            batch_delay_s=config.batch_delay_s,
        ),
        store,
        EvalContext(settings, embedder, defer_model_calls=True),
        on_pending=lambda: worker.nudge(),
        offload=pool.evaluate if pool is not None else None,
    )
    # Similarity off the consume path: records carry a pending marker, this task scores them,
    # giving way while the consumer has a backlog.
    worker = SimilarityWorker(
        store,
        embedder,
        settings,
        WorkerSettings(
            batch_max=config.similarity_batch_max,
            claim_lease_s=config.similarity_lease_s,
            max_pause_s=config.similarity_max_pause_s,
            embed_timeout_s=config.embed_timeout_s,
        ),
        busy=consumer.busy,
    )
    servicer = EvalLogServicer(
        tenants,
        EvalLogQueries(store),
        EvalContext(settings, embedder),
        ScoreSlots(config.score_max_concurrent_per_tenant),
        offload=pool.evaluate if pool is not None else None,
    )

    def register(server):  # type: ignore[no-untyped-def]
        evallog_pb2_grpc.add_EvalLogServiceServicer_to_server(servicer, server)
        return [SERVICE_NAME]

    running = await create_server(config.host, config.port, config.metrics_port, register, serving=False, tls=config.server_tls(ENV_PREFIX))
    running.supervisor.start("event-loop-lag", monitor_loop_lag)
    consumer.start(running.supervisor)
    worker.start(running.supervisor)
    await running.set_serving(True)
    log.info("ready", store="postgresql" if config.database_url else str(config.sqlite_path), prefix=config.amqp_prefix)

    async def on_stop() -> None:
        await consumer.stop()
        if pool is not None:
            await pool.close()
        await worker.stop()
        await embedder.close()
        await store.close()

    await serve_until_signal(running, config.shutdown_grace_s, on_stop)


def main() -> None:
    run_service("evaluation-logging", EvalLogConfig, ENV_PREFIX, serve)


if __name__ == "__main__":
    main()
