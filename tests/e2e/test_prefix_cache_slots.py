"""The prefix cache never turns live work away (issue 24), on the real stack: once every KV slot of
triton-local holds a finished sequence's cells, a full batch of unrelated live requests still gets
every slot (the cached cells are evicted) and the engine answers no prefill "busy"; a prompt seen
before reports its cached tokens over gRPC and answers as a cold one did."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

from sluice.common.v1 import types_pb2
from sluice.gateway.v1 import gateway_pb2, gateway_pb2_grpc

from conftest import MODEL, auth, scrape, scrape_total, wait_for
from sluice_stack import Stack


def request(system: str, question: str, max_tokens: int) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        model=MODEL,
        messages=[types_pb2.ChatMessage(role="system", content=system), types_pb2.ChatMessage(role="user", content=question)],
        sampling=types_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )


def generate(gateway: gateway_pb2_grpc.GatewayServiceStub, message: gateway_pb2.GenerateRequest) -> tuple[str, types_pb2.Usage]:
    responses = list(gateway.Generate(message, metadata=auth(), timeout=120))
    return "".join(r.text for r in responses), responses[-1].usage


def test_cached_slots_give_way_to_a_full_batch_of_live_requests(stack: Stack, gateway: gateway_pb2_grpc.GatewayServiceStub) -> None:
    engine, adapter = stack.metrics_url("triton-local"), stack.metrics_url("inference-adapter")
    slots = int(scrape(engine, "sluice_triton_local_max_slots"))
    # Starts from an engine whose slots hold no running sequence: one a module before left held
    # (an adapter of its own stopped mid-stream, a cancel's release that overtook its prefill) is
    # no cached prefix, and holds its slot until the engine's lease (30 s and 16 steps) frees it.
    wait_for(lambda: scrape(engine, "sluice_triton_local_active_slots") == 0, "no slot held by a running sequence", timeout_s=120.0, poll_s=0.5)
    run = uuid.uuid4().hex[:8]
    # Every slot ends up holding a finished sequence: prompts that differ from their fourth token on
    # (after the template's opening), fewer shared tokens than the cache reuses.
    finished = [request(f"{i}-{run} is this conversation's number. You answer briefly.", "Say yes.", 2) for i in range(slots)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(lambda m: generate(gateway, m), finished))
    # An adapter's health probe (a one-word prompt every 2 s) may take one of them meanwhile: it
    # leaves that slot empty (its few tokens are not worth a cached prefix's place).
    assert slots - 1 <= scrape(engine, "sluice_triton_local_prefix_cache_slots") <= slots
    busy_before = scrape_total(adapter, "sluice_adapter_engine_full_total")

    # As many live requests as there are slots, none sharing a prefix with what the slots hold.
    live = [request(f"{i} live {run}: you are a poet.", f"Write a line about the number {i}.", 12) for i in range(slots)]
    with ThreadPoolExecutor(max_workers=slots) as pool:
        answers = list(pool.map(lambda m: generate(gateway, m), live))
    assert all(text and usage.completion_tokens > 0 and usage.cached_tokens == 0 for text, usage in answers), answers
    assert scrape_total(adapter, "sluice_adapter_engine_full_total") == busy_before, "a cached prefix made the engine answer busy"

    # A prompt seen before reuses all but its last prompt token, and answers as it did cold.
    again = request(f"Again {run}: you are a poet.", "Write a line about rivers.", 12)
    cold_text, cold = generate(gateway, again)
    warm_text, warm = generate(gateway, again)
    assert cold.cached_tokens == 0 and warm.cached_tokens == warm.prompt_tokens - 1, (cold, warm)
    assert warm_text == cold_text
