"""How the job worker runs one row's attempts against the deadlines of row_deadline.py: a long row
is given the time its tokens need, a row cut off is retried with a longer deadline and fails at the
ceiling, and a row that cannot fit what is left of its job's completion window fails at once.

The worker's own attempt loop, over the real InferencePath to the stand-in adapter of
test_default_deadline.py (a real gRPC server in this process) and a real SQLite job store; no broker
is needed for one row's attempts."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
from sluice.common.v1 import types_pb2
from sluice.jobs.v1 import jobs_pb2
from test_default_deadline import stand_in  # noqa: F401 - the fixture

from sluice_common.config import load_config
from sluice_gateway.config import ENV_PREFIX, WorkerConfig
from sluice_gateway.jobs.store import JobStore
from sluice_gateway.jobs import worker as worker_module
from sluice_gateway.jobs.job import TOO_LONG_CODE, run_row
from sluice_gateway.jobs.row_deadline import RowTiming
from sluice_gateway.jobs.worker import GIVE_BACK, JobWorker

TENANTS = str(Path(__file__).resolve().parents[3] / "config" / "tenants.toml")


def worker(store: JobStore, path: object, **env: str) -> JobWorker:
    settings = {
        "TENANTS_FILE": TENANTS, "WORKER_RETRY_BASE_S": "0.01", "WORKER_RETRY_CAP_S": "0.02", "DEFAULT_DEADLINE_MIN_SAMPLES": "5",
        **env,
    }  # fmt: skip
    config = load_config(WorkerConfig, ENV_PREFIX, {f"{ENV_PREFIX}{name}": value for name, value in settings.items()})
    return JobWorker(config.shared, config.worker, types.SimpleNamespace(path=path), store)  # type: ignore[arg-type]


def generate_row(max_tokens: int) -> jobs_pb2.JobRow:
    sampling = types_pb2.SamplingParams(max_tokens=max_tokens)
    return jobs_pb2.JobRow(custom_id="r", generate=jobs_pb2.GenerateRow(model="m", prompt="hi", sampling=sampling))


async def row_task(store: JobStore, max_tokens: int, window_s: float = 3600.0, job_id: str = "j") -> jobs_pb2.RowTask:
    """A job of one row, recorded in the store with its completion window."""
    await store.accept(job_id, "t", "", ["r"], window_s)
    return jobs_pb2.RowTask(job_id=job_id, tenant="t", row=generate_row(max_tokens))


async def attempts(job_worker: JobWorker, task: jobs_pb2.RowTask) -> object:
    await job_worker.concurrency.acquire()  # the worker's _row holds a slot when it calls _attempts
    return await job_worker._attempts(task)


@pytest.fixture
def deadlines_given(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The deadline of each attempt the worker makes (what the adapter sees is that less the hop)."""
    given: list[float] = []

    async def recording_run_row(path, task, request_id, timeout_s):  # noqa: ANN001, ANN202 - run_row's own
        given.append(timeout_s)
        return await run_row(path, task, request_id, timeout_s)

    monkeypatch.setattr(worker_module, "run_row", recording_run_row)
    return given


async def test_a_row_longer_than_the_warm_up_deadline_completes_in_one_attempt(stand_in, store, deadlines_given) -> None:  # noqa: F811
    adapter, path = stand_in
    adapter.token_s = 0.01  # 60 tokens: 0.6 s, three times WORKER_ROW_TIMEOUT_S below
    job_worker = worker(store, path, WORKER_ROW_TIMEOUT_S="0.2", WORKER_ROW_TIMEOUT_FLOOR_S="0.05", WORKER_ROW_WARMUP_PER_TOKEN_S="0.02")
    outcome = await attempts(job_worker, await row_task(store, max_tokens=60))
    assert isinstance(outcome, jobs_pb2.RowResult) and not outcome.HasField("error"), outcome
    assert outcome.usage.completion_tokens == 60
    assert deadlines_given == [pytest.approx(2 * 60 * 0.02)] and len(adapter.deadlines) == 1


async def test_a_row_cut_off_is_retried_with_twice_the_deadline_and_fails_at_the_ceiling(stand_in, store, deadlines_given) -> None:  # noqa: F811
    adapter, path = stand_in
    adapter.stalled = True
    job_worker = worker(
        store, path, WORKER_ROW_TIMEOUT_S="0.2", WORKER_ROW_TIMEOUT_FLOOR_S="0.05", WORKER_ROW_TIMEOUT_CEILING_S="0.6",
        WORKER_ROW_WARMUP_PER_TOKEN_S="0.001",
    )  # fmt: skip
    outcome = await attempts(job_worker, await row_task(store, max_tokens=10))
    # 0.2 s; then at least twice that (0.42 s: the cut counts as a first token 0.2 s late, so the
    # warm-up rule gives 2 x (0.2 + 10 x 0.001)); then the ceiling, where it fails: not handed back
    # to the broker to start over at 0.2 s.
    assert outcome is not GIVE_BACK
    assert isinstance(outcome, jobs_pb2.RowResult) and outcome.error.code == "DEADLINE_EXCEEDED", outcome
    assert "the longest a row attempt may take" in outcome.error.message
    assert deadlines_given == [pytest.approx(0.2), pytest.approx(0.42), pytest.approx(0.6)] and len(adapter.deadlines) == 3


async def test_a_row_that_cannot_fit_what_is_left_of_its_window_fails_without_running(stand_in, store, deadlines_given) -> None:  # noqa: F811
    adapter, path = stand_in
    job_worker = worker(store, path)
    for _ in range(5):  # warm (5 rows here): 0.1 s to the first token, then 50 ms a token
        job_worker.row_deadlines.observe(generate_row(11), RowTiming(0.1, 11, 0.6))
    # 1,000 tokens are expected to take 50.1 s; the job's whole window is 10 s.
    outcome = await attempts(job_worker, await row_task(store, max_tokens=1000, window_s=10.0))
    assert isinstance(outcome, jobs_pb2.RowResult) and outcome.error.code == TOO_LONG_CODE, outcome
    assert "completion window (10s)" in outcome.error.message
    assert deadlines_given == [] and adapter.deadlines == []  # never attempted
    assert job_worker.concurrency.in_flight == 0
    # The same row in a job whose window leaves it room runs.
    fits = await attempts(job_worker, await row_task(store, max_tokens=20, window_s=10.0, job_id="j2"))
    assert isinstance(fits, jobs_pb2.RowResult) and not fits.HasField("error"), fits


async def test_a_store_error_between_attempts_gives_the_slot_back(stand_in, store, monkeypatch) -> None:  # noqa: F811
    adapter, path = stand_in
    job_worker = worker(store, path)
    for _ in range(5):  # warm: the first attempt reads its job to see whether the row fits its window
        job_worker.row_deadlines.observe(generate_row(11), RowTiming(0.1, 11, 0.6))
    task = await row_task(store, max_tokens=10)

    async def unavailable(job_id: str) -> None:
        raise OSError("database is locked")

    monkeypatch.setattr(store, "get_job", unavailable)
    for _ in range(job_worker.concurrency.bound + 1):  # more failures than the worker has slots
        with pytest.raises(OSError, match="locked"):
            await attempts(job_worker, task)
        assert job_worker.concurrency.in_flight == 0
    assert adapter.deadlines == []  # no attempt ran


class _Delivery:
    """A row message as aio-pika hands it over, recording how it was settled."""

    def __init__(self, task: jobs_pb2.RowTask) -> None:
        self.body = task.SerializeToString()
        self.type = worker_module.ROW_TYPE  # as the split publishes it (_publish_row)
        self.message_id = f"{task.job_id}/{task.row.custom_id}"
        self.headers: dict[str, object] = {}
        self.redelivered = False
        self.settled: list[str] = []

    async def ack(self) -> None:
        self.settled.append("ack")

    async def nack(self, requeue: bool = True) -> None:
        self.settled.append(f"nack requeue={requeue}")


async def test_a_row_waiting_for_a_slot_when_the_worker_stops_goes_back_unstarted(stand_in, store) -> None:  # noqa: F811
    """Stopping used to leave the rows queued behind the concurrency bound to take the slots the
    running rows freed and start generating, only to be cut at the end of the grace."""
    import asyncio

    adapter, path = stand_in
    job_worker = worker(store, path)
    for _ in range(int(job_worker.concurrency.bound)):  # every slot taken by a running row
        await job_worker.concurrency.acquire()
    delivery = _Delivery(await row_task(store, max_tokens=4))
    waiting = asyncio.create_task(job_worker._row(delivery))  # type: ignore[arg-type]
    await asyncio.sleep(0.05)
    await job_worker.stop(0.1)
    await job_worker.concurrency.release(0.0, "skipped")  # a running row ends within the grace
    await asyncio.wait_for(waiting, 5)
    assert delivery.settled == ["nack requeue=True"] and adapter.deadlines == []
    job = await store.get_job("j")
    assert job is not None and job.completed_rows == job.failed_rows == 0


async def test_a_row_failing_on_the_store_goes_back_to_the_broker_only_after_a_backoff(stand_in, store, monkeypatch) -> None:  # noqa: F811
    """Given back at once, every row of a short database outage spent the queue's delivery limit in
    seconds and was dead-lettered by the broker unrun, its job never ending."""
    import asyncio
    import time

    adapter, path = stand_in
    job_worker = worker(store, path)
    delivery = _Delivery(await row_task(store, max_tokens=4))

    async def unavailable(*args: object) -> str:
        raise OSError("database is locked")

    monkeypatch.setattr(store, "claim", unavailable)  # what the worker claims a row with
    monkeypatch.setattr(worker_module, "FAILURE_BACKOFF_S", (0.4, 5.0))
    started = time.monotonic()
    await asyncio.wait_for(job_worker._on_row(delivery), 5)  # type: ignore[arg-type]
    assert delivery.settled == ["nack requeue=True"]
    assert time.monotonic() - started >= 0.2  # the first backoff, jittered down by at most half
    assert job_worker.concurrency.in_flight == 0 and adapter.deadlines == []


def test_the_failure_backoff_doubles_with_each_delivery_up_to_its_cap() -> None:
    first, most = worker_module.FAILURE_BACKOFF_S
    for deliveries, full in ((1, first), (2, 2 * first), (3, 4 * first), (40, most)):
        for _ in range(20):
            assert full / 2 <= worker_module.failure_backoff_s(deliveries) <= full


async def test_the_sweep_ends_the_rows_of_an_expired_job_that_no_message_will_end(stand_in, store, monkeypatch) -> None:  # noqa: F811
    """One row's message dead-lettered by the broker (pending for ever), one row's worker killed
    with its message lost (running for ever): the sweep stores a result for each, so the job ends."""
    import asyncio

    adapter, path = stand_in
    job_worker = worker(store, path, WORKER_ROW_TIMEOUT_CEILING_S="0.2", WORKER_ROW_TIMEOUT_FLOOR_S="0.05", WORKER_ROW_TIMEOUT_S="0.1")
    monkeypatch.setattr(worker_module, "STRANDED_PENDING_GRACE_S", 0.0)
    await store.accept("j", "t", "", ["queued", "lost"], 0.1)
    await store.claim_row("j", "lost", "a-dead-worker", take_over=False)
    await asyncio.sleep(0.15)
    await job_worker._sweep()  # the running row's grace (the ceiling) is not over yet
    assert (await store.row_states("j")) == {"done": 1, "running": 1}
    await asyncio.sleep(0.2)
    await job_worker._sweep()
    job = await store.get_job("j")
    assert job is not None and job.state == "expired" and job.failed_rows == 2
    codes = {r.custom_id: r.error.code for r in (await store.list_results("j", 10, ""))[0]}
    assert codes == {"queued": "EXPIRED", "lost": "ABORTED"}
    assert (await store.summaries_due(0.0)) == []  # its summary was told when its last row was stored


async def run_with_its_copy(store: JobStore, adapter: object, first_worker: JobWorker, second_worker: JobWorker) -> None:
    """A 10-token row (0.2 s) run by `first_worker`, and its redelivered copy handed to
    `second_worker` mid-run: the row runs once and both messages are acked."""
    import asyncio

    adapter.token_s = 0.02  # type: ignore[attr-defined]  # long enough for the copy to arrive mid-run
    task = await row_task(store, max_tokens=10)
    first, copy = _Delivery(task), _Delivery(task)
    copy.redelivered = True
    running = asyncio.create_task(first_worker._row(first))  # type: ignore[arg-type]
    await asyncio.sleep(0.05)
    await asyncio.wait_for(asyncio.gather(running, second_worker._row(copy)), 10)  # type: ignore[arg-type]
    assert len(adapter.deadlines) == 1  # type: ignore[attr-defined]  # one attempt, one adapter call
    assert first.settled == ["ack"] and copy.settled == ["ack"]
    job = await store.get_job("j")
    assert job is not None and job.completed_rows == 1


async def test_a_copy_of_a_row_this_worker_is_running_waits_for_it_and_is_never_run_twice(stand_in, store) -> None:  # noqa: F811
    """After a lost channel the broker redelivers the rows in flight while their runs go on in this
    process: taking the copy over ran (and billed, and recorded an event for) each row twice."""

    adapter, path = stand_in
    job_worker = worker(store, path)
    await run_with_its_copy(store, adapter, job_worker, job_worker)
    assert job_worker._running == {}


def test_every_row_and_job_outcome_is_exported_at_zero_before_it_happens() -> None:
    """SluiceRowsDeadLettered is increase(...{outcome="dead_lettered"}[15m]) > 0: a series that
    first appears at 3 increases by 0 and the first burst never paged."""
    from prometheus_client import REGISTRY

    for outcome in ("completed", "failed", "expired", "dead_lettered", "given_back", "cancelled", "handed_back", "handed_back_retrying"):
        assert REGISTRY.get_sample_value("sluice_jobs_rows_total", {"outcome": outcome}) is not None, outcome
    for outcome in ("accepted", "rejected", "dead_lettered"):
        assert REGISTRY.get_sample_value("sluice_jobs_accepted_total", {"outcome": outcome}) is not None, outcome


async def heartbeat_at(store: JobStore, job_id: str) -> float | None:
    async with store.db.transaction() as tx:
        row = await tx.fetchone("SELECT heartbeat_at FROM job_rows WHERE job_id = ?", job_id)
    assert row is not None
    return row[0]


async def test_the_heartbeat_refreshes_the_rows_this_worker_runs_and_no_other(stand_in, store, monkeypatch) -> None:  # noqa: F811
    """Without it another worker cannot tell a row whose worker is alive from one whose worker died."""
    import asyncio
    import time

    from sluice_gateway.jobs import store as store_module

    adapter, path = stand_in
    adapter.token_s = 0.05  # 10 tokens: 0.5 s, several beats
    monkeypatch.setattr(store_module, "HEARTBEAT_S", 0.05)
    job_worker = worker(store, path)
    task = await row_task(store, max_tokens=10)
    long_ago = time.time() - 100
    for job_id, claimer in (("elsewhere", "another-worker"), ("left", job_worker.worker_id)):
        # Another worker's row, and one this worker claimed but no longer runs (its run ended unfinished).
        await store.accept(job_id, "t", "", ["r"], 3600.0)
        await store.claim_row(job_id, "r", claimer, take_over=False, now=long_ago)
    beats = asyncio.create_task(job_worker._heartbeat_forever())
    try:
        running = asyncio.create_task(job_worker._row(_Delivery(task)))  # type: ignore[arg-type]
        await asyncio.sleep(0.15)
        first = await heartbeat_at(store, "j")
        await asyncio.sleep(0.2)
        assert first is not None and (await heartbeat_at(store, "j") or 0.0) > first
        await asyncio.wait_for(running, 10)
    finally:
        beats.cancel()
    assert await heartbeat_at(store, "elsewhere") == await heartbeat_at(store, "left") == long_ago


async def test_a_redelivered_copy_of_a_row_another_worker_runs_waits_and_never_runs_it_twice(stand_in, store, monkeypatch) -> None:  # noqa: F811
    """After a lost channel the broker redelivered a row in flight to another worker, which took it
    over while the first still ran it: the row ran (and was billed) twice."""

    from sluice_gateway.jobs import store as store_module

    adapter, path = stand_in
    monkeypatch.setattr(store_module, "HEARTBEAT_S", 0.05)  # how often the waiting copy asks again
    first_worker, second_worker = worker(store, path), worker(store, path)
    await run_with_its_copy(store, adapter, first_worker, second_worker)
    assert second_worker.concurrency.in_flight == 0  # it did not hold a slot while it waited


async def test_a_redelivered_copy_runs_the_row_its_other_worker_gave_back_on_a_lost_channel(stand_in, store, monkeypatch) -> None:  # noqa: F811
    """The first worker's run ends given back (back to pending) but its nack is lost with its
    channel: the copy, which waited instead of being acked, is the row's only message and runs it."""
    import asyncio

    from sluice_gateway.jobs import store as store_module

    adapter, path = stand_in
    monkeypatch.setattr(store_module, "HEARTBEAT_S", 0.05)
    job_worker = worker(store, path)
    task = await row_task(store, max_tokens=4)
    assert await store.claim_row("j", "r", "the-first-worker", take_over=False) == "claimed"
    copy = _Delivery(task)
    copy.redelivered = True
    waiting = asyncio.create_task(job_worker._row(copy))  # type: ignore[arg-type]
    await asyncio.sleep(0.2)
    assert copy.settled == [] and adapter.deadlines == []  # waits: neither run nor acked
    await store.release_row("j", "r", "the-first-worker")  # the first worker gives it back; its nack never reaches the broker
    await asyncio.wait_for(waiting, 10)
    assert copy.settled == ["ack"] and len(adapter.deadlines) == 1
    job = await store.get_job("j")
    assert job is not None and job.completed_rows == 1


async def test_a_stopping_worker_lets_the_rows_it_abandons_be_taken_over_at_once(stand_in, store) -> None:  # noqa: F811
    """Its rows' redelivered copies would otherwise wait for their heartbeat to go stale."""
    import asyncio

    adapter, path = stand_in
    adapter.stalled = True
    stopping, other = worker(store, path), worker(store, path)
    task = await row_task(store, max_tokens=4)
    running = asyncio.create_task(stopping._row(_Delivery(task)))  # type: ignore[arg-type]
    await asyncio.sleep(0.1)
    assert await store.claim_row("j", "r", other.worker_id, take_over=True) == "busy"
    stopping._tasks.add(running)
    await stopping.stop(0.05)  # the run is cut at the end of the grace, its message left unacked
    assert await store.claim_row("j", "r", other.worker_id, take_over=True) == "claimed"


async def test_a_row_logs_its_own_request_id_and_its_job_s(stand_in, store, monkeypatch) -> None:  # noqa: F811
    """A row's request id is its own (the adapter's lines for its generation carry it); its job's,
    the submission's, rides on the row message so that the row's lines name it (job_request_id)."""
    import structlog

    from sluice_common.request_context import bind_request_id
    from sluice_gateway.jobs import worker as worker_module

    seen: list[dict[str, object]] = []

    async def recording_run_row(path, task, request_id, timeout_s):  # noqa: ANN001, ANN202 - run_row's own
        seen.append({**structlog.contextvars.get_contextvars(), "given": request_id})
        return await run_row(path, task, request_id, timeout_s)

    monkeypatch.setattr(worker_module, "run_row", recording_run_row)
    _, path = stand_in
    job_worker = worker(store, path)
    task = await row_task(store, max_tokens=2)

    class Exchange:  # what the job's fan-out publishes the row message on
        published: list[object] = []

        async def publish(self, message: object, routing_key: str) -> None:
            self.published.append(message)

    job_worker._exchange = Exchange()  # type: ignore[assignment]
    bind_request_id("req-submit-7")  # the job message's, as _on_job binds it
    await job_worker._publish_row(task)
    delivery = _Delivery(task)
    delivery.headers = dict(Exchange.published[0].headers)  # type: ignore[attr-defined]
    await job_worker._on_row(delivery)  # type: ignore[arg-type]
    assert delivery.settled == ["ack"]
    (context,) = seen
    assert context["job_request_id"] == "req-submit-7"
    assert context["request_id"] == context["given"] != "req-submit-7"


async def test_a_row_that_waits_out_its_slot_wait_is_handed_back_unstarted_and_uncounted(stand_in, store) -> None:  # noqa: F811
    """Held unacked for a slot past the broker's consumer timeout, the row's message made the broker
    close the channel (every row on it requeued, each delivery counted); given back with a nack it
    would spend the delivery limit of rows that never ran. A copy goes back instead, the deliveries
    it had and its being a redelivery in headers of its own, and the message is acked."""
    import asyncio

    adapter, path = stand_in
    job_worker = worker(
        store, path, WORKER_CONSUMER_TIMEOUT_S="3", WORKER_ROW_TIMEOUT_CEILING_S="2.5", WORKER_ROW_TIMEOUT_FLOOR_S="0.5",
        WORKER_ROW_TIMEOUT_S="2",
    )  # fmt: skip
    assert job_worker.config.slot_wait_s == pytest.approx(0.35)

    class Exchange:
        published: list[tuple[object, str]] = []

        async def publish(self, message: object, routing_key: str) -> None:
            self.published.append((message, routing_key))

    job_worker._exchange = Exchange()  # type: ignore[assignment]
    for _ in range(int(job_worker.concurrency.bound)):  # every slot taken by a running row
        await job_worker.concurrency.acquire()
    delivery = _Delivery(await row_task(store, max_tokens=4))
    delivery.headers = {"x-delivery-count": 2, "x-sluice-job-id": "j"}
    delivery.redelivered = True
    delivery.message_id, delivery.type, delivery.content_type, delivery.timestamp = "j/r", worker_module.ROW_TYPE, "application/x-protobuf", None  # type: ignore[attr-defined]
    await asyncio.wait_for(job_worker._row(delivery), 5)  # type: ignore[arg-type]
    assert delivery.settled == ["ack"] and adapter.deadlines == []
    [(copy, routing_key)] = Exchange.published
    assert routing_key == "row" and copy.body == delivery.body  # type: ignore[attr-defined]
    assert copy.type == worker_module.ROW_TYPE  # type: ignore[attr-defined]  # read as a row again (_row checks it)
    assert copy.headers == {  # type: ignore[attr-defined]
        "x-sluice-job-id": "j", worker_module.EARLIER_DELIVERIES_HEADER: 2, worker_module.REDELIVERED_HEADER: True
    }  # fmt: skip
    again = types.SimpleNamespace(headers=copy.headers, redelivered=False)  # type: ignore[attr-defined]  # the copy, delivered
    assert worker_module._deliveries(again) == 3 and worker_module._redelivered(again)  # type: ignore[arg-type]
    assert await store.row_states("j") == {"pending": 1}


# ---- a row's retries within one delivery: none ends past WorkerSettings.hold_s of its delivery

# The broker's consumer timeout, told: 1.9 s of it held at most with work going on (hold_s); a 1.6 s
# ceiling (85% is 1.7). An embedding's warm-up deadline is WORKER_ROW_TIMEOUT_S whatever was seen, so
# a cut row's deadlines are 0.2, 0.4, 0.8, then the ceiling.
SHORT_CONSUMER_TIMEOUT = {
    "WORKER_CONSUMER_TIMEOUT_S": "2", "WORKER_ROW_TIMEOUT_CEILING_S": "1.6", "WORKER_ROW_TIMEOUT_FLOOR_S": "0.1",
    "WORKER_ROW_TIMEOUT_S": "0.2",
}  # fmt: skip


class _Broker:
    """What a handed-back row message meets: the exchange its copy is published on, and the copy
    delivered again (its headers; a publish, not a redelivery)."""

    def __init__(self) -> None:
        self.published: list[object] = []

    async def publish(self, message: object, routing_key: str) -> None:
        assert routing_key == "row"
        self.published.append(message)

    def redeliver(self) -> _Timed:
        [copy] = self.published
        self.published.clear()
        delivery = _Timed(jobs_pb2.RowTask.FromString(copy.body))  # type: ignore[attr-defined]
        delivery.headers = dict(copy.headers)  # type: ignore[attr-defined]
        return delivery


class _Timed(_Delivery):
    """A row message that knows how long it was held unacked, from its delivery (`_row`) to its ack."""

    def __init__(self, task: jobs_pb2.RowTask) -> None:
        super().__init__(task)
        self.message_id, self.type, self.content_type, self.timestamp = "j/e", worker_module.ROW_TYPE, "application/x-protobuf", None
        self.held_s = 0.0

    async def run_on(self, job_worker: JobWorker) -> None:
        import asyncio
        import time

        delivered = time.monotonic()
        try:
            # Bounded: the code before this fix held the row (its waits, its attempts) past any bound.
            await asyncio.wait_for(job_worker._row(self), 2 * job_worker.config.consumer_timeout_s)  # type: ignore[arg-type]
        finally:
            self.held_s = time.monotonic() - delivered


def row_worker(store: JobStore, broker: _Broker) -> JobWorker:
    job_worker = worker(store, None, **SHORT_CONSUMER_TIMEOUT)
    job_worker._exchange = broker  # type: ignore[assignment]
    return job_worker


async def embed_task(store: JobStore) -> jobs_pb2.RowTask:
    await store.accept("j", "t", "", ["e"], 3600.0)
    return jobs_pb2.RowTask(job_id="j", tenant="t", row=jobs_pb2.JobRow(custom_id="e", embed=jobs_pb2.EmbedRow(model="m", inputs=["a"])))


def stand_in_path(monkeypatch: pytest.MonkeyPatch, *answers: str) -> list[float]:
    """run_row stood in for: each attempt, the next of `answers` ("cut": its deadline passes, as an
    overloaded engine's does; "limited": RESOURCE_EXHAUSTED, retry in 10 s; "ok"), the last one for
    every attempt after. Returns the deadline of each attempt, as it is given."""
    import asyncio

    from sluice_common.errors import DeadlineExceeded, ResourceExhausted
    from sluice_gateway.jobs.job import RowRun

    given: list[float] = []

    async def run(path: object, task: jobs_pb2.RowTask, request_id: str, timeout_s: float) -> RowRun:
        given.append(timeout_s)
        answer = answers[min(len(given), len(answers)) - 1]
        if answer == "cut":
            await asyncio.sleep(timeout_s)
            raise DeadlineExceeded("the row's deadline passed")
        if answer == "limited":
            raise ResourceExhausted("the tenant's requests per minute are spent", retry_after_s=10.0)
        return RowRun(jobs_pb2.RowResult(job_id=task.job_id, custom_id=task.row.custom_id, output="ok"), 0.01)

    monkeypatch.setattr(worker_module, "run_row", run)
    return given


async def test_a_row_cut_again_and_again_is_handed_back_before_its_delivery_ends_and_goes_on_from_there(store, monkeypatch) -> None:
    """Each retry of a cut row (twice the deadline) ran inside the same unacked delivery: with the
    defaults 120, 240, 480, 960 s, then the ceiling's 1,500 s, past RabbitMQ's 30-minute consumer
    timeout, and the broker closed the channel, requeueing every row on it with a delivery counted.
    The row is handed back before an attempt that could not end in time, carrying the deadline that
    cut its last attempt; its next delivery, on any worker, tries it at twice that, not from the start."""
    given = stand_in_path(monkeypatch, "cut")
    broker = _Broker()
    first_worker = row_worker(store, broker)
    assert first_worker.config.hold_s == pytest.approx(1.9)
    delivery = _Timed(await embed_task(store))
    await delivery.run_on(first_worker)
    # 0.2 + 0.4 + 0.8 s; 1.6 s more would end past 1.9 s from the delivery.
    assert given == [pytest.approx(0.2), pytest.approx(0.4), pytest.approx(0.8)]
    assert delivery.settled == ["ack"] and delivery.held_s < first_worker.config.hold_s
    copy = broker.redeliver()
    assert copy.headers[worker_module.CUT_AT_HEADER] == pytest.approx(0.8)
    assert copy.headers[worker_module.TRANSIENT_ERRORS_HEADER] == 0
    assert worker_module._deliveries(copy) == 1  # no delivery counted against the row  # type: ignore[arg-type]
    assert await store.row_states("j") == {"pending": 1}  # released: the copy claims it
    # Another worker, which has seen no row yet (its own first deadline would be 0.2 s), delivered the copy.
    other_worker = row_worker(store, broker)
    await copy.run_on(other_worker)
    assert given[3:] == [pytest.approx(1.6)]  # the ceiling: where the doubling had got to
    assert copy.settled == ["ack"] and copy.held_s < other_worker.config.hold_s
    [result] = (await store.list_results("j", 10, ""))[0]
    assert result.error.code == "DEADLINE_EXCEEDED" and "the longest a row attempt may take" in result.error.message
    assert not broker.published


async def test_a_row_told_to_wait_past_its_delivery_s_end_is_handed_back_then_and_goes_on_from_there(store, monkeypatch) -> None:
    """RESOURCE_EXHAUSTED told the row to wait longer than its delivery may last: it waited in the
    same unacked delivery, past the broker's consumer timeout. It waits what the delivery allows (not
    handed back at once, to come straight back and be told again, in a loop), is handed back, and
    its next delivery tries it at the deadline its retries had got to."""
    given = stand_in_path(monkeypatch, "cut", "limited", "ok")
    broker = _Broker()
    first_worker = row_worker(store, broker)
    delivery = _Timed(await embed_task(store))
    await delivery.run_on(first_worker)
    assert given == [pytest.approx(0.2), pytest.approx(0.4)]  # cut, then limited: 10 s to wait
    assert delivery.settled == ["ack"]
    # It waited until hold_s (1.9 s) of the delivery; the hand-back itself (the store's release, the
    # copy, the ack) within what the consumer timeout keeps beyond it for settling.
    assert first_worker.config.hold_s <= delivery.held_s < first_worker.config.consumer_timeout_s
    copy = broker.redeliver()
    assert copy.headers[worker_module.CUT_AT_HEADER] == pytest.approx(0.2)
    assert worker_module._deliveries(copy) == 1  # type: ignore[arg-type]
    assert await store.row_states("j") == {"pending": 1}
    other_worker = row_worker(store, broker)
    await copy.run_on(other_worker)
    assert given[2:] == [pytest.approx(0.4)]  # twice the cut deadline, not the first deadline's 0.2 s
    assert copy.settled == ["ack"] and not broker.published
    job = await store.get_job("j")
    assert job is not None and job.completed_rows == 1


def test_a_row_message_s_retry_chain_is_read_from_its_headers_and_only_from_numbers() -> None:
    """What the worker itself wrote (floats and ints through AMQP), text of them, or nothing usable:
    a header that is not a positive finite number leaves the chain where a first delivery starts it."""
    chain_of = worker_module.RetryChain.of
    cut, errors = worker_module.CUT_AT_HEADER, worker_module.TRANSIENT_ERRORS_HEADER
    written = worker_module.RetryChain(0.8, 2)
    assert chain_of(types.SimpleNamespace(headers=written.headers())) == written  # type: ignore[arg-type]
    assert chain_of(types.SimpleNamespace(headers={cut: b"0.8", errors: "2"})) == written  # type: ignore[arg-type]
    assert chain_of(types.SimpleNamespace(headers=None)) == worker_module.RetryChain()  # type: ignore[arg-type]
    for bad in ("x", -1.0, float("inf"), float("nan"), [1], 0):
        assert chain_of(types.SimpleNamespace(headers={cut: bad, errors: bad})) == worker_module.RetryChain()  # type: ignore[arg-type]
