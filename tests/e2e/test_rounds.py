"""Multi-step rounds (issue 23) through the real Triton and engine: greedy text through the stack
equals the engine's alone at every round length (rounds sent ahead to follow the one in flight
included), and a stream cancelled mid-round leaves the engine within one step. Two more adapters
share the session stack's Triton: one with a round trip per token (MAX_ROUND_STEPS=1), one with
the longest rounds the protocol allows, each next one sent ahead (ROUNDS_AHEAD=true)."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator

import grpc
import pytest
from sluice.common.v1 import types_pb2
from sluice.inference.v1 import inference_pb2, inference_pb2_grpc

from conftest import MODEL, scrape, scrape_samples, wait_for
from sluice_stack import REPO_ROOT, Stack

PROMPTS = ["Write a short poem about rivers.", "Name three colors.", "Explain how bees make honey, for a child."]
MAX_TOKENS = 40
LONGEST = "64"  # step_protocol.MAX_ROUND_STEPS


def engine_alone(prompts: list[str], max_tokens: int) -> list[str]:
    """Each prompt's greedy text from StepEngine in a process of its own (triton-local's env)."""
    script = (
        "import json, sys\n"
        "from sluice_triton_local.model_files import gguf_path\n"
        "from sluice_common.sampling import Sampling\n"
        "from sluice_triton_local.engine.step_engine import DecodeRow, PrefillRow, ReleaseRow, StepEngine\n"
        "engine = StepEngine(gguf_path(), max_slots=1, threads=2)\n"
        "texts = []\n"
        "for prompt in json.loads(sys.stdin.read()):\n"
        "    ids = tuple(engine.encode_chat([('user', prompt)]))\n"
        f"    (row,) = engine.step([PrefillRow(1, ids, Sampling(max_tokens={max_tokens}))])\n"
        "    text = row.text\n"
        "    while not row.finish_reason:\n"
        "        (row,) = engine.step([DecodeRow(1)])\n"
        "        text += row.text\n"
        "    engine.step([ReleaseRow(1)])\n"
        "    texts.append(text)\n"
        "print(json.dumps(texts))\n"
    )
    python = REPO_ROOT / "services" / "triton-local" / ".venv" / "bin" / "python"
    done = subprocess.run([str(python), "-c", script], input=json.dumps(prompts), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def adapters(stack: Stack) -> Iterator[dict[str, tuple[str, str]]]:
    """Round length -> (gRPC address, metrics URL) of an adapter on the stack's Triton."""
    _, one_address, one_metrics = stack.add_adapter("adapter-rounds-1", env={"SLUICE_ADAPTER_MAX_ROUND_STEPS": "1"})
    _, long_address, long_metrics = stack.add_adapter(
        "adapter-rounds-64",
        env={"SLUICE_ADAPTER_MAX_ROUND_STEPS": LONGEST, "SLUICE_ADAPTER_ROUND_TARGET_S": "30", "SLUICE_ADAPTER_ROUNDS_AHEAD": "true"},
    )
    yield {
        "1": (one_address, one_metrics),
        "default": (stack.adapter_address, stack.metrics_url("inference-adapter")),
        LONGEST: (long_address, long_metrics),
    }


def request(prompt: str, max_tokens: int, index: int = 0) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(
        request_id=f"rounds-{index}",
        tenant="demo",
        model=MODEL,
        messages=[types_pb2.ChatMessage(role="user", content=prompt)],
        sampling=types_pb2.SamplingParams(max_tokens=max_tokens),
    )


def generate(address: str, prompt: str, index: int = 0) -> str:
    with grpc.insecure_channel(address) as channel:
        return "".join(r.text for r in inference_pb2_grpc.InferenceServiceStub(channel).Generate(request(prompt, MAX_TOKENS, index), timeout=180))


def rounds_longer_than_one(metrics: str) -> float:
    rounds, of_one = scrape_samples(metrics, ("sluice_adapter_round_steps_count", ""), ("sluice_adapter_round_steps_bucket", '{le="1.0"}'))
    return rounds - of_one


def rounds_sent_ahead(metrics: str) -> float:
    """Rounds the adapter sent to follow the one in flight (FOLLOWS_ROUND), over its replicas."""
    with urllib.request.urlopen(metrics, timeout=5) as reply:
        text = reply.read().decode()
    return sum(float(v) for v in re.findall(r"^sluice_adapter_rounds_sent_ahead_total\{[^}]*\}\s+(\S+)$", text, re.M))


def test_greedy_text_through_the_stack_equals_the_engine_alone_at_every_round_length(adapters) -> None:  # type: ignore[no-untyped-def]
    alone = engine_alone(PROMPTS, MAX_TOKENS)
    for steps, (address, metrics) in adapters.items():
        assert [generate(address, p) for p in PROMPTS] == alone, f"MAX_ROUND_STEPS {steps}, one at a time"
        together: dict[int, str] = {}

        def run(index: int, address: str = address) -> None:
            time.sleep(0.2 * index)  # later ones arrive mid-round and join the batch
            together[index] = generate(address, PROMPTS[index], index)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        assert [together[i] for i in range(len(PROMPTS))] == alone, f"MAX_ROUND_STEPS {steps}, staggered in one batch"
        if steps == "1":
            assert rounds_longer_than_one(metrics) == 0
        else:
            assert rounds_longer_than_one(metrics) > 0, f"MAX_ROUND_STEPS {steps} never ran a round of several steps"
        if steps == LONGEST:  # its texts came through rounds that followed the one before at the engine
            assert rounds_sent_ahead(metrics) > 0, "ROUNDS_AHEAD=true never sent a round ahead"
        else:
            assert rounds_sent_ahead(metrics) == 0, f"MAX_ROUND_STEPS {steps} sent a round ahead with ROUNDS_AHEAD off"


def test_a_stream_cancelled_mid_round_leaves_the_engine_within_one_step(
    adapters, stack: Stack, record_property: Callable[[str, object], None]
) -> None:  # type: ignore[no-untyped-def]
    """The cancel crosses the adapter and Triton as a release request that reaches the engine while
    the round runs (not after it): the round releases the sequence at its next step. Counted from the
    client's cancel, the steps include the ones made while the cancel travels (two processes and
    Triton's proxy, a few milliseconds each, longer on a busy box), against the 40-odd the round of
    64 had left. Another adapter's work (a health probe is a one-token prefill) ends a round after its
    current step by design; when that happens just as the cancel travels, the release reaches the
    engine between rounds and is applied by the next one: the slot is still freed within the bound,
    and the scenario is run again (at most three times) to see the release arrive mid-round."""
    address, metrics = adapters[LONGEST]
    triton = stack.metrics_url("triton-local")
    mid_round = 0
    for attempt in range(1, 4):
        wait_for(lambda: scrape(triton, "sluice_triton_local_active_slots") == 0, "earlier sequences to end", timeout_s=60)
        steps_after_cancel, released = _cancel_in_a_long_round(address, metrics, triton)
        record_property(f"steps_after_cancel_{attempt}", steps_after_cancel)
        # Measured 4 twice (once beside a compiling build): twice that, against the 40-odd steps left.
        assert steps_after_cancel <= 8, steps_after_cancel
        if released == 1:
            mid_round += 1
            break
    assert mid_round == 1, "in three tries the release request never reached the engine during the round"


def _cancel_in_a_long_round(address: str, metrics: str, triton: str) -> tuple[float, float]:
    """Cancels a long stream once a round of several steps runs: the engine steps made from the cancel
    to the freed slot, and the sequences released mid-round meanwhile."""
    with grpc.insecure_channel(address) as channel:
        call = inference_pb2_grpc.InferenceServiceStub(channel).Generate(request("Write a long story about a dragon.", 1000), timeout=180)
        rounds_before = rounds_longer_than_one(metrics)
        for index, _ in enumerate(call):
            # Once a long round runs (the first rounds are one step, until a step time is known).
            if index >= 20 and rounds_longer_than_one(metrics) > rounds_before:
                break
            assert index < 500, "no round of several steps began"
        assert scrape(triton, "sluice_triton_local_active_slots") == 1
        steps_at_cancel, released_mid_round = scrape_samples(
            triton, ("sluice_triton_local_step_seconds_count", ""), ("sluice_triton_local_released_mid_round_total", "")
        )
        call.cancel()
        wait_for(lambda: scrape(triton, "sluice_triton_local_active_slots") == 0, "the cancelled sequence's slot to be freed", poll_s=0.005)
    steps, released = scrape_samples(triton, ("sluice_triton_local_step_seconds_count", ""), ("sluice_triton_local_released_mid_round_total", ""))
    return steps - steps_at_cancel, released - released_mid_round
