"""`python -m sluice_gateway.jobs.worker`: the gateway's job-worker role (bulk jobs from RabbitMQ).

Two consumers on one robust connection (queues and exchange: sluice_common.amqp.JobTopology):

- `<prefix>.jobs.requests`: a producer's JobRequest (JSON or protobuf; its api_key is checked
  here, once), or an AdmittedJob (AMQP type sluice.jobs.v1.AdmittedJob: a job the gateway admitted,
  under its tenant's name, no key; not authenticated again). Another `sluice.` type (a newer
  gateway's) is dead-lettered to `<prefix>.jobs.dead` with its reason, to replay once the workers
  know it (a producer's api_key taken out of the copy). Malformed: a JobRejection to its reply_to
  (never to one naming a queue under the AMQP prefix or `amq.`: forbidden_reply_to), acked. Accepted: the job and its rows are
  recorded, one RowTask per row is published
  to `<prefix>.jobs.rows` (pipelined confirms), and only then is the job message acked. A worker
  killed mid-split gets the job redelivered to someone, who republishes the rows not yet finished.
- `<prefix>.jobs.rows`, consumed with a prefetch that follows the adaptive concurrency bound (at
  most WORKER_PREFETCH; RabbitMQ applies a changed basic.qos only to consumers started after it, so
  the worker consumes again, and cancels the consumer it replaces, when the bound moves). A message
  whose AMQP type is not the row type, or that names another tenant than its job's, is
  dead-lettered unrun; a row runs as its job's tenant, text-logging setting and reply_to. Each row
  takes a slot of the bound, is claimed in the
  store (a copy of a row that is done, or of a cancelled job, is acked without running; a
  redelivered copy of a row another worker runs and still beats for waits for it, see below), runs through the interactive path in the bulk class (inference_path), its result is
  stored (once, by (job id, custom id)), told to reply_to (confirmed), and only then acked.
  RESOURCE_EXHAUSTED: wait as told, retry (a request larger than the whole allowance, which
  comes without a time to retry, fails the row). Transient errors: capped exponential backoff with
  jitter, then back to the broker; past WORKER_DELIVERY_LIMIT deliveries (the quorum queue's
  x-delivery-count) the row is dead-lettered to `<prefix>.jobs.dead` and reported failed. An
  attempt its deadline cut off is retried in-process with twice that deadline, and fails
  (DEADLINE_EXCEEDED) once cut off at WORKER_ROW_TIMEOUT_CEILING_S (row_deadline.py).
  A row expected to end more than WORKER_ROW_TIMEOUT_FLOOR_S after its job's completion window is
  not run: it fails at once with code TOO_LONG_FOR_WINDOW.
  A row claimed after its job's completion window ended is not run: it is stored and told as a
  failed result with code EXPIRED (once, like any result), so every row is still reported.
- When a job's last row is stored (it is then finalizing), the worker that stored it tells the
  job's summary (a Job message, id `<job_id>/summary`) to reply_to, then marks it completed.
- A sweep every SWEEP_INTERVAL_S: overdue in_progress jobs -> expired, and the summaries still
  due (a finalizing job whose worker died, a cancelled job, an expired one whose rows are all
  stored) are told; a repeat carries the same message id, for consumers to drop. Rows of an
  expired job that no message will end (the broker dead-lettered theirs) get a result there too,
  and a cancelling job's rows whose worker stopped beating are cancelled, so that the job ends.
- A heartbeat every HEARTBEAT_S (store.py): one statement marks the rows this worker runs alive. The
  broker redelivers the messages of a lost channel (a broker restart, a network blip) while their
  worker may live on: a copy that reaches another worker takes the row over only once its heartbeat
  is stale (its worker died); until then it waits, unacked and without a slot, and asks again, so
  the row runs once and still has a message should its worker die or give it back. A worker that
  stops drops the heartbeat of the rows it abandons, for their copies to run at once.
- No row message stays unacked past the broker's consumer timeout (WORKER_CONSUMER_TIMEOUT_S; past
  it RabbitMQ closes the channel and requeues every row on it, each delivery counted): a message
  that has waited WorkerSettings.slot_wait_s for a slot (or for the worker that runs its row) is
  handed back unstarted, a copy published (confirmed) and the message acked, so that no delivery
  is counted against the row; what is left of the timeout covers an attempt at the row ceiling,
  which the settings refuse to set longer. A row's retries (an attempt its deadline cut, a wait as
  RESOURCE_EXHAUSTED told, a backoff, the slot before each) run in the same delivery only while the
  next attempt can end within WorkerSettings.hold_s of it: otherwise the row is released and handed
  back the same way, its message carrying where its retries stand (RetryChain: the deadline that
  cut its last attempt, its transient errors), and its next delivery goes on from there.
- A message whose handling fails unexpectedly (the job store unreachable) goes back to the broker
  after a backoff that doubles with its deliveries (FAILURE_BACKOFF_S), not at once: the queue's
  delivery limit would dead-letter every message of a short outage unrun.

Health (gRPC) on WORKER_PORT and Prometheus metrics on WORKER_METRICS_PORT.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import aio_pika
import structlog
from google.protobuf.message import DecodeError
from prometheus_client import Counter, Gauge
from sluice.jobs.v1 import jobs_pb2

from sluice_common.amqp import PROTOBUF, JobTopology, dead_letter
from sluice_common.bootstrap import run_service
from sluice_common.errors import InvalidArgument
from sluice_common.loop_lag import monitor_loop_lag
from sluice_common.request_context import MAX_REQUEST_ID, bind_request_id, current_request_id, is_metadata_text, new_request_id
from sluice_common.server import PUBLISHER_FLUSH_S, create_server, serve_until_signal
from sluice_common.supervision import Supervisor, stop_tasks
from sluice_common.tracing import header_text
from sluice_gateway.jobs import store as states
from sluice_gateway.jobs.concurrency import FAILED, OK, THROTTLED, AdaptiveConcurrency
from sluice_gateway.config import ENV_PREFIX, SharedSettings, WorkerConfig, WorkerSettings
from sluice_gateway.path.core import GatewayCore
from sluice_gateway.jobs.store import JobRecord, JobStore
from sluice_gateway.jobs.trace import attempt_span, job_span, row_span, with_trace_context
from sluice_gateway.jobs.job import (
    EXPIRED_CODE,
    JSON,
    SUMMARY_SUFFIX,
    TRANSIENT,
    ADMITTED_TYPE,
    JobRejected,
    PoisonRow,
    authenticate_job,
    backoff_s,
    code_of,
    completion_window_s,
    cut_at_ceiling_result,
    encode_reply,
    expired_result,
    failed_result,
    forbidden_reply_to,
    is_paced,
    job_message_type,
    message_of,
    paced_delay_s,
    parse_admitted,
    parse_job,
    retry_after_of,
    row_tasks,
    run_row,
    too_long_for_window,
    validate_job,
    without_api_key,
)
from sluice_gateway.jobs.row_deadline import RowDeadlines, RowTiming
from sluice_gateway.jobs_port import MAX_MESSAGE_ID_BYTES

log = structlog.stdlib.get_logger("sluice.gateway.worker")

ROWS = Counter(
    "sluice_jobs_rows_total",
    "Row messages settled by this worker, by outcome (handed_back: unstarted, after waiting WorkerSettings.slot_wait_s;"
    " handed_back_retrying: between two attempts, the next one unable to end within WorkerSettings.hold_s of the delivery).",
    ["outcome"],
)
JOBS = Counter("sluice_jobs_accepted_total", "Job messages handled, by outcome (accepted, rejected, dead_lettered).", ["outcome"])
LIMIT = Gauge("sluice_jobs_concurrency_limit", "The adaptive bound on rows in flight.")
IN_FLIGHT = Gauge("sluice_jobs_rows_in_flight", "Rows running now.")
# Health stays SERVING while the broker is away (the robust connection reconnects by itself, and a
# restart would not bring the broker back): this gauge, and its alert
# (SluiceJobWorkerBrokerDisconnected), is how an operator hears that no row is being consumed.
BROKER_CONNECTED = Gauge("sluice_jobs_worker_broker_connected", "1 while the job worker's RabbitMQ connection is up (read every heartbeat).")
RETRIES = Counter("sluice_jobs_row_retries_total", "Row attempts retried, by status code.", ["code"])
# Exported at 0 from the start: increase() over a series that first appears at 3 is 0, and the
# alert on dead-lettered rows would miss a first burst.
for _outcome_label in ("completed", "failed", "expired", "dead_lettered", "given_back", "cancelled", "handed_back", "handed_back_retrying"):
    ROWS.labels(_outcome_label)
for _outcome_label in ("accepted", "rejected", "dead_lettered"):
    JOBS.labels(_outcome_label)
ROW_TIMEOUT = Gauge(
    "sluice_jobs_row_timeout_seconds",
    "The deadline last given to a row attempt, by kind (generate: it grows with max_tokens; embed): multiplier x"
    " this worker's rolling p99s, within WORKER_ROW_TIMEOUT_FLOOR_S and WORKER_ROW_TIMEOUT_CEILING_S (until enough"
    " rows are seen: WORKER_ROW_TIMEOUT_S, or max_tokens x WORKER_ROW_WARMUP_PER_TOKEN_S x multiplier if longer);"
    " twice the deadline that cut off the row's last attempt, when one did.",
    ["kind"],
)
ROW_TIMEOUTS = Counter(
    "sluice_jobs_row_timeouts_total",
    "Row attempts their deadline cut off, by kind: each is retried with a longer deadline, or fails when cut at the ceiling.",
    ["kind"],
)
ROW_TYPE = jobs_pb2.RowTask.DESCRIPTOR.full_name
# A row message's header naming its job's request id, which the row's log lines carry as job_request_id.
JOB_REQUEST_ID_HEADER = "x-sluice-job-request-id"
# A row message handed back unstarted (_hand_back): the deliveries it had had (the broker's
# x-delivery-count of the message it copies, which the copy starts again without), and whether it was
# a redelivered copy (which waits for the worker that runs its row rather than being acked).
EARLIER_DELIVERIES_HEADER = "x-sluice-earlier-deliveries"
REDELIVERED_HEADER = "x-sluice-redelivered"
# A row message handed back between two attempts: where its retries stand (RetryChain).
CUT_AT_HEADER = "x-sluice-row-cut-at-s"
TRANSIENT_ERRORS_HEADER = "x-sluice-row-transient-errors"
RESULT_TYPE = jobs_pb2.RowResult.DESCRIPTOR.full_name
REJECTION_TYPE = jobs_pb2.JobRejection.DESCRIPTOR.full_name
SUMMARY_TYPE = jobs_pb2.Job.DESCRIPTOR.full_name
SPLIT_CHUNK = 1000
GIVE_BACK = object()
# The sweep: how often, and how long a summary may stay due before the sweep tells it (longer than
# a worker takes between storing a job's last row and telling its summary, so as not to race it).
SWEEP_INTERVAL_S = 2.0
SUMMARY_GRACE_S = 5.0
# How long after its completion window a job SubmitJob recorded may still be waiting for its
# AdmittedJob to reach a worker (a broker that was slow to deliver) before the sweep fails it.
UNADMITTED_GRACE_S = 60.0
# How long after its job's window a row may stay pending before the sweep ends it as EXPIRED (its
# message was dead-lettered or lost; one still queued would only be claimed as EXPIRED anyway).
# A running row waits the row deadline's ceiling more: its attempt may still be running.
STRANDED_PENDING_GRACE_S = 60.0
# Before a message whose handling failed unexpectedly (a database outage) goes back to the broker:
# the broker dead-letters a message at its delivery limit, so retrying at once would spend that
# limit in seconds.
FAILURE_BACKOFF_S = (0.5, 30.0)
# The most stop() waits for the broker to answer its consumers' cancels (side by side): the rows'
# drain, the heartbeats' drop and the flush come after them (_cancel_consumers).
CONSUMER_CANCEL_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class RetryChain:
    """Where a row's retries stand: the deadline that cut off its last attempt (the next one gets
    twice that: RowDeadlines.for_row) and the transient errors it has had (WORKER_ROW_ATTEMPTS).
    A message handed back between two attempts carries it, so that its next delivery goes on from
    there: started over, a row an overloaded engine keeps cutting would be tried again at its first
    deadline on every delivery, never reaching the ceiling (where it fails), and a row that keeps
    failing transiently would never be given back to the broker, whose deliveries bound it."""

    cut_at_s: float | None = None
    transient_errors: int = 0

    @classmethod
    def of(cls, message: aio_pika.abc.AbstractIncomingMessage) -> RetryChain:
        headers = message.headers or {}
        return cls(_header_number(headers, CUT_AT_HEADER) or None, int(_header_number(headers, TRANSIENT_ERRORS_HEADER)))

    def headers(self) -> dict[str, Any]:
        return {CUT_AT_HEADER: self.cut_at_s or 0.0, TRANSIENT_ERRORS_HEADER: self.transient_errors}


@dataclass(frozen=True)
class HandBack:
    """_attempts' outcome when the row's next attempt (or the wait before it) could not end within
    WorkerSettings.hold_s of its message's delivery: the message goes back carrying `chain`."""

    chain: RetryChain
    next_deadline_s: float
    after: str  # the status code of the attempt before, for the log


class _Slot:
    """A row's concurrency slot: taken, then given back once with its attempt's outcome."""

    def __init__(self, take: Callable[[], Awaitable[None]], give_back: Callable[[float, str, float | None], Awaitable[None]]) -> None:
        self._take, self._give_back = take, give_back
        self.held = True  # the row's first attempt runs on the slot its message was taken with

    async def take(self) -> None:
        await self._take()
        self.held = True

    async def give_back(self, latency_s: float, outcome: str, rate: float | None = None) -> None:
        if self.held:
            self.held = False
            await self._give_back(latency_s, outcome, rate)


class JobWorker:
    def __init__(self, shared: SharedSettings, config: WorkerSettings, core: GatewayCore, store: JobStore) -> None:
        self.shared = shared
        self.config = config
        self.core = core
        self.store = store
        self.topology = JobTopology(shared.amqp_prefix)
        self.worker_id = f"worker-{uuid.uuid4().hex[:12]}"
        self.concurrency = AdaptiveConcurrency(initial=config.concurrency_initial, maximum=config.concurrency_max)
        self.row_deadlines = RowDeadlines.for_settings(shared, config)
        self._tasks: set[asyncio.Task[None]] = set()
        self._consumers: list[tuple[Any, str]] = []
        self._rows_queue: Any = None
        self._rows_tag = ""
        self._prefetch = 0  # the rows consumer's, following the concurrency bound (_follow_bound)
        self._refollow: asyncio.Task[None] | None = None
        self._stopping = False
        # (job id, custom id) -> set when this process's run of that row ends (_row).
        self._running: dict[tuple[str, str], asyncio.Event] = {}
        self._connection: Any = None
        self._rows_channel: Any = None
        self._exchange: Any = None
        self._dead: Any = None
        self._sweeper: asyncio.Task[None] | None = None
        self._heartbeat: asyncio.Task[None] | None = None

    # ---- lifecycle

    async def start(self, supervisor: Supervisor | None = None) -> None:
        self._connection = await aio_pika.connect_robust(self.shared.amqp_url, timeout=10)
        jobs_channel = await self._connection.channel(publisher_confirms=True)
        await self.topology.declare(jobs_channel)
        await jobs_channel.set_qos(prefetch_count=2)
        self._rows_channel = await self._connection.channel(publisher_confirms=True)
        self._prefetch = self._prefetch_wanted()
        await self._rows_channel.set_qos(prefetch_count=self._prefetch)
        self._exchange = await jobs_channel.get_exchange(self.topology.exchange)
        self._dead = await self._rows_channel.get_exchange(self.topology.dead_exchange)
        requests = await jobs_channel.get_queue(self.topology.requests_queue)
        self._rows_queue = await self._rows_channel.get_queue(self.topology.rows_queue)
        self._consumers = [(requests, await requests.consume(self._spawn(self._on_job)))]
        self._rows_tag = await self._rows_queue.consume(self._spawn(self._on_row))
        supervisor = supervisor or Supervisor()
        self._sweeper = supervisor.start("job-sweeper", self._sweep_forever)
        self._heartbeat = supervisor.start("job-row-heartbeat", self._heartbeat_forever)
        LIMIT.set(self.concurrency.limit)
        BROKER_CONNECTED.set(self._broker_connected())
        log.info("job_worker_started", worker=self.worker_id, prefix=self.shared.amqp_prefix)

    def _spawn(self, handler: Any) -> Any:
        async def consume(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            task = asyncio.create_task(handler(message))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        return consume

    async def stop(self, grace_s: float) -> None:
        """No new deliveries, and rows waiting for a slot go back to the broker unstarted; the rows
        running get `grace_s` to finish, then are abandoned unacked: the broker redelivers them."""
        self._stopping = True
        if self._refollow is not None:
            await stop_tasks(self._refollow)  # before the cancels: it could consume again after them
        await self._cancel_consumers()
        if self._sweeper is not None:
            await stop_tasks(self._sweeper)
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=grace_s)
        await stop_tasks(*self._tasks)
        await self._stop_heartbeat()
        if self._connection is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._connection.close(), 5)

    async def _cancel_consumers(self) -> None:
        """No new deliveries, within CONSUMER_CANCEL_TIMEOUT_S in all: on the robust connection a
        cancel during a broker outage waited for the reconnection, so a SIGTERM then never reached
        the rows' drain, the heartbeats' drop or the flush of the completion events after stop()
        (spilled to disk only there): the pod was killed and the events lost. Disconnected, the
        broker has dropped the consumers with the channel already: only their restoration on a
        reconnection is called off (no wait)."""
        connected = self._connection is not None and self._connection.connected.is_set()
        timeout_s = CONSUMER_CANCEL_TIMEOUT_S if connected else 0.0
        consumers = [(queue, tag) for queue, tag in [*self._consumers, (self._rows_queue, self._rows_tag)] if queue is not None]
        await asyncio.gather(*(_cancel_consumer(queue, tag, timeout_s) for queue, tag in consumers))

    # ---- the rows consumer's prefetch, following the concurrency bound

    def _prefetch_wanted(self) -> int:
        return max(1, min(self.config.prefetch, self.concurrency.bound))

    def _bound_moved(self) -> None:
        """After a release: when the bound moved, the rows consumer is started again with it."""
        if self._rows_queue is None or self._stopping or self._prefetch_wanted() == self._prefetch:
            return
        if self._refollow is None or self._refollow.done():
            self._refollow = asyncio.create_task(self._follow_bound())

    async def _follow_bound(self) -> None:
        """RabbitMQ applies a changed basic.qos to the consumers started after it only, so: the new
        prefetch, a new consumer, then the old one cancelled (its messages in hand stay this
        channel's, settled as usual; the broker sends it no more once its cancel is answered). A
        prefetch larger than the bound left rows unacked, waiting for a slot, past the broker's
        consumer timeout."""
        try:
            while not self._stopping and (wanted := self._prefetch_wanted()) != self._prefetch:
                await self._rows_channel.set_qos(prefetch_count=wanted)
                tag = await self._rows_queue.consume(self._spawn(self._on_row))
                replaced, self._rows_tag, self._prefetch = self._rows_tag, tag, wanted
                await self._rows_queue.cancel(replaced)
                log.info("row_prefetch_changed", prefetch=wanted)
        except Exception:  # noqa: BLE001 - a broker hiccup: the next move of the bound tries again; waits stay bounded (_claim)
            log.warning("row_prefetch_not_changed", exc_info=True)

    async def _stop_heartbeat(self) -> None:
        """After the drain: the rows still running here were just abandoned (their messages go back
        to the broker with the connection), so their heartbeat is dropped for other workers to take
        them over at once rather than after HEARTBEAT_STALE_S."""
        if self._heartbeat is not None:
            await stop_tasks(self._heartbeat)
        try:
            await self.store.drop_heartbeats(self.worker_id)
        except Exception:  # noqa: BLE001 - their heartbeat goes stale on its own
            log.warning("row_heartbeats_not_dropped", exc_info=True)

    def _broker_connected(self) -> bool:
        return self._connection is not None and self._connection.connected.is_set()

    async def _heartbeat_forever(self) -> None:
        """Every HEARTBEAT_S, the rows this process runs now (the store refreshes only those this
        worker claimed and that are still running), in one statement: no task per row."""
        while True:
            await asyncio.sleep(states.HEARTBEAT_S)
            BROKER_CONNECTED.set(self._broker_connected())
            if not self._running:
                continue
            try:
                await self.store.heartbeat(self.worker_id, list(self._running))
            except Exception:  # noqa: BLE001 - a store hiccup: the next beat comes well within the stale bound
                log.exception("row_heartbeat_failed")

    # ---- jobs

    async def _on_job(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        # As a row reads its job's (_on_row): the same text, so that the job's lines and its rows' match.
        bind_request_id(_header_request_id(message.headers, "x-request-id") or new_request_id())
        try:
            with job_span(message, self.topology.requests_queue):
                await self._job(message)
        except Exception:  # noqa: BLE001 - unexpected: the broker redelivers (and dead-letters at its limit)
            log.exception("job_message_failed")
            await _give_back_later(message)

    async def _job(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        content_type = message.content_type or ""
        kind = job_message_type(message.type or "")
        if kind is None:
            await self._dead_letter_job(message, f"unknown message type {message.type!r}: this job worker does not know it")
            return
        try:
            if kind == ADMITTED_TYPE:  # the gateway authenticated its caller: no key, the tenant's name
                job, tenant = parse_admitted(message.body, content_type, message.reply_to or "")
            else:  # a producer's JobRequest: its key is checked here, once
                job = parse_job(message.body, content_type, message.reply_to or "")
                tenant = authenticate_job(job, self.core.tenants)
            validate_job(job, tenant.name, self.shared.jobs_max_rows, self.shared.amqp_prefix)
            window_s = completion_window_s(job, self.shared.jobs_completion_window_s)
            custom_ids = [r.custom_id for r in job.rows]
            record, open_rows = await self.store.accept(
                job.job_id, tenant.name, job.reply_to, custom_ids, window_s, _reply_type(content_type), tenant.text_logging
            )
        except (JobRejected, InvalidArgument) as exc:
            rejection = exc if isinstance(exc, JobRejected) else JobRejected(exc.message, job.job_id, job.reply_to)
            await self._reject(rejection, content_type)
            await message.ack()
            return
        if open_rows:
            tasks = row_tasks(job, tenant, content_type, open_rows)
            for start in range(0, len(tasks), SPLIT_CHUNK):
                await asyncio.gather(*(self._publish_row(task) for task in tasks[start : start + SPLIT_CHUNK]))
        await self.store.mark_split(job.job_id)
        await message.ack()
        JOBS.labels("accepted").inc()
        log.info(
            "job_accepted", job_id=job.job_id, tenant=tenant.name, rows=len(job.rows), published=len(open_rows), state=record.state,
            admitted=kind == ADMITTED_TYPE,
        )  # fmt: skip

    async def _dead_letter_job(self, message: aio_pika.abc.AbstractIncomingMessage, reason: str) -> None:
        """A job message this worker cannot read (e.g. a type from a newer gateway during an upgrade
        done in the wrong order): kept in `<prefix>.jobs.dead` with its reason, to be replayed once
        the workers know it, rather than misread or dropped. A producer's api_key is taken out of
        the copy (without_api_key): the dead-letter queue is read by operators, and a key has no
        business there; replayed, such a job is rejected for want of a key (JobRejection "api_key:
        ...") and its producer publishes it again."""
        redacted = without_api_key(message.body, message.content_type or "", message.type or "", self.core.tenants)
        if redacted is not None:
            reason = f"{reason}; its api_key was removed from this copy"
        JOBS.labels("dead_lettered").inc()
        log.error("job_message_dead_lettered", reason=reason, message_type=message.type, message_id=message.message_id)
        await dead_letter(self._dead, self.topology.job_routing_key, message, reason, body=redacted)
        await message.ack()

    async def _publish_row(self, task: jobs_pb2.RowTask) -> None:
        await self._exchange.publish(
            aio_pika.Message(
                task.SerializeToString(),
                content_type=PROTOBUF,
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                message_id=amqp_id(f"{task.job_id}/{task.row.custom_id}"),  # fits: validate_job
                type=ROW_TYPE,
                headers=with_trace_context(
                    # The job's request id (SubmitJob's, or the producer's x-request-id): each row's
                    # own request id is new, and its log lines name this one as job_request_id.
                    {"x-sluice-job-id": task.job_id, "x-sluice-custom-id": task.row.custom_id, JOB_REQUEST_ID_HEADER: current_request_id()}
                ),
            ),
            self.topology.row_routing_key,
        )

    async def _reject(self, rejection: JobRejected, content_type: str) -> None:
        JOBS.labels("rejected").inc()
        if rejection.reply_to and (forbidden := forbidden_reply_to(rejection.reply_to, self.shared.amqp_prefix)):
            # Whatever else was wrong with the job: a rejection is told to no internal queue either.
            log.warning("job_rejection_not_told", job_id=rejection.job_id[:MAX_MESSAGE_ID_BYTES], reason=forbidden)
            rejection.reply_to = ""
        log.warning("job_rejected", job_id=rejection.job_id, reason=rejection.reason, reply_to=rejection.reply_to)
        if rejection.job_id and rejection.tenant:
            await self.store.record_failed(rejection.job_id, rejection.tenant, rejection.reply_to, rejection.reason)
        if rejection.reply_to:
            body = jobs_pb2.JobRejection(job_id=rejection.job_id, reason=rejection.reason)
            try:
                await self._reply(rejection.reply_to, body, _reply_type(content_type), f"{rejection.job_id}/rejected", REJECTION_TYPE)
            except Exception:  # noqa: BLE001 - the job is refused either way: retried, it would only fail again
                log.exception("job_rejection_not_told", job_id=rejection.job_id[:MAX_MESSAGE_ID_BYTES], reply_to=rejection.reply_to)

    async def _reply(self, reply_to: str, body: Any, content_type: str, message_id: str, kind: str) -> None:
        """Publishes a reply to the default exchange, routed to the queue named `reply_to`: never to
        a forbidden_reply_to (one of Sluice's own queues, or the broker's), which validate_job
        refuses, but which a job accepted before it did, or a row message, may still name."""
        job_id = getattr(body, "job_id", "") or ""
        if forbidden := forbidden_reply_to(reply_to, self.shared.amqp_prefix):
            log.warning("reply_not_told", message_id=message_id[:MAX_MESSAGE_ID_BYTES], message_type=kind, reason=forbidden)
            return
        await self._rows_channel.default_exchange.publish(
            aio_pika.Message(
                encode_reply(body, content_type),
                content_type=content_type,
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                message_id=amqp_id(message_id),
                # The job id whole or not at all (the body names it anyway): a rejected job's id may be
                # any length, and AMQP's shortstr holds 255 bytes.
                correlation_id=job_id if 0 < len(job_id.encode()) <= MAX_MESSAGE_ID_BYTES else None,
                type=kind,
            ),
            reply_to,
        )

    # ---- rows

    async def _on_row(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        received = time.monotonic()  # the broker's consumer timeout runs from its delivery
        job_request_id = _header_request_id(message.headers, JOB_REQUEST_ID_HEADER)
        bind_request_id(new_request_id(), **({"job_request_id": job_request_id} if job_request_id else {}))
        try:
            with row_span(message, self.topology.rows_queue):
                await self._row(message, received)
        except asyncio.CancelledError:
            raise  # stopping: unacked, so the broker redelivers it
        except Exception:  # noqa: BLE001 - unexpected: give it back; the delivery limit stops a loop
            log.exception("row_failed_unexpectedly")
            await _give_back_later(message)

    async def _row(self, message: aio_pika.abc.AbstractIncomingMessage, received: float | None = None) -> None:
        # Only a RowTask is read as one: every message Sluice puts on this queue (the split, a
        # hand-back's copy, a replay of a dead letter) has its type. Another message here (a reply
        # misrouted by a reply_to naming this queue: a RowResult whose fields decode as a RowTask of
        # any tenant) is set aside, never run.
        if message.type != ROW_TYPE:
            await self._dead_letter_row_message(message, f"not a row message: AMQP type {message.type!r}, not {ROW_TYPE!r}")
            return
        try:
            task = jobs_pb2.RowTask.FromString(message.body)
        except DecodeError:
            task = jobs_pb2.RowTask()
        if not task.job_id or not task.row.custom_id:
            await self._dead_letter_row_message(message, "undecodable row message")
            return
        structlog.contextvars.bind_contextvars(job_id=task.job_id, custom_id=task.row.custom_id)
        key = (task.job_id, task.row.custom_id)
        # A copy of a row this worker is running now: the broker redelivered it after the channel
        # was lost (a broker restart, a network blip), while the first run goes on here. Run once:
        # the copy waits, then finds the row stored (and is acked) or, if the run was given back,
        # runs it itself.
        while (running := self._running.get(key)) is not None:
            log.info("row_copy_waits_for_its_run", redelivered=_redelivered(message))
            await running.wait()
        self._running[key] = ended = asyncio.Event()
        try:
            await self._run_row(task, message, time.monotonic() if received is None else received)
        finally:
            del self._running[key]
            ended.set()

    async def _dead_letter_row_message(self, message: aio_pika.abc.AbstractIncomingMessage, reason: str) -> None:
        """A message on the rows queue that is no row to run: to `<prefix>.jobs.dead` with its
        reason, acked; no row's result is stored for it (it may name a row it has no right to end)."""
        log.warning("row_message_dead_lettered", reason=reason, message_type=message.type, message_id=message.message_id)
        await dead_letter(self._dead, self.topology.row_routing_key, message, reason)
        await message.ack()
        ROWS.labels("dead_lettered").inc()

    async def _run_row(self, task: jobs_pb2.RowTask, message: aio_pika.abc.AbstractIncomingMessage, received: float) -> None:
        deliveries = _deliveries(message)
        claimed = await self._claim(task, message, received)
        if claimed is None:
            return
        claim = claimed.state
        if claim == states.WRONG_TENANT:  # nothing was claimed: the slot taken for it goes back
            await self._release_unused_slot()
            job_tenant = claimed.job.tenant if claimed.job is not None else ""
            await self._dead_letter_row_message(message, f"the row message names tenant {task.tenant!r}; its job {task.job_id!r} is {job_tenant!r}'s")
            return
        task = _as_its_job(task, claimed.job)
        holding = True
        try:
            if claim == states.DONE and _redelivered(message):
                # Stored before a crash, or by the worker this copy waited for on a channel that may
                # be lost, so maybe not told: tell again (consumers dedupe by message id).
                result = await self.store.row_result(task.job_id, task.row.custom_id)
                if result is not None:
                    await self._tell(task, result)
            if claim == states.OVERDUE:
                await self._finish(task, await self._expired(task), message)
                return
            if claim != states.CLAIMED:
                await message.ack()
                return
            if deliveries > self.config.delivery_limit:
                reason = f"dead-lettered after {deliveries - 1} deliveries"
                await self._dead_letter(task, message, reason)
                return
            holding = False  # _attempts owns the slot from here
            outcome = await self._attempts(task, received, RetryChain.of(message))
        finally:
            if holding:
                await self._release_unused_slot()
        if isinstance(outcome, HandBack):
            # Released first, for the copy to find the row pending and claim it. Not released: another
            # worker took the row over (this one's heartbeat went stale) or it ended; its message is done.
            if await self.store.release_row(task.job_id, task.row.custom_id, self.worker_id):
                await self._hand_back(message, _redelivered(message), received, outcome)
            else:
                await message.ack()
        elif outcome is GIVE_BACK:
            await self.store.release_row(task.job_id, task.row.custom_id, self.worker_id)
            await message.nack(requeue=True)
            ROWS.labels("given_back").inc()
        elif isinstance(outcome, PoisonRow):
            await self._dead_letter(task, message, str(outcome))
        elif outcome is None:  # the job was cancelled while the row waited to retry
            await self.store.release_row(task.job_id, task.row.custom_id, self.worker_id)
            await message.ack()
            ROWS.labels("cancelled").inc()
        else:
            await self._finish(task, outcome, message)

    async def _claim(self, task: jobs_pb2.RowTask, message: aio_pika.abc.AbstractIncomingMessage, received: float) -> states.Claim | None:
        """Takes a concurrency slot and claims the row: the claim's answer, with the slot held; None
        when the worker began to stop meanwhile (the message went back unstarted, no slot held), or
        when the message waited WorkerSettings.slot_wait_s since `received` (its delivery) and was
        handed back unstarted (_hand_back): an attempt at the ceiling must still end within the
        broker's consumer timeout.

        A redelivered copy of a row another worker runs and still beats for (BUSY) is neither run
        (twice) nor acked (should that worker die, or give the row back with its nack lost on its
        channel, this copy is the row's only message): it waits without a slot and asks again every
        HEARTBEAT_S, until the row is stored (DONE), pending again, or its heartbeat is stale. It
        waits here, not in the broker: every delivery counts against WORKER_DELIVERY_LIMIT."""
        waiting = False
        redelivered = _redelivered(message)
        hand_back_at = received + self.config.slot_wait_s
        while True:
            try:
                await asyncio.wait_for(self.concurrency.acquire(), max(0.0, hand_back_at - time.monotonic()))
            except TimeoutError:
                await self._hand_back(message, redelivered, received)
                return None
            if self._stopping:  # it waited for a slot while the worker began to stop: not started here
                await self._release_unused_slot()
                await message.nack(requeue=True)
                return None
            IN_FLIGHT.set(self.concurrency.in_flight)
            try:
                claim = await self.store.claim(task.job_id, task.row.custom_id, self.worker_id, redelivered, tenant=task.tenant)
            except BaseException:
                await self._release_unused_slot()
                raise
            if claim.state != states.BUSY or not redelivered:
                return claim
            await self._release_unused_slot()
            if time.monotonic() + states.HEARTBEAT_S >= hand_back_at:
                await self._hand_back(message, redelivered, received)
                return None
            if not waiting:
                log.info("row_copy_waits_for_its_other_worker")
                waiting = True
            await asyncio.sleep(states.HEARTBEAT_S)

    async def _hand_back(
        self, message: aio_pika.abc.AbstractIncomingMessage, redelivered: bool, received: float, retrying: HandBack | None = None
    ) -> None:
        """Back to the queue unstarted (or, `retrying`, between two attempts, the row released),
        without a delivery counted against the row: a copy (its deliveries so far, whether it was a
        redelivery, and where its retries stand, in headers of its own) published with a confirm,
        then the message acked. A nack would count: x-delivery-count on RabbitMQ 3, and the queue's
        x-delivery-limit on 4 too, spent by rows that never ran or were only waiting."""
        headers = dict(message.headers or {})
        headers.pop("x-delivery-count", None)
        headers[EARLIER_DELIVERIES_HEADER] = _deliveries(message) - 1
        if redelivered:
            headers[REDELIVERED_HEADER] = True
        if retrying is not None:
            headers.update(retrying.chain.headers())
        copy = aio_pika.Message(
            message.body,
            content_type=message.content_type,
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            message_id=message.message_id,
            type=message.type,
            headers=headers,
            timestamp=message.timestamp,
        )
        await self._exchange.publish(copy, self.topology.row_routing_key)
        await message.ack()
        held_s = round(time.monotonic() - received, 2)
        if retrying is None:
            ROWS.labels("handed_back").inc()
            log.info("row_handed_back_unstarted", waited_s=held_s, slot_wait_s=self.config.slot_wait_s)
            return
        ROWS.labels("handed_back_retrying").inc()
        log.info(
            "row_handed_back_between_attempts", held_s=held_s, hold_s=self.config.hold_s, after=retrying.after,
            next_deadline_s=round(retrying.next_deadline_s, 2), cut_at_s=retrying.chain.cut_at_s,
            transient_errors=retrying.chain.transient_errors,
        )  # fmt: skip

    async def _release_unused_slot(self) -> None:
        await self.concurrency.release(0.0, "skipped")
        IN_FLIGHT.set(self.concurrency.in_flight)
        self._bound_moved()

    async def _attempts(self, task: jobs_pb2.RowTask, received: float | None = None, chain: RetryChain | None = None) -> Any:
        """A RowResult, GIVE_BACK, a PoisonRow, a HandBack, or None when the job got cancelled
        meanwhile. Called holding a concurrency slot; returns having released it. `received`: when
        the row's message was delivered (now, when not given); `chain`: where the row's retries
        stood when an earlier delivery handed it back.

        An attempt cut off by its deadline is tried again at once with twice that deadline
        (not counted against WORKER_ROW_ATTEMPTS: giving it back to the broker would only restart
        it at the same deadline), until it completes, is cut off at the ceiling (then it fails
        with DEADLINE_EXCEEDED), or no longer fits what is left of its job's completion window.
        So a cut row wastes less than twice the ceiling, and does not start again to end long after
        its job's end. A retry that could not end within WorkerSettings.hold_s of `received` is not
        started here: the row is handed back (HandBack) to go on in its next delivery (_wait_to_retry)."""
        slot = _Slot(self.concurrency.acquire, self._release)
        hold_until = (time.monotonic() if received is None else received) + self.config.hold_s
        try:
            return await self._attempts_with(task, slot, hold_until, chain or RetryChain())
        finally:
            # Still taken only when an attempt failed outside its own handling (a store error, a
            # cancel): given back, or the worker would run one row fewer at a time from then on.
            await slot.give_back(0.0, "skipped")

    async def _attempts_with(self, task: jobs_pb2.RowTask, slot: _Slot, hold_until: float, chain: RetryChain) -> Any:
        """_attempts' loop: each attempt takes the slot (the first has it) and gives it back."""
        job: JobRecord | None = None
        number = 0  # attempts made here, for their spans
        kind = task.row.WhichOneof("body") or "generate"
        timeout_s = self.row_deadlines.for_row(task.row, chain.cut_at_s)
        while True:
            if number:  # a retry, on the slot _wait_to_retry took again
                job = await self.store.get_job(task.job_id)
                overdue = job is not None and job.overdue(time.time())
                if job is None or job.state != states.IN_PROGRESS or overdue:
                    await slot.give_back(0.0, "skipped")
                    # Waiting to retry is not running: past the window the row is reported EXPIRED.
                    if job is not None and (job.state == states.EXPIRED or overdue):
                        return expired_result(task, job.window_s)
                    return None
            too_long = await self._too_long_for_window(task, job, chain.cut_at_s)
            if too_long is not None:
                await slot.give_back(0.0, "skipped")
                return too_long
            started = time.perf_counter()
            IN_FLIGHT.set(self.concurrency.in_flight)
            ROW_TIMEOUT.labels(kind=kind).set(timeout_s)
            try:
                number += 1
                with attempt_span(task, number, timeout_s):
                    run = await run_row(self.core.path, task, _request_id(), timeout_s)
            except PoisonRow as exc:
                await slot.give_back(time.perf_counter() - started, FAILED)
                return exc
            except Exception as exc:  # noqa: BLE001 - classified below
                latency = time.perf_counter() - started
                code = code_of(exc)
                if code == "DEADLINE_EXCEEDED":
                    # Counted at the whole deadline, as if no token came: it waited at least that long.
                    self.row_deadlines.observe(task.row, RowTiming(None, 0, timeout_s))
                    ROW_TIMEOUTS.labels(kind=kind).inc()
                    final = self.row_deadlines.at_ceiling(timeout_s)
                    log.warning("row_timed_out", timeout_s=round(timeout_s, 2), kind=kind, retried=not final)
                    await slot.give_back(latency, FAILED)
                    if final:
                        return cut_at_ceiling_result(task, timeout_s, current_request_id())
                    chain = replace(chain, cut_at_s=timeout_s)
                    wait_s = backoff_s(1, self.config.retry_base_s, self.config.retry_cap_s)
                elif is_paced(exc):
                    await slot.give_back(latency, THROTTLED)
                    wait_s = paced_delay_s(retry_after_of(exc))
                else:
                    await slot.give_back(latency, FAILED)
                    if code not in TRANSIENT:
                        return failed_result(task, code, message_of(exc), current_request_id())
                    chain = replace(chain, transient_errors=chain.transient_errors + 1)
                    if chain.transient_errors >= self.config.row_attempts:
                        RETRIES.labels(code).inc()
                        log.warning("row_given_back", code=code, attempts=chain.transient_errors, error=message_of(exc))
                        return GIVE_BACK
                    wait_s = backoff_s(chain.transient_errors, self.config.retry_base_s, self.config.retry_cap_s)
                RETRIES.labels(code).inc()
                # Decided before the wait, and the attempt gets it: the deadline the bound was checked for.
                timeout_s = self.row_deadlines.for_row(task.row, chain.cut_at_s)
                if not await self._wait_to_retry(slot, wait_s, timeout_s, hold_until):
                    return HandBack(chain, timeout_s, code)
                continue
            if run.timing is not None:
                self.row_deadlines.observe(task.row, run.timing)
            await slot.give_back(run.latency_s, OK, run.allowed_rate_per_s)
            return run.result

    async def _wait_to_retry(self, slot: _Slot, wait_s: float, timeout_s: float, hold_until: float) -> bool:
        """Waits `wait_s` (a backoff, or as RESOURCE_EXHAUSTED told), then for the slot, before the
        row's next attempt, of `timeout_s`: True, the slot taken. False, no slot held, when that
        attempt could not end by `hold_until` (WorkerSettings.hold_s after the delivery of the row's
        message): the row is to be handed back, to go on in its next delivery.

        The one place that decides between retrying here and handing back. Why: a row's retries all
        run inside one delivery of its message, unacked; cut again and again (with the defaults
        120, 240, 480, 960 s: 1,800 s before the ceiling's attempt) or told to wait, a row held its
        message past the broker's consumer timeout, and the broker closed the channel, requeueing
        every row on it and counting a delivery of each."""
        start_by = hold_until - timeout_s
        if time.monotonic() + wait_s > start_by:
            # What the delivery allows of the wait is waited here: handed back at once, a row told to
            # wait longer than a delivery may last would come straight back and be told again, in a loop.
            await asyncio.sleep(max(0.0, min(wait_s, hold_until - time.monotonic())))
            return False
        await asyncio.sleep(wait_s)
        try:
            await asyncio.wait_for(slot.take(), max(0.0, start_by - time.monotonic()))
        except TimeoutError:
            return False
        return True

    async def _too_long_for_window(self, task: jobs_pb2.RowTask, job: JobRecord | None, cut_at_s: float | None) -> jobs_pb2.RowResult | None:
        """The row's failed result (TOO_LONG_FOR_WINDOW) when it is expected to end more than
        WORKER_ROW_TIMEOUT_FLOOR_S after its job's completion window; None when it fits or nothing
        is known."""
        expected_s = self.row_deadlines.expected_s(task.row, cut_at_s)
        if expected_s is None:
            return None
        job = job or await self.store.get_job(task.job_id)
        if job is None:
            return None
        # Grace: a row expected to end within the floor of the window's end runs (rows running when
        # the window ends finish anyway).
        grace_s = self.config.row_timeout_floor_s
        result = too_long_for_window(task, expected_s, job.expires_at, time.time(), job.window_s, grace_s)
        if result is not None:
            log.warning("row_too_long_for_window", expected_s=round(expected_s, 2), left_s=round((job.expires_at or 0) - time.time(), 2))
        return result

    async def _release(self, latency_s: float, outcome: str, rate: float | None = None) -> None:
        before = self.concurrency.limit
        await self.concurrency.release(latency_s, outcome, rate)
        IN_FLIGHT.set(self.concurrency.in_flight)
        LIMIT.set(self.concurrency.limit)
        if int(before) != int(self.concurrency.limit):
            log.info("concurrency_changed", limit=round(self.concurrency.limit, 2), reason=self.concurrency.history[-1][2])
        self._bound_moved()

    async def _dead_letter(self, task: jobs_pb2.RowTask, message: aio_pika.abc.AbstractIncomingMessage, reason: str) -> None:
        log.warning("row_dead_lettered", reason=reason)
        await dead_letter(self._dead, self.topology.row_routing_key, message, reason)
        result = failed_result(task, "ABORTED", f"{reason}; dead-lettered to {self.topology.dead_queue}")
        ROWS.labels("dead_lettered").inc()
        await self._finish(task, result, message, count=False)

    async def _expired(self, task: jobs_pb2.RowTask) -> jobs_pb2.RowResult:
        job = await self.store.get_job(task.job_id)
        return expired_result(task, job.window_s if job is not None else None)

    async def _finish(
        self, task: jobs_pb2.RowTask, result: jobs_pb2.RowResult, message: aio_pika.abc.AbstractIncomingMessage, count: bool = True
    ) -> None:
        await self._store_result(task, result, count)
        await message.ack()

    async def _store_result(self, task: jobs_pb2.RowTask, result: jobs_pb2.RowResult, count: bool = True) -> None:
        """Stores a row's result once, tells it, and the job's summary when it was the last."""
        finished = await self.store.finish_row(result)
        if finished is None:
            return
        await self._tell(task, result)
        if count:
            ROWS.labels(_outcome(result)).inc()
        if finished.ends_job:
            try:
                await self._summarize(finished.job, task.reply_content_type)
            except Exception:  # noqa: BLE001 - the row is stored and told; the sweep tells the summary later
                log.exception("job_summary_failed", job_id=task.job_id)

    async def _tell(self, task: jobs_pb2.RowTask, result: jobs_pb2.RowResult) -> None:
        if task.reply_to:
            content_type = task.reply_content_type or PROTOBUF
            await self._reply(task.reply_to, result, content_type, f"{task.job_id}/{task.row.custom_id}", RESULT_TYPE)

    # ---- the end of a job: its summary, and the sweep

    async def _summarize(self, job: JobRecord, row_content_type: str = "") -> None:
        """Tells the job's summary (confirmed), and only then marks it told (finalizing ->
        completed). A crash in between leaves it due: the sweep tells it again, same message id."""
        if job.reply_to:
            # A job accepted before its content type was stored: its rows' content type says it.
            content_type = job.reply_content_type or row_content_type or PROTOBUF
            await self._reply(job.reply_to, job.summary(), content_type, f"{job.job_id}{SUMMARY_SUFFIX}", SUMMARY_TYPE)
        ended = await self.store.summary_told(job.job_id)
        log.info(
            "job_ended", job_id=job.job_id, state=ended.state if ended else job.state,
            completed=job.completed_rows, failed=job.failed_rows, total=job.total_rows,
        )  # fmt: skip

    async def _sweep(self) -> None:
        expired = await self.store.expire_overdue()
        if expired:
            log.info("jobs_expired", jobs=expired)
        unadmitted = await self.store.fail_unadmitted(UNADMITTED_GRACE_S)
        if unadmitted:
            log.warning("jobs_never_admitted", jobs=unadmitted, hint="their AdmittedJob never reached a worker: see the gateway's publisher_dropped")
        await self._end_stranded_rows()
        cancelled = await self.store.cancel_stale_rows()
        if cancelled:
            log.warning("stale_rows_of_cancelled_jobs_ended", rows=cancelled, hint="their workers stopped beating while running them")
        for job in await self.store.summaries_due(SUMMARY_GRACE_S):
            try:
                await self._summarize(job)
            except Exception:  # noqa: BLE001 - one job's failure must not hold back the others' summaries
                log.exception("job_summary_failed", job_id=job.job_id)

    async def _end_stranded_rows(self) -> None:
        """Rows of expired jobs whose message will never come (the broker dead-lettered it at its
        delivery limit, or it was lost) get their result here, or the job would never end."""
        running_grace_s = self.row_deadlines.policy.ceiling_s + STRANDED_PENDING_GRACE_S
        stranded = await self.store.stranded_rows(STRANDED_PENDING_GRACE_S, running_grace_s)
        for row in stranded:
            task = jobs_pb2.RowTask(
                job_id=row.job_id, row=jobs_pb2.JobRow(custom_id=row.custom_id), reply_to=row.reply_to, reply_content_type=row.reply_content_type
            )
            result = (
                failed_result(task, "ABORTED", "its worker stopped while running it and its message never came back; submit the row again")
                if row.running
                else expired_result(task, row.window_s)
            )
            await self._store_result(task, result)
        if stranded:
            log.warning("stranded_rows_ended", rows=len(stranded), hint="their messages never reached a worker again: see the jobs.dead queue")

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            try:
                await self._sweep()
            except Exception:  # noqa: BLE001 - a store or broker hiccup: the next sweep tries again
                log.exception("job_sweep_failed")


def amqp_id(text: str) -> str:
    """`text` as an AMQP message id: itself when it fits in 255 bytes, else a digest of it, the same
    for the same text (so that consumers still drop a repeat by its id). The ids of rows, results
    and summaries fit (validate_job); a rejected job's id may be any length."""
    if len(text.encode()) <= MAX_MESSAGE_ID_BYTES:
        return text
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def _header_request_id(headers: Any, name: str) -> str:
    """A request id from a message header, as the job's and its rows' log lines carry it: text (a
    bytes value decoded), at most MAX_REQUEST_ID characters; "" when there is none, or when it is
    not text gRPC metadata can carry (the id goes into downstream calls' metadata, where grpc would
    refuse it and the message would fail each delivery)."""
    value = (headers or {}).get(name)
    if not value:
        return ""
    text = header_text(value if isinstance(value, (str, bytes)) else str(value))[:MAX_REQUEST_ID]
    return text if is_metadata_text(text) else ""


def _deliveries(message: aio_pika.abc.AbstractIncomingMessage) -> int:
    """This delivery's number: 1 the first time (quorum queues count the earlier ones; a message
    handed back unstarted carries those of the message it copies)."""
    headers = message.headers or {}
    try:
        counted = int(str(headers.get("x-delivery-count") or 0))
    except ValueError:
        counted = 0
    try:
        earlier = int(str(headers.get(EARLIER_DELIVERIES_HEADER) or 0))
    except ValueError:
        earlier = 0
    return max(0, counted) + max(0, earlier) + 1


def _header_number(headers: Any, name: str) -> float:
    """A header's positive finite number (a float, an int, or their text); 0.0 when it has none."""
    value = headers.get(name)
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        return 0.0
    return number if math.isfinite(number) and number > 0 else 0.0


def _redelivered(message: aio_pika.abc.AbstractIncomingMessage) -> bool:
    """The broker redelivered it, or it copies a redelivered message handed back unstarted."""
    return bool(message.redelivered) or bool((message.headers or {}).get(REDELIVERED_HEADER))


async def _cancel_consumer(queue: aio_pika.abc.AbstractQueue, tag: str, timeout_s: float) -> None:
    """Cancels one consumer, waiting for the broker's answer `timeout_s` at most. A robust queue
    forgets the consumer (no restoration on a reconnection) before it first waits, so even a
    timeout of 0 (the deadline fires at that first wait, never before it) calls off its restoration."""
    with contextlib.suppress(Exception):  # TimeoutError too: the broker drops the consumer with the channel
        async with asyncio.timeout(timeout_s):
            await queue.cancel(tag)


def failure_backoff_s(deliveries: int) -> float:
    """Doubling from FAILURE_BACKOFF_S[0] with each delivery, up to its [1], jittered down by up to
    half so that the messages of one outage do not all come back at once."""
    first, most = FAILURE_BACKOFF_S
    return backoff_s(min(deliveries - 1, 16), first, most, least_share=0.5)


async def _give_back_later(message: aio_pika.abc.AbstractIncomingMessage) -> None:
    """Back to the broker after a backoff: during a database outage every message would otherwise
    spend the queue's delivery limit within seconds and be dead-lettered unrun. Held meanwhile
    (unacked), so a worker stopping now leaves it to be redelivered."""
    await asyncio.sleep(failure_backoff_s(_deliveries(message)))
    with contextlib.suppress(Exception):
        await message.nack(requeue=True)


def _request_id() -> str:
    return current_request_id() or new_request_id()


def _as_its_job(task: jobs_pb2.RowTask, job: JobRecord | None) -> jobs_pb2.RowTask:
    """The row as its job says it runs: the job's tenant, its text-logging setting as the job was
    accepted with (a job accepted before the store kept it: the message's), its reply_to and reply
    content type, whatever the message says (claim refuses a message naming another tenant; this
    is the second lock)."""
    if job is None:
        return task
    ran = jobs_pb2.RowTask()
    ran.CopyFrom(task)
    ran.tenant, ran.reply_to = job.tenant, job.reply_to
    if job.text_logging is not None:
        ran.text_logging = job.text_logging
    if job.reply_content_type:
        ran.reply_content_type = job.reply_content_type
    return ran


def _outcome(result: jobs_pb2.RowResult) -> str:
    """The rows counter's label."""
    if not result.HasField("error"):
        return "completed"
    return "expired" if result.error.code == EXPIRED_CODE else "failed"


def _reply_type(content_type: str) -> str:
    return JSON if (content_type or "").split(";")[0].strip().lower() == JSON else PROTOBUF


async def serve(config: WorkerConfig) -> None:
    shared, settings = config.shared, config.worker
    core = GatewayCore.build(shared, settings.port)
    store = JobStore.create(shared.jobs_postgres_dsn, shared.jobs_sqlite_path)
    await store.open()
    running = await create_server(config.host, settings.port, settings.metrics_port, lambda server: [], serving=False)
    running.supervisor.start("event-loop-lag", monitor_loop_lag)
    await core.start(shared, running.supervisor)
    worker = JobWorker(shared, settings, core, store)
    await worker.start(running.supervisor)
    await running.set_serving(True)
    log.info("ready", role="job-worker", store=store.db.backend)

    async def on_stop() -> None:
        await worker.stop(config.shutdown_grace_s)  # the rows in flight: the worker's drain
        await core.close(PUBLISHER_FLUSH_S)
        await store.close()

    await serve_until_signal(running, config.shutdown_grace_s, on_stop)


def main() -> None:
    run_service("gateway-worker", WorkerConfig, ENV_PREFIX, serve)


if __name__ == "__main__":
    main()
