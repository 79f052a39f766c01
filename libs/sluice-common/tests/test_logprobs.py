"""Reading Triton's vLLM backend's logprobs output into the chat-shape entries every engine reports."""

from __future__ import annotations

from sluice_common.logprobs import from_vllm, token_logprob


def test_the_sampled_token_is_the_one_beyond_the_top_else_the_one_the_text_continues_with() -> None:
    positions = [
        # Not the most likely: vLLM's dict holds the top 2 and the sampled token, ranked 7.
        {"11": {"logprob": -0.5, "rank": 1, "decoded_token": " the"}, "12": {"logprob": -1.5, "rank": 2, "decoded_token": " a"},
         "13": {"logprob": -4.0, "rank": 7, "decoded_token": " one"}},
        # Among the top 2 but second: the text says which.
        {"21": {"logprob": -0.3, "rank": 1, "decoded_token": " cat"}, "22": {"logprob": -1.4, "rank": 2, "decoded_token": " dog"}},
        # Neither continues the text (bytes held back): the most likely.
        {"31": {"logprob": -0.1, "rank": 1, "decoded_token": "\ufffd"}, "32": {"logprob": -2.4, "rank": 2, "decoded_token": "!"}},
    ]  # fmt: skip
    entries = from_vllm(positions, " one dog", 2)
    assert [(e["token"], e["logprob"]) for e in entries] == [(" one", -4.0), (" dog", -1.4), ("\ufffd", -0.1)]
    assert [[t["token"] for t in e["top_logprobs"]] for e in entries] == [[" the", " a"], [" cat", " dog"], ["\ufffd", "!"]]
    assert entries[1]["bytes"] == list(b" dog")
    proto = token_logprob(entries[0])
    assert proto.token == " one" and [t.token for t in proto.top_logprobs] == [" the", " a"]


def test_logprobs_zero_gives_the_sampled_token_alone() -> None:
    entries = from_vllm([{"7": {"logprob": -0.25, "rank": 3, "decoded_token": "x"}}], "x", 0)
    assert entries == [{"token": "x", "logprob": -0.25, "bytes": [120], "top_logprobs": []}]
