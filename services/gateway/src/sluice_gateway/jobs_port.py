"""What the fronts may ask of bulk jobs: the job RPCs (SubmitJob, GetJob, WatchJob, CancelJob,
ListJobResults) as the gRPC servicer and the OpenAI Batch routes call them.

The fronts and the jobs room never import each other (tools/lint/importlinter.ini): jobs.api.JobsApi
fulfils this Protocol, and __main__ hands that object to the fronts, which know only this.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

from sluice.jobs.v1 import jobs_pb2

from sluice_common.errors import InvalidArgument, Unavailable
from sluice_common.tenants import Tenant

# The largest page of RowResults list_results gives (a larger page_size is cut to it); a page also
# stops short of sluice_common.channels.PAGE_BYTES of results, so a page may hold fewer rows than asked.
MAX_PAGE_SIZE = 1000
# The longest job_id or custom_id, in characters.
MAX_ID_LENGTH = 256
# AMQP's message-id (a shortstr) holds 255 bytes; a row's results carry "<job_id>/<custom_id>" and
# the job's summary "<job_id>/summary" as theirs, so those must fit.
MAX_MESSAGE_ID_BYTES = 255


class JobTooLarge(InvalidArgument):
    """The job's message to the job workers would be over SLUICE_GATEWAY_JOBS_MAX_MESSAGE_BYTES
    (the broker refuses a message over its max_message_size): nothing was recorded."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(
            "job",
            f"the job is {size} bytes as one message, over the limit of {limit} bytes (SLUICE_GATEWAY_JOBS_MAX_MESSAGE_BYTES):"
            " split its rows into several smaller jobs",
        )
        self.size = size
        self.limit = limit


class SubmitNotConfirmed(Unavailable):
    """The job is recorded (validating) and handed to the broker's publisher, which has not
    confirmed it in time; the publisher keeps trying (and spills it to its file at a stop), and
    the job is failed should the broker refuse it. `job`: the job as recorded."""

    def __init__(self, message: str, job: jobs_pb2.Job) -> None:
        super().__init__(message, retry_after_s=1.0)
        self.job = job


class JobsPort(Protocol):
    async def submit(
        self, tenant: Tenant, job: jobs_pb2.JobRequest, on_recorded: Callable[[jobs_pb2.Job], Awaitable[None]] | None = None
    ) -> jobs_pb2.Job:
        """Validates the job, records it for `tenant` (the caller, authenticated by the front) and
        hands it to the job workers under the tenant's name: never with a key (a key in the job
        itself must be the same tenant's, and is dropped). `on_recorded` is awaited once the job is
        recorded and before it is handed over (a failure there: it is not handed over). Raises
        JobTooLarge before recording anything, SubmitNotConfirmed when the broker has not confirmed
        the job in time; a job the broker refused is answered failed."""
        ...

    async def get(self, tenant: Tenant, job_id: str) -> jobs_pb2.Job: ...

    def watch(self, tenant: Tenant, job_id: str) -> AsyncIterator[jobs_pb2.Job]:
        """The job now, then each time its state or counts change, until it is settled."""
        ...

    async def cancel(self, tenant: Tenant, job_id: str) -> jobs_pb2.Job: ...

    async def list_results(self, tenant: Tenant, job_id: str, page_size: int, page_token: str) -> tuple[list[jobs_pb2.RowResult], str]:
        """A page of the job's stored RowResults and the token of the next ('' after the last)."""
        ...
