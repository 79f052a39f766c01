"""What the fronts may ask of bulk jobs: the job RPCs (SubmitJob, GetJob, WatchJob, CancelJob,
ListJobResults) as the gRPC servicer and the OpenAI Batch routes call them.

The fronts and the jobs room never import each other (tools/lint/importlinter.ini): jobs.api.JobsApi
fulfils this Protocol, and __main__ hands that object to the fronts, which know only this.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from sluice.jobs.v1 import jobs_pb2

from sluice_common.tenants import Tenant

# The largest page of RowResults list_results gives (a larger page_size is cut to it).
MAX_PAGE_SIZE = 1000


class JobsPort(Protocol):
    async def submit(self, tenant: Tenant, job: jobs_pb2.JobRequest) -> jobs_pb2.Job:
        """Validates the job, records it for `tenant` (the caller, authenticated by the front) and
        hands it to the job workers under the tenant's name: never with a key (a key in the job
        itself must be the same tenant's, and is dropped)."""
        ...

    async def get(self, tenant: Tenant, job_id: str) -> jobs_pb2.Job: ...

    def watch(self, tenant: Tenant, job_id: str) -> AsyncIterator[jobs_pb2.Job]:
        """The job now, then each time its state or counts change, until it is settled."""
        ...

    async def cancel(self, tenant: Tenant, job_id: str) -> jobs_pb2.Job: ...

    async def list_results(self, tenant: Tenant, job_id: str, page_size: int, page_token: str) -> tuple[list[jobs_pb2.RowResult], str]:
        """A page of the job's stored RowResults and the token of the next ('' after the last)."""
        ...
