"""The job RPCs' logic (SubmitJob, GetJob, WatchJob, CancelJob, ListJobResults), without gRPC.

SubmitJob is the gRPC twin of publishing to `<prefix>.jobs`: it validates the job the way the
worker will, records it as validating, and hands it to the same exchange through the confirming
publisher (retried until the broker confirms it) as an AdmittedJob: under the tenant's name the
front authenticated, without any key. A job whose message would be over jobs_max_message_bytes is
refused before it is recorded. SubmitJob answers once the broker has confirmed the job
(UNAVAILABLE after SUBMIT_CONFIRM_WAIT_S: the same job_id may be submitted again); a job the broker
refused is failed, and answered so. A job is visible only to its tenant.
JobsApi is the jobs_port.JobsPort the fronts are handed (they never import this room).
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from sluice.jobs.v1 import jobs_pb2

from sluice_gateway.jobs.trace import with_trace_context
from sluice_common.amqp import JobTopology
from sluice_common.amqp_publisher import ConfirmingPublisher, MessageRejected, OutgoingMessage, PublisherMetrics
from sluice_common.errors import InvalidArgument, NotFound, PermissionDenied, Unavailable
from sluice_common.request_context import current_request_id
from sluice_common.supervision import Supervisor
from sluice_gateway.config import SharedSettings
from sluice_gateway.jobs.store import JobRecord, JobStore
from sluice_gateway.jobs.job import JobRejected, authenticate_job, completion_window_s, validate_job
from sluice_gateway.jobs_port import MAX_PAGE_SIZE, JobTooLarge, SubmitNotConfirmed
from sluice_common.tenants import Tenant, TenantDirectory

DEFAULT_PAGE_SIZE = 100
# How long SubmitJob waits for the broker to confirm the job (milliseconds while it is up).
SUBMIT_CONFIRM_WAIT_S = 5.0


class JobsApi:
    def __init__(
        self,
        store: JobStore,
        tenants: TenantDirectory,
        # Publishes an AdmittedJob; returns a future set once the broker confirmed it (None: nothing to
        # wait for). None instead of a function: no broker (SLUICE_GATEWAY_AMQP_URL empty).
        publish: Callable[[jobs_pb2.AdmittedJob], asyncio.Future[None] | None] | None,
        max_rows: int,
        completion_window_s: float,
        watch_poll_s: float = 0.2,
        max_message_bytes: int = SharedSettings.jobs_max_message_bytes,
        amqp_prefix: str | None = None,
    ) -> None:
        self._store = store
        self._tenants = tenants
        self._publish = publish
        self._max_rows = max_rows
        self._completion_window_s = completion_window_s
        self._watch_poll_s = watch_poll_s
        self._max_message_bytes = max_message_bytes
        # Whose queues a job's reply_to may not name (validate_job): the prefix of the topology the
        # job is published into (a JobRequestPublisher's, when `publish` is its submit_job).
        publisher = getattr(publish, "__self__", None)
        self._amqp_prefix = amqp_prefix or (publisher.prefix if isinstance(publisher, JobRequestPublisher) else SharedSettings.amqp_prefix)
        # Tasks failing jobs the broker refused after their submit had answered (kept from the GC).
        self._failing: set[asyncio.Task[None]] = set()

    async def submit(
        self, tenant: Tenant, job: jobs_pb2.JobRequest, on_recorded: Callable[[jobs_pb2.Job], Awaitable[None]] | None = None
    ) -> jobs_pb2.Job:
        """`tenant` is the caller's, authenticated by the front. A key in the job itself must be
        the same tenant's; it is dropped all the same: the job goes to the workers as an
        AdmittedJob, under the tenant's name, and no key crosses the broker. `on_recorded` (the
        Batch API's batch row) runs after the job is recorded and before it is handed over, so
        that no job runs without it."""
        try:
            if job.api_key and authenticate_job(job, self._tenants).name != tenant.name:
                raise PermissionDenied("job.api_key belongs to another tenant than the authorization metadata")
            validate_job(job, tenant.name, self._max_rows, self._amqp_prefix)
        except JobRejected as exc:
            raise InvalidArgument(f"job.{exc.field}" if exc.field else "job", exc.reason) from None
        if self._publish is None:
            raise Unavailable("bulk jobs need RabbitMQ: SLUICE_GATEWAY_AMQP_URL is empty")
        admitted = jobs_pb2.AdmittedJob(job=job, tenant=tenant.name, text_logging=tenant.text_logging)
        admitted.job.ClearField("api_key")
        # Refused here, before anything is recorded: past the broker's max_message_size the message
        # would never be admitted, and the job would sit validating for its whole window.
        if admitted.ByteSize() > self._max_message_bytes:
            raise JobTooLarge(admitted.ByteSize(), self._max_message_bytes)
        window_s = completion_window_s(job, self._completion_window_s)
        record = await self._store.record_submitted(job.job_id, tenant.name, len(job.rows), job.reply_to, window_s, tenant.text_logging)
        if record.tenant != tenant.name:
            raise InvalidArgument("job.job_id", "already used by another tenant")
        if record.state != "validating":
            return record.to_proto()
        if on_recorded is not None:
            await on_recorded(record.to_proto())
        return await self._confirmed(record, self._publish(admitted))

    async def _confirmed(self, record: JobRecord, confirmed: asyncio.Future[None] | None) -> jobs_pb2.Job:
        """Answered only once the broker holds the job: before, a gateway that died lost it while
        its caller had been told it was submitted (it stayed validating for its whole window)."""
        if confirmed is None:
            return record.to_proto()
        try:
            # Shielded: the publisher keeps the future after this wait ends, to tell of a refusal.
            await asyncio.wait_for(asyncio.shield(confirmed), SUBMIT_CONFIRM_WAIT_S)
        except MessageRejected as exc:
            return await self._refused(record, exc)
        except (TimeoutError, asyncio.CancelledError) as exc:
            confirmed.add_done_callback(lambda done: self._refused_later(record, done))
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise SubmitNotConfirmed(
                f"job {record.job_id!r} is recorded but the broker has not confirmed it within {SUBMIT_CONFIRM_WAIT_S:g}s;"
                " submit it again with the same job_id (it runs once)",
                record.to_proto(),
            ) from None
        return record.to_proto()

    async def _refused(self, record: JobRecord, exc: BaseException) -> jobs_pb2.Job:
        """The broker will never hold the job (it refused its message): failed now, rather than
        validating until the sweep gives up on it a window later."""
        await self._store.record_failed(record.job_id, record.tenant, record.reply_to, f"the job's message was not admitted: {exc}")
        failed = await self._store.get_job(record.job_id)
        return (failed or record).to_proto()

    def _refused_later(self, record: JobRecord, confirmed: asyncio.Future[None]) -> None:
        """A refusal after submit stopped waiting (it answered, or its caller went away)."""
        error = None if confirmed.cancelled() else confirmed.exception()
        if error is None:
            return
        task = asyncio.get_running_loop().create_task(self._refused(record, error))
        self._failing.add(task)
        task.add_done_callback(self._failing.discard)

    async def _owned(self, tenant: Tenant, job_id: str) -> JobRecord:
        if not job_id:
            raise InvalidArgument("job_id", "required")
        record = await self._store.get_job(job_id)
        if record is None or record.tenant != tenant.name:
            raise NotFound(f"no job {job_id!r}")
        return record

    async def get(self, tenant: Tenant, job_id: str) -> jobs_pb2.Job:
        return (await self._owned(tenant, job_id)).to_proto()

    async def watch(self, tenant: Tenant, job_id: str) -> AsyncIterator[jobs_pb2.Job]:
        """The job now, then each time its state or counts change, until it is settled: terminal,
        and for an expired job every row stored (its last rows are stored as EXPIRED after it
        turned expired), so that ListJobResults then lists them all."""
        last: tuple | None = None  # type: ignore[type-arg]
        while True:
            record = await self._owned(tenant, job_id)
            key = (record.state, record.total_rows, record.completed_rows, record.failed_rows)
            if key != last:
                last = key
                yield record.to_proto()
            if record.settled:
                return
            await asyncio.sleep(self._watch_poll_s)

    async def cancel(self, tenant: Tenant, job_id: str) -> jobs_pb2.Job:
        await self._owned(tenant, job_id)
        record = await self._store.cancel(job_id)
        assert record is not None
        return record.to_proto()

    async def list_results(self, tenant: Tenant, job_id: str, page_size: int, page_token: str) -> tuple[list[jobs_pb2.RowResult], str]:
        await self._owned(tenant, job_id)
        if page_size < 0:
            raise InvalidArgument("page_size", "must be >= 0")
        return await self._store.list_results(job_id, min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE), page_token)


class JobRequestPublisher:
    """SubmitJob's way to the exchange `<prefix>.jobs`: the confirming publisher (retried until
    confirmed, spilled to a file past its outbox), never awaited on the request path. It publishes
    AdmittedJobs (AMQP type sluice.jobs.v1.AdmittedJob) to the queue producers' JobRequests go to."""

    def __init__(self, publisher: ConfirmingPublisher | None, topology: JobTopology) -> None:
        self._publisher = publisher
        self._topology = topology

    @property
    def prefix(self) -> str:
        """The AMQP prefix of the topology it publishes to (SLUICE_GATEWAY_AMQP_PREFIX)."""
        return self._topology.prefix

    @property
    def enabled(self) -> bool:
        """False without a broker (SLUICE_GATEWAY_AMQP_URL empty): JobsApi then refuses jobs before recording them."""
        return self._publisher is not None

    def submit_job(self, admitted: jobs_pb2.AdmittedJob) -> asyncio.Future[None]:
        """Hands the job to the publisher; the future is set once the broker has confirmed it."""
        if self._publisher is None:
            raise Unavailable("bulk jobs need RabbitMQ: SLUICE_GATEWAY_AMQP_URL is empty")
        confirmed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._publisher.submit(
            OutgoingMessage(
                body=admitted.SerializeToString(),
                routing_key=self._topology.job_routing_key,
                message_id=admitted.job.job_id,
                request_id=current_request_id(),  # the worker's job_accepted line joins SubmitJob's
                type=jobs_pb2.AdmittedJob.DESCRIPTOR.full_name,
                headers=with_trace_context({}),  # the job's trace continues SubmitJob's
                confirmed=confirmed,
            )
        )
        return confirmed

    def start(self, supervisor: Supervisor | None = None) -> None:
        if self._publisher is not None:
            self._publisher.start(supervisor)

    async def stop(self, timeout_s: float) -> None:
        if self._publisher is not None:
            await self._publisher.stop(timeout_s)


def job_request_publisher(config: SharedSettings, port: int) -> JobRequestPublisher:
    topology = JobTopology(config.amqp_prefix)
    if not config.amqp_url:
        return JobRequestPublisher(None, topology)
    publisher = ConfirmingPublisher(
        config.amqp_url,
        topology.exchange,
        topology.declare,
        PublisherMetrics.get("sluice_gateway_job_requests", "JobRequests"),
        spill_path=Path(config.jobs_spill_file or Path(tempfile.gettempdir()) / f"sluice-gateway-{port}-jobs.spill"),
    )
    return JobRequestPublisher(publisher, topology)
