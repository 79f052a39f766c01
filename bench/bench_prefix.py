"""`make bench-prefix`: what triton-local's prefix cache saves, on the local stack. Two stacks as
`make run` starts them, up the whole run: one with the prefix cache (its default), one with
SLUICE_TRITON_LOCAL_PREFIX_CACHE=false; each load runs on each in turn, the order reversed in even
rounds, through the gateway's OpenAI front (bench-peer's streamed-chat client, temperature 0.7, a
seed per request).

  shared_prompt  SHARED_REQUESTS requests with one system prompt of about 1,000 tokens and distinct
                 short questions, sent one every ARRIVAL_S seconds whatever the answers (an open
                 loop, as an application's users send them), MAX_TOKENS each
  multiturn      CONVERSATIONS conversations at once, TURNS turns each, each with its own system
                 prompt of about 350 tokens: every turn resends the whole conversation so far with
                 the answer it got (as a chat client does) and a new question, MAX_TOKENS each

  TTFT      request sent -> first content chunk, p50 (and p99) over the rounds; multiturn: turns 2..TURNS
  tokens/s  completion tokens (as usage reports) over the phase's wall time, first send -> last end
  cached    the share of prompt tokens usage.prompt_tokens_details.cached_tokens reports
  Only requests that ended with a finish_reason count; the others are printed and counted.

Then two stacks of two triton-local replicas each (one engine thread each, as the launcher splits
the cores) behind one adapter, the prefix cache on in both, with small caches (ROUTING_SLOTS slots,
the adapter's batch as large, a host store of ROUTING_HOST_MIB) so that a replica cannot keep every
prompt's cells but two replicas can: one routes by prefix (SLUICE_ADAPTER_PREFIX_ROUTING=true, its
default), the other by load alone (false).

  routing        ROUTING_REQUESTS requests over ROUTING_PROMPTS distinct system prompts (about 300
                 tokens each), in turn, one every ROUTING_ARRIVAL_S seconds: TTFT p50/p99, the
                 cached share, and the busiest replica's share of the requests

BENCH prefix_cache_ttft_speedup = shared_prompt TTFT p50 without the cache / with it (target >= 4);
BENCH prefix_cache_tokens_per_s_ratio = with / without (target >= 1.0: not lower);
BENCH prefix_cache_multiturn_speedup = multiturn TTFT p50 of turns 2.. without / with (target >= 3);
BENCH prefix_routing_ttft_p50_speedup = routing TTFT p50 by load / by prefix (target >= 2), and
BENCH prefix_routing_busiest_replica_share (target <= 70%).
BENCH_RUN_DIR keeps the services' logs (a temporary folder otherwise).
"""

from __future__ import annotations

import asyncio
import os
import re
import urllib.request
import uuid
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from bench_openai import percentile
from bench_peer import DEMO_KEY, Messages, Server, StreamState, one_chat, running, two_stacks
from sluice_stack import Stack, StackPorts

SHARED_REQUESTS = int(os.environ.get("BENCH_SHARED_REQUESTS", "32"))
# Slower than a cold prefill of the shared prompt (2.65 s for 1,000 tokens alone, on 2 cores), so
# that the side without the cache is loaded, not swamped: its queue does not grow without end.
ARRIVAL_S = float(os.environ.get("BENCH_ARRIVAL_S", "3.0"))
CONVERSATIONS = int(os.environ.get("BENCH_CONVERSATIONS", "8"))
TURNS = int(os.environ.get("BENCH_TURNS", "5"))
MAX_TOKENS = int(os.environ.get("BENCH_MAX_TOKENS", "32"))
ROUTING_REQUESTS = int(os.environ.get("BENCH_ROUTING_REQUESTS", "48"))
ROUTING_PROMPTS = int(os.environ.get("BENCH_ROUTING_PROMPTS", "6"))
ROUTING_ARRIVAL_S = float(os.environ.get("BENCH_ROUTING_ARRIVAL_S", "1.0"))
# Each engine's cache is its free slots and its host store of evicted prefixes. Routing can only
# pay where a replica's cache cannot hold every prompt a fleet sends (a fleet's applications and
# conversations outnumber it): with its default host store (512 MiB, some 60 of these prompts) a
# replica soon holds all 6, and routing by load misses only each prompt's first visit to each
# replica. So each engine here keeps about 4 prompts: 5 slots, one or two of them live, and no host
# store; the 6 prompts fit two replicas' caches, not one.
ROUTING_SLOTS = int(os.environ.get("BENCH_ROUTING_SLOTS", "5"))
ROUTING_HOST_MIB = os.environ.get("BENCH_ROUTING_HOST_MIB", "0")
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "2"))
CACHED, UNCACHED = "cache on", "cache off"
SIDES = (CACHED, UNCACHED)
BY_PREFIX, BY_LOAD = "by prefix", "by load"
ROUTERS = (BY_PREFIX, BY_LOAD)

# About 1,000 tokens of SmolLM2's tokenizer: a support assistant's instructions, as applications write them.
_RULES = (
    "Greet the customer by name when they give it, and never ask for a password or a card number.",
    "Answer in at most three sentences, in plain words, and say so when you do not know.",
    "Orders ship from the warehouse on weekdays; a parcel takes two to four working days in the country.",
    "Returns are accepted within thirty days when the item is unused and in its original packaging.",
    "Refunds go back to the card used for the order within ten working days of the return's arrival.",
    "Repairs are free during the first year; after it, a technician quotes the price before any work.",
    "Gift cards never expire, cannot be exchanged for cash and are not replaced when lost.",
    "A customer who reports a damaged parcel is asked for a photograph of the box and of the item.",
    "Never promise a delivery date, a stock level or a discount: a colleague confirms those by email.",
    "Do not discuss competitors, politics, religion, the weather or the customer's health.",
    "When a customer is angry, apologise once, restate the problem and offer the next concrete step.",
    "Business customers with an account number are handed to the business desk for every question.",
)
SYSTEM_PROMPT = "You are the support assistant of Northwind Outdoor, a shop for hiking and camping gear.\n" + "\n".join(
    f"Rule {section}.{number}: {rule}" for section in range(1, 4) for number, rule in enumerate(_RULES, start=1)
)  # 1,005 tokens in the chat template with a question
# A conversation's own instructions (about 350 tokens), its first line its own: conversations share
# no prefix with each other, only with their own earlier turns.
CONVERSATION_RULES = "\n".join(f"Rule {number}: {rule}" for number, rule in enumerate(_RULES, start=1))
QUESTIONS = (
    "Can I return boots I wore once?", "How long does a parcel take?", "Is my tent still under warranty?",
    "Do gift cards expire?", "My stove arrived broken, what now?", "Can you hold a backpack for me?",
    "Do you ship abroad?", "How do I get a refund?", "Is the red jacket in stock?", "Can I pay by invoice?",
    "Where is my order?", "Do you repair zips?", "What is your phone number?", "Can I change my address?",
    "Do you sell maps?", "Is there a student discount?",
)  # fmt: skip
FOLLOW_UPS = ("Thanks. And how long does that take?", "What do I need to send you?", "Can a colleague call me?", "Fine, please go ahead.")


@dataclass
class Result:
    """One succeeded request."""

    ttft_s: float
    tokens: int
    prompt_tokens: int
    cached_tokens: int
    sent: float
    ended: float


@dataclass
class Phase:
    results: list[Result] = field(default_factory=list)
    failed: int = 0

    def add(self, sent: float, state: StreamState, ok: bool) -> None:
        if not ok or state.first_content_at is None or state.completion_tokens is None:
            self.failed += 1
            return
        self.results.append(
            Result(state.first_content_at - sent, state.completion_tokens, state.prompt_tokens or 0, state.cached_tokens, sent, time.perf_counter())
        )


async def chat(session: aiohttp.ClientSession, server: Server, messages: Messages, seed: int, phase: Phase) -> StreamState:
    sent = time.perf_counter()
    outcome, state = await one_chat(session, server, messages, seed, MAX_TOKENS)
    phase.add(sent, state, outcome is not None)
    return state


def session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, limit=0), timeout=aiohttp.ClientTimeout(total=900))


async def open_loop(server: Server, conversations: list[Messages], interval_s: float, first_seed: int) -> Phase:
    """Each request sent `interval_s` after the one before, whether or not that one was answered."""
    phase = Phase()
    async with session() as http:

        async def send(index: int) -> None:
            await asyncio.sleep(index * interval_s)
            await chat(http, server, conversations[index], first_seed + index, phase)

        await asyncio.gather(*(send(i) for i in range(len(conversations))))
    return phase


def ask(system: str, question: str) -> Messages:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def question(round_: int, index: int) -> str:
    return f"{QUESTIONS[index % len(QUESTIONS)]} (ticket {round_}-{index})"


async def shared_prompt(server: Server, round_: int) -> Phase:
    """Requests sharing the system prompt, one every ARRIVAL_S seconds."""
    asks = [ask(SYSTEM_PROMPT, question(round_, i)) for i in range(SHARED_REQUESTS)]
    return await open_loop(server, asks, ARRIVAL_S, 100 * round_)


async def multiturn(server: Server, round_: int) -> tuple[Phase, Phase]:
    """CONVERSATIONS conversations at once; the first turns' figures, and the later turns'."""
    first, later = Phase(), Phase()
    async with session() as http:

        async def converse(index: int) -> None:
            messages: Messages = [
                {"role": "system", "content": f"Conversation {round_}-{index}. You are a shop's assistant.\n{CONVERSATION_RULES}"},
                {"role": "user", "content": QUESTIONS[index % len(QUESTIONS)]},
            ]
            for turn in range(TURNS):
                state = await chat(http, server, messages, 1000 * round_ + 10 * index + turn, later if turn else first)
                messages = [*messages, {"role": "assistant", "content": state.text}, {"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]}]

        await asyncio.gather(*(converse(i) for i in range(CONVERSATIONS)))
    return first, later


async def routing(server: Server, round_: int) -> Phase:
    """Requests over a few system prompts, in turn, one every ROUTING_ARRIVAL_S seconds."""
    asks = [ask(f"Assistant {round_}-{i % ROUTING_PROMPTS} of the shop.\n{CONVERSATION_RULES}", question(round_, i)) for i in range(ROUTING_REQUESTS)]
    return await open_loop(server, asks, ROUTING_ARRIVAL_S, 7000 * round_)


def routed_requests(stack: Stack) -> dict[str, float]:
    """Requests the adapter routed to each replica so far (its counter, per replica)."""
    with urllib.request.urlopen(stack.metrics_url("inference-adapter"), timeout=5) as reply:
        text = reply.read().decode()
    found = re.findall(r'^sluice_adapter_routed_requests_total\{replica="([^"]+)"\} ([0-9.e+]+)$', text, re.M)
    return {replica: float(value) for replica, value in found}


def busiest_share(before: dict[str, float], after: dict[str, float]) -> float:
    routed = {replica: after[replica] - before.get(replica, 0.0) for replica in after}
    total = sum(routed.values())
    return max(routed.values()) / total if total else float("nan")


def routing_stacks(run_dir: Path) -> dict[str, Stack]:
    engine = {"SLUICE_TRITON_LOCAL_MAX_SLOTS": str(ROUTING_SLOTS), "SLUICE_TRITON_LOCAL_PREFIX_CACHE_HOST_MIB": ROUTING_HOST_MIB}

    def one(name: str, prefix_routing: bool) -> Stack:
        return Stack(
            run_dir=run_dir / name,
            ports=StackPorts.ephemeral(),
            amqp_prefix=f"sluice-bench-prefix-{uuid.uuid4().hex[:8]}",
            extra_triton_replicas=1,
            serve_variant=False,
            extra_env={
                "triton-local": engine,
                "triton-local-2": engine,
                "inference-adapter": {
                    "SLUICE_ADAPTER_MAX_BATCH_SIZE": str(ROUTING_SLOTS),
                    "SLUICE_ADAPTER_PREFIX_ROUTING": str(prefix_routing).lower(),
                },
            },
        )

    return {BY_PREFIX: one("by-prefix", True), BY_LOAD: one("by-load", False)}


def run_routing(run_dir: Path) -> tuple[dict[str, list[Phase]], dict[str, float]]:
    """The routing load on both two-replica stacks: each side's phases and its busiest replica's share."""
    stacks = routing_stacks(run_dir)
    phases: dict[str, list[Phase]] = {router: [] for router in ROUTERS}
    shares: dict[str, float] = {}
    with running(stacks[BY_PREFIX]), running(stacks[BY_LOAD]):
        demo = {"Authorization": f"Bearer {DEMO_KEY}"}
        servers = {router: Server(f"{stack.openai_base_url}/chat/completions", demo) for router, stack in stacks.items()}
        before = {router: routed_requests(stack) for router, stack in stacks.items()}
        for round_ in range(1, ROUNDS + 1):
            for router in ROUTERS if round_ % 2 else ROUTERS[::-1]:
                phase = asyncio.run(routing(servers[router], round_))
                phases[router].append(phase)
                f = figures([phase])
                print(
                    f"round {round_} routing {router:<9} {f.ok} ok, {f.failed} failed, TTFT p50 {f.ttft_p50_ms:.0f} ms, cached {f.cached_share:.0%}",
                    flush=True,
                )
        shares = {router: busiest_share(before[router], routed_requests(stack)) for router, stack in stacks.items()}
    return phases, shares


@dataclass(frozen=True)
class Figures:
    ttft_p50_ms: float
    ttft_p99_ms: float
    tokens_per_s: float
    cached_share: float
    ok: int
    failed: int


def figures(phases: list[Phase]) -> Figures:
    """One side's figures over its rounds: TTFT pooled, tokens over the summed wall times."""
    results = [r for p in phases for r in p.results]
    nan = float("nan")
    if not results:
        return Figures(nan, nan, nan, nan, 0, sum(p.failed for p in phases))
    ttfts = [r.ttft_s * 1000 for r in results]
    wall = sum(max(r.ended for r in p.results) - min(r.sent for r in p.results) for p in phases if p.results)
    prompt = sum(r.prompt_tokens for r in results)
    return Figures(
        percentile(ttfts, 50),
        percentile(ttfts, 99),
        sum(r.tokens for r in results) / wall,
        sum(r.cached_tokens for r in results) / prompt if prompt else nan,
        len(results),
        sum(p.failed for p in phases),
    )


def report(by_load: dict[str, dict[str, Figures]], busiest: dict[str, float]) -> list[str]:
    lines = [f"{'load':<20} {'side':<10} {'TTFT p50':>10} {'TTFT p99':>10} {'tok/s':>7} {'cached':>7} {'ok':>4} {'failed':>6}"]
    for load, sides in by_load.items():
        for side, f in sides.items():
            lines.append(
                f"{load:<20} {side:<10} {f.ttft_p50_ms:8.1f} ms {f.ttft_p99_ms:7.1f} ms {f.tokens_per_s:7.1f} {f.cached_share:7.1%} {f.ok:>4} {f.failed:>6}"
            )
    shared, later, routed = by_load["shared_prompt"], by_load["multiturn_turns2+"], by_load["routing"]
    return [
        *lines,
        "",
        f"BENCH prefix_cache_ttft_speedup {shared[UNCACHED].ttft_p50_ms / shared[CACHED].ttft_p50_ms:.2f} x (target >= 4)",
        f"BENCH prefix_cache_tokens_per_s_ratio {shared[CACHED].tokens_per_s / shared[UNCACHED].tokens_per_s:.2f} x (target >= 1.0)",
        f"BENCH prefix_cache_multiturn_speedup {later[UNCACHED].ttft_p50_ms / later[CACHED].ttft_p50_ms:.2f} x (target >= 3)",
        f"BENCH prefix_cache_shared_prompt_cached_share {shared[CACHED].cached_share:.1%} of prompt tokens",
        f"BENCH prefix_routing_ttft_p50_speedup {routed[BY_LOAD].ttft_p50_ms / routed[BY_PREFIX].ttft_p50_ms:.2f} x (target >= 2)",
        f"BENCH prefix_routing_ttft_p99_speedup {routed[BY_LOAD].ttft_p99_ms / routed[BY_PREFIX].ttft_p99_ms:.2f} x",
        f"BENCH prefix_routing_cached_share {routed[BY_PREFIX].cached_share:.1%} by prefix, {routed[BY_LOAD].cached_share:.1%} by load",
        f"BENCH prefix_routing_busiest_replica_share {busiest[BY_PREFIX]:.0%} by prefix, {busiest[BY_LOAD]:.0%} by load (target <= 70%)",
    ]


def main() -> int:
    with tempfile.TemporaryDirectory() as scratch:
        run_dir = Path(os.environ.get("BENCH_RUN_DIR") or scratch)
        cached, uncached = two_stacks(run_dir, "bench-prefix")
        print("starting the stack as `make run` does, with and without its prefix cache ...", flush=True)
        with running(cached), running(uncached):
            demo = {"Authorization": f"Bearer {DEMO_KEY}"}
            servers = {side: Server(f"{stack.openai_base_url}/chat/completions", demo) for side, stack in ((CACHED, cached), (UNCACHED, uncached))}
            phases: dict[tuple[str, str], list[Phase]] = {}
            for round_ in range(1, ROUNDS + 1):
                for side in SIDES if round_ % 2 else SIDES[::-1]:
                    shared = asyncio.run(shared_prompt(servers[side], round_))
                    first, later = asyncio.run(multiturn(servers[side], round_))
                    for load, phase in (("shared_prompt", shared), ("multiturn_turn1", first), ("multiturn_turns2+", later)):
                        phases.setdefault((load, side), []).append(phase)
                        f = figures([phase])
                        print(
                            f"round {round_} {load:<18} {side:<9} {f.ok} ok, {f.failed} failed, TTFT p50 {f.ttft_p50_ms:.0f} ms, cached {f.cached_share:.0%}",
                            flush=True,
                        )
        routed, busiest = run_routing(run_dir)
    by_load = {load: {side: figures(phases[(load, side)]) for side in SIDES} for load in ("shared_prompt", "multiturn_turn1", "multiturn_turns2+")}
    by_load["routing"] = {router: figures(routed[router]) for router in ROUTERS}
    print()
    print("\n".join(report(by_load, busiest)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
