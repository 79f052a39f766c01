"""The producer contract: parsing JSON and protobuf job messages, validation, replies, retry policy."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from sluice.jobs.v1 import jobs_pb2

from sluice_common.errors import ResourceExhausted, Unavailable
from sluice_gateway.config import SharedSettings
from sluice_gateway.jobs.job import (
    EXPIRED_CODE,
    JSON,
    PACED,
    TRANSIENT,
    ADMITTED_TYPE,
    REQUEST_TYPE,
    JobRejected,
    authenticate_job,
    backoff_s,
    code_of,
    completion_window_s,
    encode_reply,
    expired_result,
    forbidden_reply_to,
    format_duration,
    job_message_type,
    paced_delay_s,
    parse_admitted,
    parse_job,
    row_tasks,
    validate_job,
    without_api_key,
)
from sluice_common.tenants import Tenant, TenantDirectory

TENANTS_FILE = Path(__file__).resolve().parents[3] / "config" / "tenants.toml"
TENANTS = TenantDirectory.from_file(TENANTS_FILE)
KEY = "sk-sluice-demo"


def intake(job: jobs_pb2.JobRequest, max_rows: int = 100) -> Tenant:
    """What the worker does with a producer's JobRequest: its key checked once, then the rest."""
    tenant = authenticate_job(job, TENANTS)
    validate_job(job, tenant.name, max_rows)
    return tenant


def job_json(**overrides: object) -> bytes:
    document = {
        "job_id": "job-1",
        "api_key": KEY,
        "reply_to": "my-results",
        "rows": [
            {
                "custom_id": "a",
                "generate": {
                    "model": "smollm2-135m-instruct",
                    "messages": [{"role": "user", "content": "Hi"}],
                    "sampling": {"max_tokens": 4},
                },
            },
            {"custom_id": "b", "embed": {"model": "all-minilm-l6-v2", "inputs": ["hello"]}},
        ],
    }
    document.update(overrides)
    return json.dumps(document).encode()


def test_the_readme_json_parses_and_validates() -> None:
    job = parse_job(job_json(), "application/json")
    tenant = intake(job)
    assert tenant.name == "demo"
    assert [r.custom_id for r in job.rows] == ["a", "b"]
    assert job.rows[0].generate.sampling.max_tokens == 4
    tasks = row_tasks(job, tenant, JSON)
    assert [t.row.custom_id for t in tasks] == ["a", "b"]
    assert all(t.tenant == "demo" and t.reply_content_type == JSON for t in tasks)
    assert [t.row.custom_id for t in row_tasks(job, tenant, JSON, only={"b"})] == ["b"]


def test_protobuf_and_camel_case_json_are_accepted() -> None:
    job = parse_job(job_json(), "application/json")
    assert parse_job(job.SerializeToString(), "application/x-protobuf") == job
    camel = json.dumps({"jobId": "j", "apiKey": KEY, "replyTo": "q", "rows": [{"customId": "x"}]}).encode()
    assert parse_job(camel, "application/json").rows[0].custom_id == "x"


def test_the_reply_to_property_is_used_when_the_body_names_none() -> None:
    assert parse_job(job_json(reply_to=""), "application/json", "from-property").reply_to == "from-property"


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"{not json", "not a JobRequest"),
        (json.dumps({"job_id": "j", "rows": "nope", "reply_to": "q"}).encode(), "not a JobRequest"),
        # Nested past the parser's depth: salvaging the ids raised RecursionError, and the message
        # went back to the queue until its delivery limit instead of being rejected at once.
        (b"[" * 5000, "recursion depth"),
        (b'{"job_id": "j", "reply_to": "q", "rows": ' + b"[" * 5000 + b"}", "recursion depth"),
    ],
)
def test_unparsable_bodies_are_rejected_with_what_can_be_salvaged(body: bytes, reason: str) -> None:
    with pytest.raises(JobRejected) as caught:
        parse_job(body, "application/json")
    assert reason in caught.value.reason
    if body.startswith(b'{"') and len(body) < 5000:  # one nested too deeply is no JSON to salvage from
        assert (caught.value.job_id, caught.value.reply_to) == ("j", "q")


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"job_id": ""}, "job_id is required"),
        ({"api_key": "sk-wrong"}, "api_key"),
        ({"rows": []}, "at least one row"),
        ({"rows": [{"custom_id": "a"}, {"custom_id": "a"}]}, "repeated"),
        ({"rows": [{"custom_id": ""}]}, "custom_id is required"),
        # AMQP message ids hold 255 bytes: "<job_id>/summary" and "<job_id>/<custom_id>" must fit.
        ({"job_id": "j" * 248}, "the job's summary carries"),
        ({"job_id": "é" * 124}, "the job's summary carries"),
        ({"job_id": "j" * 200, "rows": [{"custom_id": "c" * 60}]}, "job_id and custom_id together"),
        ({"job_id": "j\x00"}, "job_id must not contain U+0000"),
        ({"rows": [{"custom_id": "a\x00b"}]}, "rows[0].custom_id must not contain U+0000"),
    ],
)
def test_malformed_jobs_are_rejected_with_a_reason(overrides: dict[str, object], reason: str) -> None:
    job = parse_job(job_json(**overrides), "application/json")
    with pytest.raises(JobRejected) as caught:
        intake(job)
    assert reason in caught.value.reason
    assert caught.value.reply_to == "my-results"


def test_too_many_rows() -> None:
    with pytest.raises(JobRejected, match="at most 1 per job"):
        intake(parse_job(job_json(), JSON), max_rows=1)


def test_a_bad_key_is_rejected_with_what_the_producer_needs_and_no_tenant() -> None:
    with pytest.raises(JobRejected) as caught:
        intake(parse_job(job_json(api_key="sk-wrong"), JSON))
    rejection = caught.value
    assert (rejection.reason, rejection.job_id, rejection.reply_to, rejection.tenant) == ("api_key: invalid API key", "job-1", "my-results", "")


def test_the_job_checks_but_the_key_name_the_tenant_in_their_rejection_and_ids_do_not() -> None:
    job = parse_job(job_json(rows=[]), JSON)
    with pytest.raises(JobRejected) as caught:
        validate_job(job, "demo", 100)
    assert caught.value.tenant == "demo"  # so the worker records the job as failed for it
    job = parse_job(job_json(job_id=""), JSON)
    with pytest.raises(JobRejected) as caught:
        validate_job(job, "demo", 100)
    assert caught.value.tenant == ""  # no usable id: nothing to record


@pytest.mark.parametrize(
    ("message_type", "kind"),
    [
        ("", REQUEST_TYPE),  # the producer contract never asked for a type
        ("sluice.jobs.v1.JobRequest", REQUEST_TYPE),
        ("my-app.job", REQUEST_TYPE),  # a producer's own label: still a JobRequest
        ("sluice.jobs.v1.AdmittedJob", ADMITTED_TYPE),
        ("sluice.jobs.v1.RowTask", None),  # Sluice's, but not for this queue
        ("sluice.jobs.v2.AdmittedJob", None),  # a newer gateway's: dead-lettered, never misread
    ],
)
def test_job_messages_are_told_apart_by_their_amqp_type(message_type: str, kind: str | None) -> None:
    assert job_message_type(message_type) == kind


def test_an_admitted_job_names_its_tenant_and_carries_no_key() -> None:
    job = parse_job(job_json(api_key=""), JSON)
    admitted = jobs_pb2.AdmittedJob(job=job, tenant="private", text_logging=False)
    parsed, tenant = parse_admitted(admitted.SerializeToString(), "application/x-protobuf")
    assert parsed == job and tenant == Tenant("private", text_logging=False)
    validate_job(parsed, tenant.name, 100)
    # The reply_to property stands in for an empty one, as for a JobRequest.
    job.reply_to = ""
    parsed, _ = parse_admitted(jobs_pb2.AdmittedJob(job=job, tenant="demo").SerializeToString(), "", "from-property")
    assert parsed.reply_to == "from-property"


@pytest.mark.parametrize(
    ("body", "content_type", "reason"),
    [
        (jobs_pb2.AdmittedJob(job=jobs_pb2.JobRequest(job_id="j", reply_to="q")).SerializeToString(), "application/x-protobuf", "names its tenant"),
        (b"\xff\xff not protobuf", "application/x-protobuf", "not an AdmittedJob"),
        (b"{}", "application/json", "unsupported content type"),
    ],
)
def test_a_malformed_admitted_job_is_rejected(body: bytes, content_type: str, reason: str) -> None:
    with pytest.raises(JobRejected, match=reason):
        parse_admitted(body, content_type)


def test_replies_are_json_with_proto_field_names_or_protobuf() -> None:
    result = jobs_pb2.RowResult(job_id="j", custom_id="a", output="hi")
    assert json.loads(encode_reply(result, JSON)) == {"job_id": "j", "custom_id": "a", "output": "hi"}
    assert jobs_pb2.RowResult.FromString(encode_reply(result, "application/x-protobuf")) == result


def test_error_classes_and_backoff() -> None:
    assert code_of(ResourceExhausted("x")) in PACED
    assert code_of(Unavailable("x")) in TRANSIENT
    rng = random.Random(1)
    delays = [backoff_s(a, 0.25, 4.0, rng) for a in range(12)]
    assert all(0 <= d <= 4.0 for d in delays)
    assert max(delays[6:]) > 0.5  # grows, then is capped
    assert 1.0 <= paced_delay_s(1.0, rng) <= 1.25


# ---- completion windows


def test_the_completion_window_is_a_json_duration_or_the_default() -> None:
    job = parse_job(job_json(completion_window="3600s"), JSON)
    intake(job)
    assert completion_window_s(job, 86400.0) == 3600.0
    assert completion_window_s(parse_job(job_json(completion_window="0.5s"), JSON), 86400.0) == 0.5
    assert completion_window_s(parse_job(job_json(), JSON), 86400.0) == 86400.0
    # protobuf producers: the same field
    assert completion_window_s(jobs_pb2.JobRequest.FromString(job.SerializeToString()), 1.0) == 3600.0


@pytest.mark.parametrize("window", ["0s", "-5s", "604801s"])
def test_a_completion_window_out_of_range_is_rejected(window: str) -> None:
    with pytest.raises(JobRejected, match="completion_window") as caught:
        intake(parse_job(job_json(completion_window=window), JSON))
    assert caught.value.tenant == "demo"  # recorded as a failed job of the tenant
    intake(parse_job(job_json(completion_window="604800s"), JSON))  # the longest allowed


def test_a_completion_window_that_is_not_a_duration_is_rejected() -> None:
    with pytest.raises(JobRejected, match="not a JobRequest"):
        parse_job(job_json(completion_window="1h"), JSON)


def test_an_expired_row_says_what_happened_and_what_to_do() -> None:
    task = jobs_pb2.RowTask(job_id="j", row=jobs_pb2.JobRow(custom_id="a"))
    result = expired_result(task, 3600.0)
    assert (result.job_id, result.custom_id, result.error.code, result.output) == ("j", "a", EXPIRED_CODE, "")
    assert "completion window (1h) ended before this row ran" in result.error.message
    assert "completion_window" in result.error.message
    assert "()" not in expired_result(task, None).error.message
    assert [format_duration(x) for x in (1.0, 0.25, 90, 5400, 86400, 90061)] == ["1s", "0.25s", "1m30s", "1h30m", "1d", "1d1h1m1s"]


def test_the_summary_is_told_as_json_or_protobuf() -> None:
    job = jobs_pb2.Job(job_id="j", state=jobs_pb2.JOB_STATE_EXPIRED, total_rows=3, completed_rows=1, failed_rows=2)
    assert json.loads(encode_reply(job, JSON)) == {
        "job_id": "j", "state": "JOB_STATE_EXPIRED", "total_rows": 3, "completed_rows": 1, "failed_rows": 2
    }  # fmt: skip
    assert jobs_pb2.Job.FromString(encode_reply(job, "application/x-protobuf")) == job


def test_the_default_window_is_checked_at_start() -> None:
    assert SharedSettings(tenants_file=TENANTS_FILE).jobs_completion_window_s == 86400.0
    for bad in (0.0, -1.0, 604801.0):
        with pytest.raises(ValueError, match="JOBS_COMPLETION_WINDOW_S"):
            SharedSettings(tenants_file=TENANTS_FILE, jobs_completion_window_s=bad)


def test_only_exhaustion_with_a_retry_time_is_waited_out() -> None:
    from sluice_common.errors import ResourceExhausted
    from sluice_gateway.jobs.job import is_paced

    assert is_paced(ResourceExhausted("later", retry_after_s=3.0))
    assert not is_paced(ResourceExhausted("never: larger than the allowance", retry_after_s=None))
    assert not is_paced(ValueError("not a status"))


@pytest.mark.parametrize("reply_to", ["q" * 256, "é" * 128])
def test_a_reply_to_amqp_cannot_route_is_rejected_and_never_replied_to(reply_to: str) -> None:
    """Publishing to it would fail on every redelivery of each row and of the job's summary."""
    job = parse_job(job_json(reply_to=reply_to), JSON)
    with pytest.raises(JobRejected) as caught:
        intake(job)
    assert "reply_to is over 255 bytes" in caught.value.reason
    assert caught.value.reply_to == ""  # the rejection is logged and stored, not published there
    assert caught.value.tenant == "demo"
    assert JobRejected("salvaged from a body", "j", reply_to).reply_to == ""
    assert JobRejected("fits", "j", "q" * 255).reply_to == "q" * 255


@pytest.mark.parametrize(
    ("reply_to", "prefix", "refused"),
    [
        ("sluice.jobs.rows", "sluice", True),
        ("sluice.evallog.completions", "sluice", True),
        ("sluice.anything-else", "sluice", True),
        ("acme.jobs.rows", "acme", True),
        ("amq.gen-abc", "sluice", True),
        ("my-results", "sluice", False),
        ("sluice-results", "sluice", False),  # not under "sluice."
        ("acme.jobs.rows", "sluice", False),  # another deployment's prefix: not this one's queue
        ("", "sluice", False),  # no reply_to: nothing is told
    ],
)
def test_a_reply_to_under_the_service_s_prefix_or_amq_is_refused_naming_reply_to(reply_to: str, prefix: str, refused: bool) -> None:
    job = parse_job(job_json(reply_to=reply_to), JSON)
    if not refused:
        validate_job(job, "demo", 100, prefix)
        assert forbidden_reply_to(reply_to, prefix) == ""
        return
    with pytest.raises(JobRejected) as caught:
        validate_job(job, "demo", 100, prefix)
    rejection = caught.value
    assert rejection.field == "reply_to" and reply_to in rejection.reason
    # Recorded failed for its tenant, but told nowhere: not to the queue it names.
    assert (rejection.tenant, rejection.job_id, rejection.reply_to) == ("demo", "job-1", "")


def test_an_api_key_is_taken_out_of_a_job_body_and_nothing_else() -> None:
    document = json.loads(job_json())
    redacted = without_api_key(job_json(), JSON, "sluice.jobs.v2.JobRequest", TENANTS)
    assert redacted is not None and json.loads(redacted) == {k: v for k, v in document.items() if k != "api_key"}
    assert without_api_key(job_json(api_key=""), JSON, "", TENANTS) is not None  # the field, even empty, goes
    assert without_api_key(json.dumps({k: v for k, v in document.items() if k != "api_key"}).encode(), JSON, "", TENANTS) is None
    # A body that does not parse: the value blanked in place.
    broken = b'{"job_id": "j", "apiKey" : "sk-sluice-d\\"emo", "rows": ['
    assert without_api_key(broken, JSON, "", TENANTS) == b'{"job_id": "j", "apiKey" : "", "rows": ['
    # Protobuf: under a JobRequest type whatever the key; under another type only a key a tenant holds.
    job = parse_job(job_json(api_key="sk-unknown"), JSON)
    stripped = without_api_key(job.SerializeToString(), "application/x-protobuf", "sluice.jobs.v9.JobRequest", TENANTS)
    assert stripped is not None and jobs_pb2.JobRequest.FromString(stripped).api_key == ""
    assert without_api_key(job.SerializeToString(), "application/x-protobuf", "sluice.jobs.v9.Other", TENANTS) is None
    job.api_key = KEY
    stripped = without_api_key(job.SerializeToString(), "", "sluice.jobs.v9.Other", TENANTS)
    assert stripped is not None and KEY.encode() not in stripped
    # An AdmittedJob's field 2 is its tenant: kept.
    admitted = jobs_pb2.AdmittedJob(job=jobs_pb2.JobRequest(job_id="j"), tenant="demo").SerializeToString()
    assert without_api_key(admitted, "application/x-protobuf", "sluice.jobs.v2.AdmittedJob", TENANTS) is None
