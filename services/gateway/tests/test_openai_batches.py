"""The Batch API mapping (openai_front.batches): input lines checked and converted with the HTTP front's
own converters, jobs_pb2.Job as OpenAI's Batch object, RowResults as output/error lines; shapes
checked against OpenAI's documented examples (tests/fixtures/upstream) and the openai package's types."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from openai.types import Batch, CreateEmbeddingResponse
from openai.types.chat import ChatCompletion
from openai.types.completion import Completion
from sluice.common.v1 import types_pb2
from sluice.jobs.v1 import jobs_pb2

from sluice_gateway.openai_front.batches import (
    batch_object,
    check_endpoint,
    job_request,
    parse_batch_file,
    parse_create,
    result_file_ids,
    result_files,
    settled,
    status_of,
)
from sluice_gateway.jobs.job import generate_request
from sluice_gateway.openai_front import requests as openai_requests
from sluice_gateway.openai_front.errors import OpenAIError

UPSTREAM = Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "upstream"
USAGE = types_pb2.Usage(prompt_tokens=7, completion_tokens=2, total_tokens=9, cached_tokens=4)


def line(custom_id: str, body: dict, url: str = "/v1/chat/completions", **extra: object) -> str:  # type: ignore[type-arg]
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body, **extra})


CHAT = {"model": "g", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


def refused(content: str) -> OpenAIError:
    with pytest.raises(OpenAIError) as caught:
        parse_batch_file(content.encode(), max_lines=10)
    assert caught.value.status == 400
    return caught.value


def test_the_mapping_modules_import_no_grpc() -> None:
    # The domain modules are plain: grpc is the servicer's (checked in a fresh interpreter).
    import subprocess

    code = "import sys, sluice_gateway.openai_front.batches, sluice_gateway.openai_front.store; print('grpc' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_upstream_input_lines_become_generate_rows() -> None:
    lines = parse_batch_file((UPSTREAM / "openai_batch_input.jsonl").read_bytes(), max_lines=10)
    assert [x.custom_id for x in lines] == ["request-1", "request-2"] and [x.line for x in lines] == [1, 2]
    job = job_request("batch_x", "sk", lines, "24h")
    assert job.job_id == "batch_x" and job.api_key == "sk" and job.completion_window.seconds == 86400
    row = job.rows[0]
    assert row.custom_id == "request-1" and row.WhichOneof("body") == "generate"
    assert row.generate.model == "gpt-3.5-turbo-0125" and row.generate.sampling.max_tokens == 1000
    assert [(m.role, m.content) for m in row.generate.messages] == [("system", "You are a helpful assistant."), ("user", "Hello world!")]
    # OpenAI's defaults, as the synchronous endpoint sets them.
    assert row.generate.sampling.temperature == 1.0 and row.generate.sampling.top_p == 1.0


def test_completion_and_embedding_lines() -> None:
    content = "\n".join(
        [
            line("c", {"model": "g", "prompt": "Once", "max_tokens": 3, "stop": ["."]}, "/v1/completions"),
            line("e", {"model": "e", "input": ["a", "b"]}, "/v1/embeddings"),
            "",
        ]
    )
    job = job_request("b", "k", parse_batch_file(content.encode(), 10), "24h")
    assert job.rows[0].generate.prompt == "Once" and list(job.rows[0].generate.sampling.stop) == ["."]
    assert job.rows[1].embed.model == "e" and list(job.rows[1].embed.inputs) == ["a", "b"]


def test_a_token_id_prompt_line_becomes_a_row_with_its_ids_and_a_prompt_list_is_refused() -> None:
    """A job row carries token ids as GatewayService.Generate does (the worker runs it through the
    same path); a line takes one prompt, each prompt of a list being a line of its own."""
    content = line("t", {"model": "g", "prompt": [5, 6, 7], "max_tokens": 3}, "/v1/completions")
    [row] = job_request("b", "k", parse_batch_file(content.encode(), 10), "24h").rows
    assert list(row.generate.prompt_token_ids) == [5, 6, 7] and row.generate.prompt == ""
    assert list(generate_request(row.generate).prompt_token_ids) == [5, 6, 7]
    listed = refused(line("l", {"model": "g", "prompt": ["a", "b"]}, "/v1/completions"))
    assert "Line 1" in listed.message and listed.param == "body.prompt"


def test_bad_lines_are_refused_naming_the_line() -> None:
    ok = line("a", CHAT)
    repeated = refused("\n".join([ok, line("b", CHAT), line("a", CHAT)]))
    assert "Line 3" in repeated.message and "line 1" in repeated.message and repeated.param == "custom_id"
    assert "Line 2" in refused(ok + "\n" + line("b", CHAT).replace('"POST"', '"GET"')).message
    wrong_url = refused(line("a", CHAT, "/v1/responses"))
    assert "Line 1" in wrong_url.message and wrong_url.param == "url"
    bad_value = refused(ok + "\n" + line("b", {**CHAT, "temperature": "hot"}))
    assert "Line 2" in bad_value.message and bad_value.param == "body.temperature" and bad_value.code == "invalid_type"
    unsupported = refused(line("a", {**CHAT, "audio": {"voice": "alloy"}}))
    assert unsupported.param == "body.audio" and unsupported.code == "unsupported_parameter"
    unknown = refused(line("a", {**CHAT, "best_of": 1}))  # a completions field, even at its neutral value
    assert unknown.param == "body.best_of" and unknown.code == "unknown_parameter"
    assert refused(line("a", {**CHAT, "stream": True})).param == "body.stream"
    assert "not valid JSON" in refused("{not json").message
    assert refused(line("", CHAT)).param == "custom_id"
    assert refused(line("a", CHAT, extra="x")).param == "extra"
    assert refused("\n\n").code == "empty_file"
    assert refused("\n".join(line(str(i), CHAT) for i in range(11))).code == "too_many_requests"


def test_every_line_must_use_the_batchs_endpoint() -> None:
    lines = parse_batch_file("\n".join([line("a", CHAT), line("b", {"model": "g", "prompt": "x"}, "/v1/completions")]).encode(), 10)
    with pytest.raises(OpenAIError, match="Line 2") as caught:
        check_endpoint(lines, "/v1/chat/completions")
    assert caught.value.param == "endpoint"


def test_create_body() -> None:
    create = parse_create({"input_file_id": "file-1", "endpoint": "/v1/embeddings", "completion_window": "24h", "metadata": {"k": "v"}})
    assert (create.input_file_id, create.endpoint, create.completion_window, create.metadata) == ("file-1", "/v1/embeddings", "24h", {"k": "v"})
    base = {"input_file_id": "file-1", "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    for bad, param in (
        ({**base, "completion_window": "48h"}, "completion_window"),
        ({**base, "endpoint": "/v1/responses"}, "endpoint"),
        ({**base, "input_file_id": ""}, "input_file_id"),
        ({**base, "metadata": {"k": 1}}, "metadata.k"),
        ({**base, "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
        ({**base, "extra": 1}, "extra"),
    ):
        with pytest.raises(OpenAIError) as caught:
            parse_create(bad)
        assert caught.value.status == 400 and caught.value.param == param


def job(state: int, total: int = 2, completed: int = 0, failed: int = 0) -> jobs_pb2.Job:
    j = jobs_pb2.Job(job_id="batch_1", tenant="demo", state=state, total_rows=total, completed_rows=completed, failed_rows=failed)
    j.created_at.FromSeconds(1000)
    j.updated_at.FromSeconds(1100)
    j.expires_at.FromSeconds(1000 + 86400)
    return j


def test_batch_object_has_openais_shape_and_states() -> None:
    upstream = json.loads((UPSTREAM / "openai_batch_object.json").read_text())
    reply = batch_object(
        "batch_1", "/v1/chat/completions", "file-1", "24h", {"k": "v"}, 999.5, None, job(jobs_pb2.JOB_STATE_COMPLETED, 2, 1, 1), "file-o", "file-e"
    )
    # OpenAI's example object's fields, less those not set in this state (optional, not nullable
    # in OpenAI's schema: omitted rather than null) and the per-state times the store does not keep.
    unset = {"errors", "in_progress_at", "finalizing_at", "failed_at", "expired_at", "cancelling_at", "cancelled_at"}
    assert set(reply) == set(upstream) - unset and None not in reply.values()
    parsed = Batch.model_validate(reply)
    assert parsed.status == "completed" and parsed.completed_at == 1100 and parsed.created_at == 999
    assert parsed.expires_at == 1000 + 86400 and parsed.output_file_id == "file-o" and parsed.error_file_id == "file-e"
    assert parsed.request_counts is not None and (parsed.request_counts.total, parsed.request_counts.completed, parsed.request_counts.failed) == (
        2,
        1,
        1,
    )
    failed = job(jobs_pb2.JOB_STATE_FAILED)
    failed.error = "rows: a job needs at least one row"
    failed_reply = Batch.model_validate(batch_object("batch_1", "/v1/embeddings", "f", "24h", None, 1.0, None, failed))
    assert failed_reply.failed_at == 1100 and failed_reply.errors is not None and failed_reply.errors.data[0].message == failed.error  # type: ignore[index]
    cancelled = Batch.model_validate(batch_object("batch_1", "/v1/embeddings", "f", "24h", None, 1.0, 1050.0, job(jobs_pb2.JOB_STATE_CANCELLED)))
    assert cancelled.cancelling_at == 1050 and cancelled.cancelled_at == 1100 and cancelled.completed_at is None
    names = {status_of(job(state)) for state in jobs_pb2.JobState.values() if state}
    assert names == {"validating", "in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled"}


def test_settled_waits_for_an_expired_jobs_last_rows() -> None:
    assert not settled(job(jobs_pb2.JOB_STATE_IN_PROGRESS)) and not settled(job(jobs_pb2.JOB_STATE_FINALIZING))
    assert settled(job(jobs_pb2.JOB_STATE_COMPLETED, 2, 2)) and settled(job(jobs_pb2.JOB_STATE_CANCELLED))
    assert not settled(job(jobs_pb2.JOB_STATE_EXPIRED, 2, 1)) and settled(job(jobs_pb2.JOB_STATE_EXPIRED, 2, 1, 1))


def test_results_become_output_and_error_lines_as_the_endpoints_answer() -> None:
    content = "\n".join(
        [
            line("chat", CHAT),
            line("bad", CHAT),
            line("cut", CHAT),
            line("text", {"model": "g", "prompt": "x"}, "/v1/completions"),
            line("emb", {"model": "e", "input": "x"}, "/v1/embeddings"),
            line("never", CHAT),
        ]
    )
    lines = parse_batch_file(content.encode(), 10)
    results = [
        jobs_pb2.RowResult(
            job_id="batch_1",
            custom_id="emb",
            embeddings=[types_pb2.Embedding(values=[0.5, 1.0])],
            usage=types_pb2.Usage(prompt_tokens=2, total_tokens=2),
        ),
        jobs_pb2.RowResult(job_id="batch_1", custom_id="chat", output="Hi!", finish_reason=types_pb2.FINISH_REASON_STOP, usage=USAGE),
        jobs_pb2.RowResult(job_id="batch_1", custom_id="bad", error=jobs_pb2.RowError(code="INVALID_ARGUMENT", message="unknown model")),
        jobs_pb2.RowResult(job_id="batch_1", custom_id="cut", output="Hi", finish_reason=types_pb2.FINISH_REASON_CANCELLED),
        jobs_pb2.RowResult(
            job_id="batch_1", custom_id="text", output=" upon", finish_reason=types_pb2.FINISH_REASON_LENGTH, usage=USAGE, request_id="r-ran"
        ),
    ]
    output, errors = result_files("batch_1", lines, results, created=1234)
    outputs = [json.loads(x) for x in output.decode().splitlines()]
    upstream = json.loads((UPSTREAM / "openai_batch_output.jsonl").read_text().splitlines()[0])
    assert [o["custom_id"] for o in outputs] == ["chat", "text", "emb"]  # the input file's order
    for record in outputs:
        assert set(record) == set(upstream) and set(record["response"]) == set(upstream["response"])
        assert record["error"] is None and record["response"]["status_code"] == 200 and record["id"].startswith("batch_req_")
    chat = ChatCompletion.model_validate(outputs[0]["response"]["body"])
    assert chat.object == "chat.completion" and chat.choices[0].message.content == "Hi!" and chat.created == 1234
    assert chat.usage is not None and chat.usage.total_tokens == 9 and chat.id == "chatcmpl-" + outputs[0]["response"]["request_id"]
    text = Completion.model_validate(outputs[1]["response"]["body"])
    assert text.choices[0].text == " upon" and text.choices[0].finish_reason == "length"
    # What the row's engine took from its prefix cache, as the synchronous endpoints say it.
    assert outputs[0]["response"]["body"]["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}
    assert outputs[1]["response"]["body"]["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}
    assert "prompt_tokens_details" not in outputs[2]["response"]["body"]["usage"]  # embeddings' usage has none
    # The id the row ran under (its evaluation record's), where the result carries one.
    assert outputs[1]["response"]["request_id"] == "r-ran" and text.id == "cmpl-r-ran"
    embedding = CreateEmbeddingResponse.model_validate(outputs[2]["response"]["body"])
    assert embedding.data[0].embedding == [0.5, 1.0] and embedding.usage.prompt_tokens == 2
    failures = {x["custom_id"]: x for x in map(json.loads, errors.decode().splitlines())}
    assert list(failures) == ["bad", "cut"]
    # Failed as the endpoint would have answered them, an HTTP error: in `response`, as OpenAI writes them.
    bad, cut = failures["bad"]["response"], failures["cut"]["response"]
    assert failures["bad"]["error"] is None and bad["status_code"] == 400 and bad["request_id"]
    assert bad["body"] == {"error": {"message": "unknown model", "type": "invalid_request_error", "param": None, "code": "invalid_argument"}}
    assert failures["cut"]["error"] is None and cut["status_code"] == 500 and cut["body"]["error"]["code"] == "generation_failed"
    assert "FINISH_REASON_CANCELLED" in cut["body"]["error"]["message"]
    # Stable ids: a second making of the files is byte for byte the same.
    assert result_files("batch_1", lines, reversed(results), created=1234) == (output, errors)
    assert result_file_ids("batch_abc") == ("file-abc-output", "file-abc-errors")


def test_a_line_with_text_that_is_not_unicode_is_refused_naming_it() -> None:
    # json.dumps writes a lone surrogate as "\ud800": valid JSON, but no job row could carry it.
    surrogate = line("a", {**CHAT, "messages": [{"role": "user", "content": "hi \ud800"}]})
    error = refused(line("ok", CHAT) + "\n" + surrogate + "\n")
    assert error.param == "body.messages[0].content" and error.message.startswith("Line 2 of the batch file")
    assert refused(line("\udc80", CHAT)).param == "custom_id"


def test_the_docs_say_where_an_output_lines_request_id_comes_from() -> None:
    """The Batch API page's paragraph on `request_id` (docs/developers/openai-batch.md) says what result_files does
    (test_results_become_output_and_error_lines_as_the_endpoints_answer): the id the row ran under, derived from the batch and custom_id only for results without one."""
    batches = (Path(__file__).resolve().parents[3] / "docs" / "developers" / "openai-batch.md").read_text()
    paragraph = " ".join(next(p for p in batches.split("\n- ") if p.lstrip().startswith("`request_id`")).split())
    assert paragraph.startswith("`request_id` is the id the row ran under (the job row result's `request_id`)")
    assert "Only a result stored before results carried that id gets one derived from the batch and `custom_id`" in paragraph


def test_a_line_python_cannot_read_as_json_is_refused_naming_it() -> None:
    """An integer of over 4,300 digits: json.loads raises a plain ValueError (no JSONDecodeError)."""
    huge = line("ok", CHAT) + "\n" + '{"custom_id": "b", "n": ' + "1" * 5000 + "}"
    error = refused(huge)
    assert error.message.startswith("Line 2 of the batch file: not valid JSON") and "4300" in error.message


def test_lines_end_at_newline_only_and_keep_the_separators_json_allows_in_a_string() -> None:
    """str.splitlines cut a line at U+2028, U+2029 and U+0085 too, which JSON allows raw in a string."""
    text = "one\u2028two\u2029three\x85four"
    chat = {**CHAT, "messages": [{"role": "user", "content": text}]}
    raw = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": chat}, ensure_ascii=False)
    content = raw + "\r\n" + line("b", CHAT) + "\r\n"  # CRLF line ends, as an editor on Windows writes them
    lines = parse_batch_file(content.encode(), max_lines=10)
    assert [(x.line, x.custom_id) for x in lines] == [(1, "a"), (2, "b")]
    assert generate_request(job_request("batch_x", "", lines, "24h").rows[0].generate).messages[0].content == text
    # A line of nothing but a separator JSON does not count as whitespace is no blank line.
    assert refused(line("a", CHAT) + "\n\u2028\n").message.startswith("Line 2 of the batch file: not valid JSON")


def test_a_custom_id_no_job_can_carry_is_refused_naming_its_line() -> None:
    """Checked before by the job layer only, at create_batch, as rows[i] (counted from 0)."""
    longest = "é" * 112  # 224 bytes: "<batch id>/<custom id>" fills AMQP's 255-byte message id
    assert [x.custom_id for x in parse_batch_file((line(longest, CHAT) + "\n").encode(), 10)] == [longest]
    too_long = refused(line("ok", CHAT) + "\n" + line(longest + "x", CHAT))
    assert too_long.message.startswith("Line 2 of the batch file: custom_id is 225 bytes") and too_long.param == "custom_id"
    nul = refused(line("ok", CHAT) + "\n\n" + line("a\x00b", CHAT))
    assert nul.message.startswith("Line 3 of the batch file") and "NUL" in nul.message and nul.param == "custom_id"


def test_error_lines_use_openais_codes_and_a_cancelled_batchs_rows_not_run_are_there() -> None:
    content = "\n".join(line(c, CHAT) for c in ("ran", "expired", "too_long", "timed_out", "not_run"))
    lines = parse_batch_file(content.encode(), 10)

    def failed(custom_id: str, code: str) -> jobs_pb2.RowResult:
        return jobs_pb2.RowResult(job_id="batch_1", custom_id=custom_id, error=jobs_pb2.RowError(code=code, message=f"{code} here"))

    results = [
        jobs_pb2.RowResult(job_id="batch_1", custom_id="ran", output="Hi!", finish_reason=types_pb2.FINISH_REASON_STOP, usage=USAGE),
        failed("expired", "EXPIRED"),
        failed("too_long", "TOO_LONG_FOR_WINDOW"),
        failed("timed_out", "DEADLINE_EXCEEDED"),
    ]
    upstream = json.loads((UPSTREAM / "openai_batch_output.jsonl").read_text().splitlines()[0])
    for cancelled, not_run in ((False, []), (True, [("not_run", "batch_cancelled")])):
        output, errors = result_files("batch_1", lines, results, created=1234, cancelled=cancelled)
        records = [json.loads(x) for x in errors.decode().splitlines()]
        assert [(r["custom_id"], r["error"]["code"]) for r in records] == [
            ("expired", "batch_expired"),
            ("too_long", "batch_expired"),
            ("timed_out", "request_timeout"),
            *not_run,
        ]
        # Non-HTTP errors: no response, the reason in `error`.
        assert all(set(r) == set(upstream) and r["response"] is None and r["error"]["message"] for r in records)
        assert [json.loads(x)["custom_id"] for x in output.decode().splitlines()] == ["ran"]


UPSTREAM_LINE = json.loads((UPSTREAM / "openai_batch_request_output_schema.json").read_text())["components"]["schemas"]["BatchRequestOutput"]
UPSTREAM_ERROR = json.loads((UPSTREAM / "openai_openapi_subset.json").read_text())["components"]["schemas"]["Error"]


@pytest.mark.parametrize(
    ("code", "status", "type_"),
    [
        ("INVALID_ARGUMENT", 400, "invalid_request_error"),
        ("NOT_FOUND", 404, "invalid_request_error"),
        ("RESOURCE_EXHAUSTED", 429, "rate_limit_error"),
        ("UNAVAILABLE", 503, "service_unavailable"),
        ("INTERNAL", 500, "server_error"),
        ("ABORTED", 500, "server_error"),
    ],
)
def test_a_row_that_failed_with_an_http_error_is_that_response_and_error_is_for_non_http_errors(code: str, status: int, type_: str) -> None:
    """OpenAI's BatchRequestOutput: `error` is "for requests that failed with a non-HTTP error"; one
    that failed with an HTTP error is its response (status_code, request_id, body {"error"}), with
    the status and body the HTTP front answers for that gRPC status."""
    lines = parse_batch_file((line("a", CHAT) + "\n").encode(), 10)
    result = jobs_pb2.RowResult(job_id="batch_1", custom_id="a", error=jobs_pb2.RowError(code=code, message="why"), request_id="r-1")
    [record] = [json.loads(x) for x in result_files("batch_1", lines, [result], created=1234)[1].decode().splitlines()]
    assert set(record) == set(UPSTREAM_LINE["properties"]) and record["error"] is None
    response = record["response"]
    assert set(response) == set(UPSTREAM_LINE["properties"]["response"]["properties"])
    assert (response["status_code"], response["request_id"]) == (status, "r-1")
    assert set(response["body"]) == {"error"} and set(response["body"]["error"]) == set(UPSTREAM_ERROR["required"])
    assert response["body"]["error"] == {"message": "why", "type": type_, "param": None, "code": code.lower()}


def test_a_named_function_lines_call_ends_stop_as_the_synchronous_endpoint_answers_it() -> None:
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    named = {**CHAT, "tools": [weather], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    lines = parse_batch_file((line("named", named) + "\n" + line("required", {**named, "tool_choice": "required"})).encode(), 10)
    call = types_pb2.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Oslo"}')
    results = [
        jobs_pb2.RowResult(job_id="batch_1", custom_id=c, finish_reason=types_pb2.FINISH_REASON_TOOL_CALLS, tool_calls=[call], usage=USAGE)
        for c in ("named", "required")
    ]
    output, _ = result_files("batch_1", lines, results, created=1234)
    choices = [ChatCompletion.model_validate(json.loads(x)["response"]["body"]).choices[0] for x in output.decode().splitlines()]
    assert [(c.finish_reason, [t.function.name for t in c.message.tool_calls or []]) for c in choices] == [  # type: ignore[union-attr]
        ("stop", ["get_weather"]),
        ("tool_calls", ["get_weather"]),
    ]


def test_lines_sharing_a_constraint_compile_it_once_per_file(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each line's constraint was compiled: a 100,000-line file of one pattern took a minute."""
    compiled: list[object] = []
    real = openai_requests.check

    def counted(constraint: Any) -> None:
        compiled.append(constraint)
        real(constraint)

    monkeypatch.setattr(openai_requests, "check", counted)
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "string"}}}}}
    bodies = [{**CHAT, "structured_outputs": {"regex": "(a|b)+[0-9]{3}"}}] * 30 + [{**CHAT, "response_format": schema}] * 30
    content = "\n".join(line(str(i), body) for i, body in enumerate(bodies))
    assert len(parse_batch_file(content.encode(), max_lines=100)) == 60
    assert len(compiled) == 2
    # A bad one is refused on each line that has it, naming the first.
    bad = line("ok", CHAT) + "\n" + "\n".join(line(f"b{i}", {**CHAT, "structured_outputs": {"regex": "(unclosed"}}) for i in range(3))
    error = refused(bad)
    assert error.message.startswith("Line 2 of the batch file") and error.param == "body.structured_outputs"
    # Memoised within one parse only: a synchronous request compiles its own.
    compiled.clear()
    openai_requests.parse_chat({**CHAT, "structured_outputs": {"regex": "(a|b)+[0-9]{3}"}})
    assert len(compiled) == 1
