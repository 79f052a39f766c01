"""Issue 24 item 3 on the real stack: prefix-aware routing over two triton-local replicas behind one
adapter. Requests sharing a system prompt go to the replica that was sent it (and the engine there
reports the reused tokens in Usage.cached_tokens) even while that replica is busier than the other,
which least-loaded routing alone would have picked; a request with another prefix goes to the less
loaded replica; a burst of the hot prefix beyond the load bound spills over to the other replica
instead of piling up on one."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator

import grpc
import pytest
from sluice.common.v1 import types_pb2
from sluice.inference.v1 import inference_pb2, inference_pb2_grpc

from conftest import MODEL, scrape, wait_for
from sluice_stack import Stack, StackPorts

REPLICAS = ("triton-local", "triton-local-2")
LOAD_BOUND = 2
# SmolLM2's <|endoftext|> and <|im_end|>: banned in the long stream, which must outlast the steps that
# compete with it (greedy counting stopped on its own after a few hundred tokens in a loaded CI run).
END_OF_TURN_IDS = (0, 2)
# About 150 tokens: well past the engine's 8-token reuse floor and many 128-character blocks.
SYSTEM_PROMPT = (
    "You are the booking assistant of Riverside Outfitters. Answer in one short sentence. Guided river"
    " trips leave every Sunday morning in summer from the boathouse below the old mill; beginners are"
    " welcome, every guest gets a life jacket and a helmet, and children under twelve paddle with an"
    " adult. Trips are cancelled when the river is above the orange mark on the bridge pier, and a"
    " cancelled trip is refunded in full or moved to another Sunday. Never invent prices or dates."
)


@pytest.fixture(scope="module")
def two_replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = Stack(
        run_dir=tmp_path_factory.mktemp("prefix-routing"),
        ports=StackPorts.ephemeral(),
        extra_triton_replicas=1,
        serve_variant=False,
        extra_env={
            "inference-adapter": {
                "SLUICE_ADAPTER_PROBE_INTERVAL_S": "0.5",
                "SLUICE_ADAPTER_PREFIX_ROUTING": "true",
                "SLUICE_ADAPTER_PREFIX_ROUTING_LOAD_BOUND": str(LOAD_BOUND),
            }
        },
    )
    stack.start()
    yield stack
    stack.stop()


def request(system: str, question: str, max_tokens: int) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(
        request_id=f"prefix-routing-{uuid.uuid4().hex[:8]}",
        tenant="demo",
        model=MODEL,
        messages=[types_pb2.ChatMessage(role="system", content=system), types_pb2.ChatMessage(role="user", content=question)],
        sampling=types_pb2.SamplingParams(max_tokens=max_tokens, temperature=0),
    )


def usage(stub: inference_pb2_grpc.InferenceServiceStub, req: inference_pb2.GenerateRequest) -> types_pb2.Usage:
    last = None
    for response in stub.Generate(req, timeout=180):
        last = response
    assert last is not None and last.finish_reason in (types_pb2.FINISH_REASON_STOP, types_pb2.FINISH_REASON_LENGTH), last
    return last.usage


class Placement:
    """Requests the adapter routed to each replica (counted when routed, not when they end)."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.address = {name: stack.triton_address(name) for name in REPLICAS}

    def requests(self) -> dict[str, float]:
        url = self.stack.metrics_url("inference-adapter")
        return {name: scrape(url, "sluice_adapter_routed_requests_total", f'{{replica="{address}"}}') for name, address in self.address.items()}

    def decisions(self, reason: str) -> float:
        return scrape(self.stack.metrics_url("inference-adapter"), "sluice_adapter_routing_decisions_total", f'{{model="{MODEL}",reason="{reason}"}}')


def grew(before: dict[str, float], after: dict[str, float]) -> set[str]:
    return {name for name in before if after[name] > before[name]}


def test_a_shared_system_prompt_stays_on_one_replica_within_the_load_bound(two_replicas: Stack) -> None:
    stack = two_replicas
    url = stack.metrics_url("inference-adapter")
    for name in REPLICAS:
        address = stack.triton_address(name)
        wait_for(lambda: scrape(url, "sluice_adapter_replica_healthy", f'{{replica="{address}"}}') == 1, f"{name} admitted", timeout_s=60)
    placement = Placement(stack)
    stub = inference_pb2_grpc.InferenceServiceStub(grpc.insecure_channel(stack.adapter_address))
    # A nonce first: nothing earlier shares this prefix.
    hot = f"Session {uuid.uuid4().hex}. {SYSTEM_PROMPT}"

    # 1. The first request of the hot prefix: both replicas idle, it goes where rendezvous hashing says.
    before = placement.requests()
    first = usage(stub, request(hot, "Can my ten-year-old join a trip?", 4))
    (home,) = grew(before, placement.requests())
    other = next(name for name in REPLICAS if name != home)

    # 2. A long stream of the same prefix keeps `home` busy (it goes there: the prefix matches).
    long_stream = request(hot, "Count from 1 to 1000, one number per line.", 1000)
    for token_id in END_OF_TURN_IDS:
        long_stream.sampling.logit_bias[token_id] = -100.0
    background = stub.Generate(long_stream, timeout=300)
    ended: list[object] = []

    def drain() -> None:
        try:
            for response in background:
                if response.finish_reason:
                    ended.append(response)
        except grpc.RpcError as exc:
            ended.append(exc)  # cancelled at the end of the test (else the assertions below show it)

    consumed = threading.Thread(target=drain, daemon=True)
    consumed.start()
    try:
        wait_for(lambda: scrape(stack.metrics_url(home), "sluice_triton_local_active_slots") > 0, f"the long stream on {home}", timeout_s=60)
        # 3. More requests of the hot prefix, one at a time: least-loaded routing would send them to the
        #    idle `other`; within the load bound they go to `home`, whose engine reuses the system prompt.
        before = placement.requests()
        for question in ("Is a helmet included?", "What happens when the river is high?", "Do trips run in winter?"):
            reply = usage(stub, request(hot, question, 4))
            # Most of the system prompt (~150 tokens; the engine prefills a long prompt's last 64
            # tokens again), not just the template's opening.
            assert reply.cached_tokens >= 60, reply
            assert reply.cached_tokens < reply.prompt_tokens
        assert grew(before, placement.requests()) == {home}
        # Still running: `home` was the busier replica all along (else this step proved nothing).
        assert consumed.is_alive(), f"the long stream ended before the requests it should have competed with: {ended}"

        # 4. Another, cold prefix is not pulled to the busy replica: it goes to the less loaded one.
        before = placement.requests()
        cold = usage(stub, request(f"Session {uuid.uuid4().hex}. You are a weather bot for sailors. " * 3, "Wind today?", 4))
        assert grew(before, placement.requests()) == {other}
        assert cold.cached_tokens < 20, cold  # at most the chat template's opening
        assert consumed.is_alive(), f"the long stream ended before the cold request it should have competed with: {ended}"

        # 5. A burst of the hot prefix: `home` takes it until it holds more than LOAD_BOUND sequences
        #    beyond `other`, then the rest spill over there: neither replica is starved.
        before_bound = placement.decisions("load_bound")
        before = placement.requests()
        errors: list[BaseException] = []

        def one(index: int) -> None:
            try:
                usage(stub, request(hot, f"Question {index}: may I bring my dog?", 16))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        burst = [threading.Thread(target=one, args=(i,)) for i in range(6)]
        for thread in burst:
            thread.start()
        for thread in burst:
            thread.join(timeout=240)
        assert not errors, errors
        assert grew(before, placement.requests()) == {home, other}
        assert placement.decisions("load_bound") > before_bound
    finally:
        background.cancel()
        consumed.join(timeout=30)
    assert first.prompt_tokens > 100
    assert placement.decisions("prefix") >= 4


def test_losing_the_replica_that_holds_a_prefix_costs_the_next_request_a_cold_prefill(two_replicas: Stack) -> None:
    """Issue 24's acceptance: the replica that holds a prefix is killed; the next request of that
    prefix is still answered (elsewhere, prefilled cold there), and greedy decoding gives the same text."""
    stack = two_replicas
    placement = Placement(stack)
    stub = inference_pb2_grpc.InferenceServiceStub(grpc.insecure_channel(stack.adapter_address))
    prefix = f"Session {uuid.uuid4().hex}. {SYSTEM_PROMPT}"

    def answer() -> tuple[str, types_pb2.Usage]:
        responses = list(stub.Generate(request(prefix, "Can I book for six people?", 8), timeout=180))
        return "".join(r.text for r in responses), responses[-1].usage

    before = placement.requests()
    cold_text, cold = answer()
    (holder,) = grew(before, placement.requests())
    warm_text, warm = answer()
    assert warm.cached_tokens >= 60 and warm_text == cold_text, (cold, warm)

    stack.service(holder).kill()
    text, after = answer()
    assert text == cold_text
    assert after.cached_tokens < 20, after  # cold on the survivor: at most the chat template's opening
    survivor = next(name for name in REPLICAS if name != holder)
    assert placement.requests()[survivor] > before[survivor]
