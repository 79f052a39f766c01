"""The producer contract: parsing JSON and protobuf job messages, validation, replies, retry policy."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from sluice.jobs.v1 import jobs_pb2

from sluice_common.errors import ResourceExhausted, Unavailable
from sluice_gateway.jobs import (
    JSON,
    PACED,
    TRANSIENT,
    JobRejected,
    backoff_s,
    code_of,
    encode_reply,
    paced_delay_s,
    parse_job,
    row_tasks,
    validate_job,
)
from sluice_gateway.tenants import TenantDirectory

TENANTS = TenantDirectory.from_file(Path(__file__).resolve().parents[3] / "config" / "tenants.toml")
KEY = "sk-sluice-demo"


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
    tenant = validate_job(job, TENANTS, 100)
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
    ],
)
def test_unparsable_bodies_are_rejected_with_what_can_be_salvaged(body: bytes, reason: str) -> None:
    with pytest.raises(JobRejected) as caught:
        parse_job(body, "application/json")
    assert reason in caught.value.reason
    if body.startswith(b'{"'):
        assert (caught.value.job_id, caught.value.reply_to) == ("j", "q")


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"job_id": ""}, "job_id is required"),
        ({"api_key": "sk-wrong"}, "api_key"),
        ({"rows": []}, "at least one row"),
        ({"rows": [{"custom_id": "a"}, {"custom_id": "a"}]}, "repeated"),
        ({"rows": [{"custom_id": ""}]}, "custom_id is required"),
    ],
)
def test_malformed_jobs_are_rejected_with_a_reason(overrides: dict[str, object], reason: str) -> None:
    job = parse_job(job_json(**overrides), "application/json")
    with pytest.raises(JobRejected) as caught:
        validate_job(job, TENANTS, 100)
    assert reason in caught.value.reason
    assert caught.value.reply_to == "my-results"


def test_too_many_rows() -> None:
    with pytest.raises(JobRejected, match="at most 1 per job"):
        validate_job(parse_job(job_json(), JSON), TENANTS, 1)


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
