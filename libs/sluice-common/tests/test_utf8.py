"""sluice_common.utf8: the path of the first text that UTF-8 cannot carry, in parsed JSON and in
protobuf's wire format."""

from __future__ import annotations

import json

from sluice.common.v1 import types_pb2
from sluice.gateway.v1 import gateway_pb2
from sluice.jobs.v1 import jobs_pb2

from sluice_common.utf8 import invalid_json_text, invalid_wire_text, is_valid_text

MARK = b"\x01\x02\x03"
WTF8_SURROGATE = b"\xed\xa0\x80"  # U+D800 written as if it were a character


def test_is_valid_text() -> None:
    assert is_valid_text("café ✓ 😀") and not is_valid_text("a\ud800") and not is_valid_text("\udcff")


def test_json_paths() -> None:
    document = json.loads('{"model": "m", "messages": [{"role": "user", "content": "ok"}, {"content": "x\\udfff"}]}')
    assert invalid_json_text(document) == "messages[1].content"
    assert invalid_json_text(json.loads('{"a": {"\\ud800k": 1}}')) == "a.\\ud800k"
    assert invalid_json_text(json.loads('"\\ud800"')) == ""
    assert invalid_json_text(json.loads('{"a": [1, 2.5, null, true, "\\ud83d\\ude00"]}')) is None  # a surrogate pair is fine
    deep = json.loads("[" * 900 + '"\\ud800"' + "]" * 900)
    assert invalid_json_text(deep) == "[0]" * 900


def _wire(message: object) -> bytes:
    raw = message.SerializeToString()  # type: ignore[attr-defined]
    return raw.replace(MARK, WTF8_SURROGATE)


def test_wire_paths() -> None:
    descriptor = gateway_pb2.GenerateRequest.DESCRIPTOR
    request = gateway_pb2.GenerateRequest(
        model="m",
        messages=[types_pb2.ChatMessage(role="user", content="ok"), types_pb2.ChatMessage(role="user", content=MARK.decode())],
        sampling=types_pb2.SamplingParams(max_tokens=3, seed=1 << 63, temperature=0.5),
    )
    assert invalid_wire_text(descriptor, _wire(request)) == "messages[1].content"
    request.sampling.stop.extend(["s", MARK.decode()])
    request.messages[1].content = "fine"
    assert invalid_wire_text(descriptor, _wire(request)) == "sampling.stop[1]"
    assert invalid_wire_text(descriptor, request.SerializeToString()) is None
    job = gateway_pb2.SubmitJobRequest(job=jobs_pb2.JobRequest(job_id="j", rows=[jobs_pb2.JobRow(custom_id=MARK.decode())]))
    assert invalid_wire_text(gateway_pb2.SubmitJobRequest.DESCRIPTOR, _wire(job)) == "job.rows[0].custom_id"
    # Not a message: no path, the caller refuses the whole.
    assert invalid_wire_text(descriptor, b"\xff\xff\xff") is None
    assert invalid_wire_text(descriptor, b"\x0a\x05ab") is None  # truncated
