"""A job's way in: SubmitJob publishes an AdmittedJob (its tenant's name, no key) that the job
worker accepts without authenticating; a producer's JobRequest is authenticated by the worker, once;
a job message of a Sluice type the worker does not know is dead-lettered, never dropped.

JobsApi and the worker's job consumer over a real SQLite job store; the broker is replaced by what
the gateway's confirming publisher is handed (OutgoingMessage) and stand-ins for the worker's
incoming message and exchanges."""

from __future__ import annotations

import asyncio
import json
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from sluice.jobs.v1 import jobs_pb2

from sluice_common.amqp import DEAD_REASON_HEADER, JobTopology

from sluice_common.amqp_publisher import MessageRejected, OutgoingMessage
from sluice_common.config import load_config
from sluice_common.errors import InvalidArgument, PermissionDenied, Unavailable
from sluice_common.tenants import TenantDirectory
from sluice_gateway.config import ENV_PREFIX, WorkerConfig
from sluice_gateway.jobs import store as states
from sluice_gateway.jobs.api import JobRequestPublisher, JobsApi
from sluice_gateway.jobs.job import JSON
from sluice_gateway.jobs.store import JobStore
from sluice_gateway.jobs.worker import JobWorker

TENANTS_FILE = Path(__file__).resolve().parents[3] / "config" / "tenants.toml"
TENANTS = TenantDirectory.from_file(TENANTS_FILE)
DEMO_KEY = "sk-sluice-demo"
PRIVATE_KEY = "sk-sluice-private"  # tenant "private", text_logging off
PRIVATE = TENANTS.authenticate(f"Bearer {PRIVATE_KEY}")


class CapturingPublisher:
    """What the gateway's ConfirmingPublisher is handed."""

    def __init__(self, confirms: bool = True) -> None:
        self.messages: list[OutgoingMessage] = []
        self.confirms = confirms

    def submit(self, message: OutgoingMessage) -> None:
        self.messages.append(message)
        if message.confirmed is not None and self.confirms:
            message.confirmed.set_result(None)  # as the broker's confirm does


@dataclass
class Incoming:
    """The part of aio_pika's AbstractIncomingMessage the job consumer reads."""

    body: bytes
    content_type: str | None = None
    type: str | None = None
    reply_to: str | None = None
    message_id: str | None = None
    headers: dict[str, Any] = field(default_factory=dict)
    routing_key: str = "job"
    exchange: str = "sluice.jobs"
    timestamp: Any = None
    correlation_id: str | None = None
    content_encoding: str | None = None
    priority: int | None = None
    app_id: str | None = None
    redelivered: bool = False
    acked: bool = False

    @classmethod
    def of(cls, message: OutgoingMessage) -> Incoming:
        """The message the worker receives for one the gateway published."""
        sent = message.to_aio_pika()
        return cls(sent.body, sent.content_type, sent.type, sent.reply_to, sent.message_id, dict(sent.headers or {}))

    async def ack(self) -> None:
        self.acked = True

    async def nack(self, requeue: bool = True) -> None:
        raise AssertionError("a job message the worker can handle is acked, never given back")


class Exchange:
    def __init__(self) -> None:
        self.published: list[tuple[Any, str]] = []

    async def publish(self, message: Any, routing_key: str) -> None:
        self.published.append((message, routing_key))


def job_worker(store: JobStore, **env: str) -> JobWorker:
    settings = {"TENANTS_FILE": str(TENANTS_FILE), **env}
    config = load_config(WorkerConfig, ENV_PREFIX, {f"{ENV_PREFIX}{name}": value for name, value in settings.items()})
    worker = JobWorker(config.shared, config.worker, types.SimpleNamespace(tenants=TENANTS), store)  # type: ignore[arg-type]
    # Instead of a connection (start()): rows, replies and dead letters are kept here.
    worker._exchange = Exchange()
    worker._rows_channel = types.SimpleNamespace(default_exchange=Exchange())
    worker._dead = Exchange()
    return worker


def rows_published(worker: JobWorker) -> list[jobs_pb2.RowTask]:
    return [jobs_pb2.RowTask.FromString(message.body) for message, _ in worker._exchange.published]


def replies(worker: JobWorker) -> list[tuple[Any, str]]:
    return worker._rows_channel.default_exchange.published


def job_request(job_id: str, api_key: str = "") -> jobs_pb2.JobRequest:
    job = jobs_pb2.JobRequest(job_id=job_id, api_key=api_key, reply_to="results")
    for custom_id in ("a", "b"):
        job.rows.add(custom_id=custom_id).embed.inputs.append("x")
    return job


def gateway(store: JobStore, confirms: bool = True) -> tuple[JobsApi, CapturingPublisher]:
    captured = CapturingPublisher(confirms)
    publisher = JobRequestPublisher(captured, JobTopology("sluice"))  # type: ignore[arg-type]
    return JobsApi(store, TENANTS, publisher.submit_job, max_rows=10, completion_window_s=3600.0), captured


@pytest.mark.parametrize("own_key", ["", PRIVATE_KEY])
async def test_the_api_path_publishes_the_tenant_and_no_key(store: JobStore, own_key: str) -> None:
    api, captured = gateway(store)
    submitted = await api.submit(PRIVATE, job_request("j1", own_key))
    assert (submitted.tenant, submitted.state) == ("private", jobs_pb2.JOB_STATE_VALIDATING)
    [message] = captured.messages
    assert (message.type, message.routing_key, message.message_id) == ("sluice.jobs.v1.AdmittedJob", "job", "j1")
    # No key anywhere in what crosses the broker: not the metadata's, not the job's own.
    assert PRIVATE_KEY.encode() not in message.body and DEMO_KEY.encode() not in message.body
    admitted = jobs_pb2.AdmittedJob.FromString(message.body)
    assert (admitted.tenant, admitted.text_logging, admitted.job.api_key) == ("private", False, "")
    assert admitted.job.job_id == "j1" and [r.custom_id for r in admitted.job.rows] == ["a", "b"]


async def test_submit_job_answers_only_once_the_broker_confirmed_the_job(store: JobStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Answered before, a job the gateway died with (unconfirmed, in memory) was lost while its
    caller had been told it was submitted; it stayed validating for its whole window."""
    from sluice_gateway.jobs import api as api_module

    monkeypatch.setattr(api_module, "SUBMIT_CONFIRM_WAIT_S", 0.1)
    api, captured = gateway(store, confirms=False)
    with pytest.raises(Unavailable, match="submit it again with the same job_id") as caught:
        await api.submit(PRIVATE, job_request("j1"))
    assert caught.value.retry_after_s == 1.0
    captured.confirms = True  # the broker is back: the same job again is published again, and confirmed
    submitted = await api.submit(PRIVATE, job_request("j1"))
    assert submitted.state == jobs_pb2.JOB_STATE_VALIDATING and len(captured.messages) == 2


async def test_a_job_over_the_message_bound_is_refused_naming_it_before_it_is_recorded(store: JobStore) -> None:
    """Past RabbitMQ's max_message_size the broker closes the channel: the job would never be
    admitted, and every later job of the gateway would wait behind it."""
    captured = CapturingPublisher()
    publisher = JobRequestPublisher(captured, JobTopology("sluice"))  # type: ignore[arg-type]
    api = JobsApi(store, TENANTS, publisher.submit_job, max_rows=10, completion_window_s=3600.0, max_message_bytes=1024)
    job = job_request("big")
    job.rows[0].embed.inputs[0] = "x" * 1024
    with pytest.raises(InvalidArgument, match=r"over the limit of 1024 bytes \(SLUICE_GATEWAY_JOBS_MAX_MESSAGE_BYTES\): split"):
        await api.submit(PRIVATE, job)
    assert captured.messages == [] and await store.get_job("big") is None
    job.rows[0].embed.inputs[0] = "x" * 900
    assert (await api.submit(PRIVATE, job)).state == jobs_pb2.JOB_STATE_VALIDATING
    assert len(captured.messages[0].body) <= 1024


async def test_a_job_the_broker_refuses_is_answered_failed_and_without_a_broker_nothing_is_recorded(store: JobStore) -> None:
    refusing = CapturingPublisher(confirms=False)
    api = JobsApi(store, TENANTS, lambda admitted: _refused(refusing, admitted), max_rows=10, completion_window_s=3600.0)
    failed = await api.submit(PRIVATE, job_request("j1"))
    assert failed.state == jobs_pb2.JOB_STATE_FAILED and "not admitted: nacked" in failed.error
    no_broker = JobsApi(store, TENANTS, None, max_rows=10, completion_window_s=3600.0)
    with pytest.raises(Unavailable, match="AMQP_URL is empty"):
        await no_broker.submit(PRIVATE, job_request("j2"))
    assert await store.get_job("j2") is None  # nothing left validating for a window


def _refused(publisher: CapturingPublisher, admitted: jobs_pb2.AdmittedJob) -> asyncio.Future[None]:
    """As the confirming publisher does when the broker nacks the job's message."""
    confirmed = JobRequestPublisher(publisher, JobTopology("sluice")).submit_job(admitted)  # type: ignore[arg-type]
    confirmed.set_exception(MessageRejected("nacked"))
    return confirmed


async def test_a_key_in_the_job_must_be_the_callers_tenants(store: JobStore) -> None:
    api, captured = gateway(store)
    with pytest.raises(PermissionDenied, match="another tenant"):
        await api.submit(PRIVATE, job_request("j1", DEMO_KEY))
    with pytest.raises(InvalidArgument, match="api_key: invalid API key"):
        await api.submit(PRIVATE, job_request("j2", "sk-wrong"))
    assert captured.messages == [] and await store.get_job("j1") is None and await store.get_job("j2") is None


async def test_the_worker_accepts_an_admitted_job_under_its_tenant(store: JobStore) -> None:
    api, captured = gateway(store)
    await api.submit(PRIVATE, job_request("j1"))
    worker = job_worker(store)
    message = Incoming.of(captured.messages[0])
    await worker._job(message)  # type: ignore[arg-type]
    assert message.acked and replies(worker) == [] and worker._dead.published == []
    record = await store.get_job("j1")
    assert record is not None and (record.tenant, record.state, record.total_rows) == ("private", states.IN_PROGRESS, 2)
    rows = rows_published(worker)
    assert sorted(t.row.custom_id for t in rows) == ["a", "b"]
    assert all((t.tenant, t.text_logging, t.reply_to, t.reply_content_type) == ("private", False, "results", "application/x-protobuf") for t in rows)
    # Redelivered (the worker died before its ack): the same job, its rows not doubled.
    again = Incoming.of(captured.messages[0])
    again.redelivered = True
    await worker._job(again)  # type: ignore[arg-type]
    record = await store.get_job("j1")
    assert again.acked and record is not None and (record.tenant, record.total_rows) == ("private", 2)
    assert await store.row_states("j1") == {"pending": 2}


async def test_an_admitted_job_is_checked_like_any_other_but_for_its_key(store: JobStore) -> None:
    """A gateway allowing more rows than the worker: the worker's rule holds, and the job (recorded
    by the gateway as validating) is failed for its tenant rather than left waiting."""
    worker = job_worker(store, JOBS_MAX_ROWS="2")
    job = jobs_pb2.JobRequest(job_id="big", reply_to="results")
    for index in range(worker.shared.jobs_max_rows + 1):
        job.rows.add(custom_id=f"r{index}").embed.inputs.append("x")
    await store.record_submitted("big", "private", len(job.rows), "results", 3600.0)
    admitted = jobs_pb2.AdmittedJob(job=job, tenant="private")
    message = Incoming(admitted.SerializeToString(), "application/x-protobuf", "sluice.jobs.v1.AdmittedJob")
    await worker._job(message)  # type: ignore[arg-type]
    assert message.acked and rows_published(worker) == []
    record = await store.get_job("big")
    assert record is not None and record.state == states.FAILED and "per job" in record.error
    [(reply, reply_to)] = replies(worker)
    assert reply_to == "results" and reply.type == "sluice.jobs.v1.JobRejection"


def producer_message(api_key: str) -> Incoming:
    """A producer's JobRequest as the docs publish it: JSON, no AMQP type."""
    job = {"job_id": "ext", "api_key": api_key, "reply_to": "my-results", "rows": [{"custom_id": "q", "embed": {"inputs": ["x"]}}]}
    return Incoming(json.dumps(job).encode(), JSON)


async def test_a_producers_job_request_is_authenticated_by_the_worker(store: JobStore) -> None:
    worker = job_worker(store)
    message = producer_message(DEMO_KEY)
    await worker._job(message)  # type: ignore[arg-type]
    record = await store.get_job("ext")
    assert message.acked and record is not None and (record.tenant, record.state) == ("demo", states.IN_PROGRESS)
    [task] = rows_published(worker)
    assert (task.tenant, task.text_logging, task.reply_content_type) == ("demo", True, JSON)
    assert DEMO_KEY.encode() not in worker._exchange.published[0][0].body  # the key goes no further


async def test_a_producers_bad_key_is_still_rejected(store: JobStore) -> None:
    worker = job_worker(store)
    message = producer_message("sk-wrong")
    await worker._job(message)  # type: ignore[arg-type]
    assert message.acked and rows_published(worker) == [] and await store.get_job("ext") is None
    [(reply, reply_to)] = replies(worker)
    assert (reply_to, reply.type, reply.content_type, reply.message_id) == ("my-results", "sluice.jobs.v1.JobRejection", JSON, "ext/rejected")
    assert json.loads(reply.body) == {"job_id": "ext", "reason": "api_key: invalid API key"}


async def test_an_unknown_sluice_type_is_dead_lettered_with_its_reason(store: JobStore) -> None:
    worker = job_worker(store)
    message = Incoming(b"\x0a\x02j9", "application/x-protobuf", "sluice.jobs.v2.AdmittedJob", "results", "j9")
    await worker._job(message)  # type: ignore[arg-type]
    assert message.acked and rows_published(worker) == [] and replies(worker) == [] and await store.get_job("j9") is None
    [(copy, routing_key)] = worker._dead.published
    assert routing_key == "job" and copy.body == message.body and copy.type == "sluice.jobs.v2.AdmittedJob"
    assert "unknown message type 'sluice.jobs.v2.AdmittedJob'" in copy.headers[DEAD_REASON_HEADER]


AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"


@pytest.mark.parametrize("job_id", ["j" * 300, "é" * 200])
async def test_a_job_rejected_for_its_long_id_is_told_so_and_acked(store: JobStore, job_id: str) -> None:
    """Its rejection's message id "<job_id>/rejected" (and correlation id) were over AMQP's 255
    bytes: the publish raised, the job message went back to the queue ~20 times until the broker
    dead-lettered it, and the producer never heard. No valid key was needed to cause it. Against
    the real broker: the bound is AMQP's (pamqp's), not the stand-in's."""
    import uuid

    import aio_pika

    worker = job_worker(store)
    connection = await aio_pika.connect(AMQP_URL)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        results = await channel.declare_queue(f"test.rejections.{uuid.uuid4().hex[:8]}", exclusive=True)
        worker._rows_channel = channel
        body = {"job_id": job_id, "api_key": "sk-wrong", "reply_to": results.name, "rows": [{"custom_id": "q", "embed": {"inputs": ["x"]}}]}
        message = Incoming(json.dumps(body).encode(), JSON)
        await worker._job(message)  # type: ignore[arg-type]
        assert message.acked and rows_published(worker) == []
        told = await results.get(no_ack=True, timeout=5)
        assert told is not None and told.type == "sluice.jobs.v1.JobRejection"
        assert json.loads(told.body)["job_id"] == job_id
        assert told.message_id is not None and len(told.message_id.encode()) <= 255 and told.correlation_id is None
        from sluice_gateway.jobs.worker import amqp_id

        assert told.message_id == amqp_id(f"{job_id}/rejected")  # the same for a repeat: consumers drop it


async def test_a_rejection_that_cannot_be_told_still_settles_the_job_message(store: JobStore) -> None:
    """Retried, the rejection fails again on every delivery until the broker dead-letters the job."""

    class Failing:
        async def publish(self, message: Any, routing_key: str) -> None:
            raise ConnectionError("the broker closed the channel")

    worker = job_worker(store)
    worker._rows_channel = types.SimpleNamespace(default_exchange=Failing())
    message = producer_message("sk-wrong")
    await worker._job(message)  # type: ignore[arg-type]
    assert message.acked and rows_published(worker) == []


@pytest.mark.parametrize(("header", "bound"), [("r" * 100, "r" * 64), (b"req-bytes-7", "req-bytes-7")])
async def test_a_job_and_its_rows_log_the_same_request_id(store: JobStore, header: object, bound: str) -> None:
    """The job took its x-request-id whole (str() of it: "b'...'" for a header the client handed over
    as bytes), its rows a 64-character cut or the decoded text: the job's lines and its rows' named
    different request ids."""
    from sluice_common.request_context import current_request_id
    from sluice_gateway.jobs.worker import JOB_REQUEST_ID_HEADER

    import structlog

    worker = job_worker(store)
    message = producer_message(DEMO_KEY)
    message.headers = {"x-request-id": header}
    await worker._on_job(message)  # type: ignore[arg-type]
    assert message.acked and current_request_id() == bound
    [(row_message, _)] = worker._exchange.published
    assert row_message.headers[JOB_REQUEST_ID_HEADER] == bound
    # The row reads it back the same way, whether the client library hands it over as text or bytes.
    for carried in (bound, bound.encode()):
        row = Incoming(b"", headers={JOB_REQUEST_ID_HEADER: carried})  # undecodable: dead-lettered, acked
        await worker._on_row(row)  # type: ignore[arg-type]
        assert row.acked and structlog.contextvars.get_contextvars()["job_request_id"] == bound


@pytest.mark.parametrize("header", ["é-request", "x\ty", "r\x7f"])
async def test_a_job_whose_request_id_grpc_metadata_cannot_carry_runs_under_one_of_ours(store: JobStore, header: str) -> None:
    """The job's request id goes into its downstream calls' gRPC metadata, which takes printable
    ASCII only (grpc refuses the call otherwise, as the HTTP front's x-request-id showed): such a
    header is not taken, and the job and its rows run under a fresh id."""
    from sluice_common.request_context import current_request_id
    from sluice_gateway.jobs.worker import JOB_REQUEST_ID_HEADER

    worker = job_worker(store)
    message = producer_message(DEMO_KEY)
    message.headers = {"x-request-id": header}
    await worker._on_job(message)  # type: ignore[arg-type]
    bound = current_request_id()
    assert message.acked and bound and bound != header and bound.isascii() and bound.isprintable()
    [(row_message, _)] = worker._exchange.published
    assert row_message.headers[JOB_REQUEST_ID_HEADER] == bound


# ---- reply_to: never one of Sluice's own queues, nor the broker's

FORBIDDEN_REPLY_TO = ["sluice.jobs.rows", "sluice.jobs.requests", "sluice.evallog.completions", "amq.gen-3x4mpl3", "amq.rabbitmq.reply-to"]


@pytest.mark.parametrize("reply_to", FORBIDDEN_REPLY_TO)
async def test_submit_job_refuses_a_reply_to_naming_an_internal_queue(store: JobStore, reply_to: str) -> None:
    """Results go to the default exchange with reply_to as the routing key: `sluice.jobs.rows` put a
    tenant's RowResults on the internal row queue, read there as RowTasks of any tenant."""
    api, captured = gateway(store)
    job = job_request("j1")
    job.reply_to = reply_to
    with pytest.raises(InvalidArgument) as refused:
        await api.submit(PRIVATE, job)
    assert refused.value.field_name == "job.reply_to" and reply_to in refused.value.reason
    assert captured.messages == [] and await store.get_job("j1") is None


async def test_submit_job_takes_the_prefix_of_the_exchange_it_publishes_to(store: JobStore) -> None:
    captured = CapturingPublisher()
    publisher = JobRequestPublisher(captured, JobTopology("acme-sluice"))  # type: ignore[arg-type]
    api = JobsApi(store, TENANTS, publisher.submit_job, max_rows=10, completion_window_s=3600.0)
    job = job_request("j1")
    job.reply_to = "acme-sluice.jobs.rows"
    with pytest.raises(InvalidArgument, match="reply_to"):
        await api.submit(PRIVATE, job)
    job.reply_to = "sluice-results"  # not under any prefix's dot
    assert (await api.submit(PRIVATE, job)).state == jobs_pb2.JOB_STATE_VALIDATING


@pytest.mark.parametrize("reply_to", FORBIDDEN_REPLY_TO)
async def test_the_worker_refuses_a_producers_reply_to_naming_an_internal_queue_and_tells_it_nothing(store: JobStore, reply_to: str) -> None:
    worker = job_worker(store)
    for body_reply_to, property_reply_to in ((reply_to, None), ("", reply_to)):  # in the body, or as the message's property
        job = {"job_id": "ext", "api_key": DEMO_KEY, "reply_to": body_reply_to, "rows": [{"custom_id": "q", "embed": {"inputs": ["x"]}}]}
        message = Incoming(json.dumps(job).encode(), JSON, reply_to=property_reply_to)
        await worker._job(message)  # type: ignore[arg-type]
        assert message.acked and rows_published(worker) == [] and replies(worker) == []
        record = await store.get_job("ext")
        assert record is not None and record.state == states.FAILED and "reply_to" in record.error and record.reply_to == ""


@pytest.mark.parametrize("reply_to", FORBIDDEN_REPLY_TO)
async def test_no_rejection_is_told_to_an_internal_queue_whatever_the_job_s_fault(store: JobStore, reply_to: str) -> None:
    """A bad key, a body that does not parse, an AdmittedJob of a gateway that did not check: the
    JobRejection is told to no forbidden reply_to (no key is needed to ask for one)."""
    worker = job_worker(store)
    bad_key = {"job_id": "ext", "api_key": "sk-wrong", "reply_to": reply_to, "rows": [{"custom_id": "q", "embed": {"inputs": ["x"]}}]}
    job = job_request("adm")
    job.reply_to = reply_to
    admitted = jobs_pb2.AdmittedJob(job=job, tenant="private").SerializeToString()
    for message in (
        Incoming(json.dumps(bad_key).encode(), JSON),
        Incoming(b'{"job_id": "x", "rows": 7', JSON, reply_to=reply_to),
        Incoming(admitted, "application/x-protobuf", "sluice.jobs.v1.AdmittedJob"),
    ):
        await worker._job(message)  # type: ignore[arg-type]
        assert message.acked
    assert replies(worker) == [] and rows_published(worker) == []
    record = await store.get_job("adm")
    assert record is not None and record.state == states.FAILED


async def test_the_results_of_a_job_accepted_with_an_internal_reply_to_are_stored_but_not_told(store: JobStore) -> None:
    """A job (or a row message) from before reply_to was checked: its rows and summary are not
    published to the internal queue it names; ListJobResults still has them."""
    worker = job_worker(store)
    await store.accept("old", "demo", "sluice.jobs.rows", ["a"], 3600.0)
    task = jobs_pb2.RowTask(job_id="old", tenant="demo", row=jobs_pb2.JobRow(custom_id="a"), reply_to="sluice.jobs.rows")
    await worker._store_result(task, jobs_pb2.RowResult(job_id="old", custom_id="a", output="x"))
    assert replies(worker) == []
    record = await store.get_job("old")
    assert record is not None and record.state == states.COMPLETED and record.completed_rows == 1


# ---- the worker's own dead letters of job messages keep no producer's key


@pytest.mark.parametrize("content_type", [JSON, "application/x-protobuf"])
async def test_a_job_request_the_worker_dead_letters_has_its_api_key_taken_out(store: JobStore, content_type: str) -> None:
    worker = job_worker(store)
    job = job_request("j9", DEMO_KEY)
    if content_type == JSON:
        body = json.dumps(
            {"job_id": "j9", "apiKey": DEMO_KEY, "reply_to": "results", "rows": [{"custom_id": "a", "embed": {"inputs": ["x"]}}]}
        ).encode()
    else:
        body = job.SerializeToString()
    message = Incoming(body, content_type, "sluice.jobs.v2.JobRequest", "results", "j9")
    await worker._job(message)  # type: ignore[arg-type]
    [(copy, routing_key)] = worker._dead.published
    assert message.acked and routing_key == "job" and DEMO_KEY.encode() not in copy.body
    # The rest kept, for a replay to go as far as it can (without a key: rejected, told to reply_to).
    if content_type == JSON:
        assert json.loads(copy.body) == {"job_id": "j9", "reply_to": "results", "rows": [{"custom_id": "a", "embed": {"inputs": ["x"]}}]}
    else:
        job.ClearField("api_key")
        assert jobs_pb2.JobRequest.FromString(copy.body) == job
    assert (copy.type, copy.reply_to, copy.message_id) == ("sluice.jobs.v2.JobRequest", "results", "j9")
    assert "api_key was removed" in copy.headers[DEAD_REASON_HEADER]


async def test_a_newer_gateway_s_message_is_dead_lettered_as_it_came(store: JobStore) -> None:
    """Field 2 of an AdmittedJob is its tenant, not a key: nothing is taken out of Sluice's own messages."""
    worker = job_worker(store)
    body = jobs_pb2.AdmittedJob(job=job_request("j9"), tenant="private").SerializeToString()
    message = Incoming(body, "application/x-protobuf", "sluice.jobs.v2.AdmittedJob", "results", "j9")
    await worker._job(message)  # type: ignore[arg-type]
    [(copy, _)] = worker._dead.published
    assert copy.body == body and "api_key" not in copy.headers[DEAD_REASON_HEADER]
