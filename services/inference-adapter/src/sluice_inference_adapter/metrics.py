"""The adapter's Prometheus metrics: what an operator watches to size batches and replicas."""

from collections.abc import Iterable
from contextlib import suppress

from prometheus_client import Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

WAITING = Gauge("sluice_adapter_waiting_requests", "Requests waiting for a batch slot, per Triton replica.", ["priority", "replica"])
# deploy/prometheus/rules publishes it as vllm:num_requests_running: the running sequences alone.
SLOTS_IN_USE = Gauge("sluice_adapter_kv_slots_in_use", "Sequences running at a Triton replica, each holding a KV-cache slot there.", ["replica"])
SLOTS_RELEASE_PENDING = Gauge(
    "sluice_adapter_kv_slots_release_pending",
    "KV-cache slots a Triton replica still holds for sequences that ended here, owed a release that has not reached it"
    " (a failed round dropped them, or their release failed or has not been answered yet); retried until it lands.",
    ["replica"],
)
ENGINE_FULL = Counter(
    "sluice_adapter_engine_full_total",
    "Prefills a replica's step model answered busy (every slot taken, by this or another adapter): retried later.",
    ["replica"],
)
BULK_HELD = Counter(
    "sluice_adapter_bulk_held_total",
    "Steps planned with a bulk sequence left waiting because interactive requests run and the recent step time is over BULK_STEP_TARGET_S.",
    ["replica"],
)
# Not labelled by replica (yet): tests/e2e/test_batching.py reads its unlabelled _count sample.
BATCH_SIZE = Histogram("sluice_adapter_batch_size", "Token-producing rows per step.", buckets=(1, 2, 4, 8, 16, 32, 64, 128))
STEP_SECONDS = Histogram(
    "sluice_adapter_step_seconds",
    "Time from a round's request (or its previous step's answer) to one engine step's answer from a Triton replica,"
    " as the scheduler times steps: not the first step of a round sent ahead (it waited for the round before it),"
    " nor a step an interrupt stopped midway; steps that shared one response count its time split between them.",
    ["replica"],
    buckets=_LATENCY_BUCKETS,
)
ROUND_STEPS = Histogram(
    "sluice_adapter_round_steps",
    "Engine steps asked for per round trip (multi-step rounds; 1 while requests wait to be admitted).",
    buckets=(1, 2, 4, 8, 16, 32, 64),
)
ROUND_END_ASKED_AGAIN = Counter(
    "sluice_adapter_round_end_asked_again_total",
    "End-round asks sent again with the round's first response: the first was sent before the round answered and may have reached the engine before the round did.",
    ["replica"],
)
INTERRUPTS_ASKED = Counter(
    "sluice_adapter_interrupts_asked_total",
    "Interrupts asked of a round carrying bulk work for an interactive request waiting: the engine stops its step in progress"
    " (sluice_triton_local_steps_interrupted_total counts those it stopped).",
    ["replica"],
)
ROUNDS_SENT_AHEAD = Counter(
    "sluice_adapter_rounds_sent_ahead_total",
    "Rounds sent while the previous one ran, to follow it at the engine without a round trip between (step protocol's FOLLOWS_ROUND).",
    ["replica"],
)
QUEUE_SECONDS = Histogram(
    "sluice_adapter_queue_seconds",
    "Time a sequence waited in a replica's waiting queue, from joining it to the prefill the engine took; once per"
    " replica that took its prefill (a request retried on another replica waits in that one's queue anew).",
    ["replica"],
    buckets=_LATENCY_BUCKETS,
)
TIME_TO_FIRST_TOKEN = Histogram(
    "sluice_adapter_time_to_first_token_seconds",
    "Time from a request's arrival at the adapter to its first token, a failed or draining replica's time before a retry included.",
    buckets=_LATENCY_BUCKETS,
)
INTER_TOKEN = Histogram("sluice_adapter_inter_token_seconds", "Gap between consecutive tokens of a sequence.", buckets=_LATENCY_BUCKETS)
# The configured bound `sluice diagnose` compares each model's batch (its kv_slots_in_use series:
# '<address>' for the main model, '<address>#<model>' for an extra one) with.
CONCURRENCY_LIMIT = Gauge(
    "sluice_adapter_concurrency_limit",
    "Sequences one Triton replica may run at once for a model: MAX_BATCH_SIZE (step protocol) or MAX_IN_FLIGHT (passthrough).",
    ["model"],
)
REJECTIONS = Counter("sluice_adapter_rejections_total", "Requests refused before scheduling.", ["reason"])
CANCELLATIONS = Counter("sluice_adapter_cancellations_total", "Sequences stopped before they finished.", ["reason"])
BACKEND_READY = Gauge("sluice_adapter_backend_ready", "1 when a Triton replica and its model answer ready.", ["replica"])
BATCH_TOKENS = Histogram(
    "sluice_adapter_batch_tokens",
    "KV tokens reserved (prompt + max_tokens) by a replica's running batch, per step.",
    ["replica"],
    buckets=(64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536),
)
REPLICA_HEALTHY = Gauge("sluice_adapter_replica_healthy", "1 when a Triton replica is admitted for routing.", ["replica"])
REPLICA_LOAD = Gauge("sluice_adapter_replica_load", "Waiting plus running sequences per replica.", ["replica"])
RETRIES = Counter("sluice_adapter_retries_total", "Requests moved to another replica before their first token.")
REPLICAS = Gauge(
    "sluice_adapter_replicas",
    "Triton replicas by state: serving (routed to), unhealthy (probed until it answers), draining (its sequences finish, no new ones).",
    ["state"],
)
STEP_TIMEOUT = Gauge(
    "sluice_adapter_step_timeout_seconds",
    "The current timeout of a decode-only step to Triton: multiplier x the pool's rolling p99 of such steps, within"
    " floor and ceiling (a step that prefills n tokens gets n x the p99 per prefill token more; step_timeout.py)."
    " For a passthrough model: the wait between two responses of a stream.",
    ["model"],
)
REQUEST_TIMEOUT = Gauge(
    "sluice_adapter_request_timeout_seconds",
    "The current adaptive timeout of other calls to Triton, by kind: embed_batch (one embedding micro-batch).",
    ["kind"],
)
TIMEOUTS = Counter(
    "sluice_adapter_timeouts_total",
    "Calls to Triton cut off by an adaptive timeout (each counts as a failure of its replica), by kind: step, probe,"
    " count_tokens, embed_batch, stream_first and stream_gap (a passthrough stream's wait for its first or next response).",
    ["kind"],
)
# Prefix-aware routing (prefix_routing.py). The estimated share of prompt text the chosen replica
# already held = rate(routed_matched_chars) / rate(routed_prompt_chars); what the engines report
# reusing = rate(cached_prompt_tokens) / rate(prompt_tokens), per replica.
ROUTING_DECISIONS = Counter(
    "sluice_adapter_routing_decisions_total",
    "Generation requests routed to a replica, by why that one: prefix (it was sent the longest prefix of the prompt,"
    " within the load bound), load_bound (a longer match was on a replica loaded beyond the bound), load (no replica"
    " matched, or prefix routing is off: the least loaded), only_replica (one candidate).",
    ["model", "reason"],
)
ROUTED_REQUESTS = Counter(
    "sluice_adapter_routed_requests_total", "Generation requests routed to each replica (counted when routed, retries included).", ["replica"]
)
ROUTED_PROMPT_CHARS = Counter(
    "sluice_adapter_routed_prompt_chars_total", "Characters of the prompts routed (canonical serialization: messages in order).", ["model"]
)
ROUTED_MATCHED_CHARS = Counter(
    "sluice_adapter_routed_matched_chars_total",
    "Characters of the routed prompts' leading blocks that the chosen replica was sent before (the estimated cache hit).",
    ["model"],
)
PREFIX_RECORD_PROMPTS = Gauge(
    "sluice_adapter_prefix_record_prompts",
    "Prompts remembered per replica for prefix routing (bounded; a failed replica's are forgotten).",
    ["replica"],
)
PROMPT_TOKENS = Counter("sluice_adapter_prompt_tokens_total", "Prompt tokens of finished sequences, per replica that served them.", ["replica"])
# vLLM's vllm:generation_tokens_total (deploy/prometheus/rules publishes it under that name): what
# tokens/s dashboards and autoscalers read.
GENERATION_TOKENS = Counter(
    "sluice_adapter_generation_tokens_total", "Tokens generated for finished sequences, per replica that served them.", ["replica"]
)
CACHED_PROMPT_TOKENS = Counter(
    "sluice_adapter_cached_prompt_tokens_total",
    "Prompt tokens the replica's engine reported taking from its prefix cache (CACHED_TOKENS), per replica.",
    ["replica"],
)
DISCOVERY_FAILURES = Counter(
    "sluice_adapter_discovery_failures_total",
    "DNS lookups of a dns:/// replica target that failed (reason=error) or named no address (reason=empty); the replicas were kept.",
    ["target", "reason"],
)


def forget_replica(replica: str, priorities: Iterable[str]) -> None:
    """Drops a removed replica's series, so that pod churn does not grow them for ever (a counter
    that ends is fine for rate())."""
    for metric in (
        SLOTS_IN_USE,
        SLOTS_RELEASE_PENDING,
        ENGINE_FULL,
        BULK_HELD,
        ROUND_END_ASKED_AGAIN,
        INTERRUPTS_ASKED,
        ROUNDS_SENT_AHEAD,
        STEP_SECONDS,
        QUEUE_SECONDS,
        BATCH_TOKENS,
        BACKEND_READY,
        REPLICA_HEALTHY,
        REPLICA_LOAD,
        PREFIX_RECORD_PROMPTS,
        PROMPT_TOKENS,
        GENERATION_TOKENS,
        CACHED_PROMPT_TOKENS,
        ROUTED_REQUESTS,
    ):
        with suppress(KeyError):
            metric.remove(replica)
    for priority in priorities:
        with suppress(KeyError):
            WAITING.remove(priority, replica)


_EMBED_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
EMBED_WAITING = Gauge("sluice_adapter_embed_waiting_texts", "Texts waiting for an embedding batch.")
EMBED_BATCH_TEXTS = Histogram(
    "sluice_adapter_embed_batch_texts", "Texts per embedding batch sent to the backend.", buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256)
)
EMBED_QUEUE_SECONDS = Histogram(
    "sluice_adapter_embed_queue_seconds", "Time from a text's arrival to its batch being sent.", buckets=_EMBED_LATENCY_BUCKETS
)
EMBED_BATCH_SECONDS = Histogram(
    "sluice_adapter_embed_batch_seconds", "Round trip of one embedding batch to the backend.", buckets=_EMBED_LATENCY_BUCKETS
)
EMBED_CACHE_HITS = Counter("sluice_adapter_embed_cache_hits_total", "Distinct texts of an Embed request answered from the embedding cache.")
EMBED_CACHE_MISSES = Counter(
    "sluice_adapter_embed_cache_misses_total", "Distinct texts of an Embed request the embedding cache did not hold (sent to Triton)."
)
EMBED_CACHE_EVICTIONS = Counter(
    "sluice_adapter_embed_cache_evictions_total", "Embedding cache entries evicted (least recently used first) to stay in its budget."
)
EMBED_CACHE_BYTES = Gauge(
    "sluice_adapter_embed_cache_bytes", "Bytes the embedding cache's entries are charged (vector row, text key, index overhead)."
)
EMBED_CACHE_CAPACITY_BYTES = Gauge("sluice_adapter_embed_cache_capacity_bytes", "The embedding cache's budget in bytes (0: no cache).")
