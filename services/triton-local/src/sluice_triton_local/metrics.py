"""Prometheus metrics of the model process (Triton's own metrics are on its metrics port)."""

from __future__ import annotations

from wsgiref.simple_server import WSGIServer

from prometheus_client import Counter, Gauge, Histogram, start_http_server

TOKENS_GENERATED = Counter("sluice_triton_local_tokens_generated_total", "Tokens sampled by the step model.")
VARIANT_TOKENS_GENERATED = Counter(
    "sluice_triton_local_variant_tokens_generated_total", "Tokens sampled by the second variant's step model (VARIANT_MODEL_NAME)."
)
ACTIVE_SLOTS = Gauge("sluice_triton_local_active_slots", "KV-cache slots held by running sequences.")
# The configured bound `sluice diagnose` compares the slots in use with (SLUICE_TRITON_LOCAL_MAX_SLOTS).
MAX_SLOTS = Gauge("sluice_triton_local_max_slots", "KV-cache slots the engine has: sequences it can run at once.")
# Engine threads against the CPUs the process can keep busy: more threads than CPUs stalls every step.
ENGINE_THREADS = Gauge("sluice_triton_local_engine_threads", "Threads the engine computes a step with (SLUICE_TRITON_LOCAL_THREADS).")
ENGINE_THREADS_IN_USE = Gauge(
    "sluice_triton_local_engine_threads_in_use",
    "Threads the engine computes its steps with now: fewer than sluice_triton_local_engine_threads while another process takes cores"
    " (SLUICE_TRITON_LOCAL_ADAPTIVE_THREADS).",
)
USABLE_CPUS = Gauge("sluice_triton_local_usable_cpus", "CPUs this process can keep busy: its cores, lowered by a container CPU limit.")
SLOTS_BY_OWNER = Gauge("sluice_triton_local_slots_by_owner", "KV-cache slots held, per adapter instance that drives them.", ["owner"])
SLOTS_RECLAIMED = Counter("sluice_triton_local_slots_reclaimed_total", "Sequences released because nobody stepped them within the slot lease.")
# The prefix cache: hit ratio = rate of lookups{result="hit"} / rate of all lookups.
PREFIX_CACHE_LOOKUPS = Counter(
    "sluice_triton_local_prefix_cache_lookups_total",
    "Prefills by whether they started from tokens a slot held (hit) or prefilled the whole prompt (miss).",
    ["result"],
)
PREFIX_CACHE_REUSED_TOKENS = Counter(
    "sluice_triton_local_prefix_cache_reused_tokens_total", "Prompt tokens taken from the prefix cache instead of prefilled."
)
PREFILLS_DEFERRED = Counter(
    "sluice_triton_local_prefills_deferred_total",
    "Prompts a step left for a later step, as beyond its prefill budget (SLUICE_TRITON_LOCAL_PREFILL_TOKENS_PER_STEP); once per step each waits.",
)
PREFIX_CACHE_SLOTS = Gauge("sluice_triton_local_prefix_cache_slots", "Free KV-cache slots holding a finished sequence's cells for reuse.")
PREFIX_CACHE_HOST_BYTES = Gauge(
    "sluice_triton_local_prefix_cache_host_bytes",
    "Bytes of KV cells evicted from their slot and kept in host memory for reuse (PREFIX_CACHE_HOST_MIB).",
)
PREFIX_CACHE_HOST_RESTORES = Counter(
    "sluice_triton_local_prefix_cache_host_restores_total", "Prefills that started from a prefix restored from host memory into a slot."
)
# Powers of two up to the largest batch and the longest round (step_protocol.MAX_ROUND_STEPS).
_COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
STEP_ROWS = Histogram("sluice_triton_local_step_rows", "Rows (sequences) per engine step.", buckets=_COUNT_BUCKETS)
STEP_SECONDS = Histogram(
    "sluice_triton_local_step_seconds",
    "Time the engine spent on one engine step (a round of a step request runs several).",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)
ROUND_STEPS = Histogram(
    "sluice_triton_local_round_steps",
    "Engine steps one step request ran (a multi-step round ends early when its sequences have finished).",
    buckets=_COUNT_BUCKETS,
)
RELEASED_MID_ROUND = Counter(
    "sluice_triton_local_released_mid_round_total",
    "Sequences a release request stopped inside a round in flight, at the round's next step (cancelled streams).",
)
INTERRUPT_ASKS = Counter(
    "sluice_triton_local_interrupt_asks_total",
    "Interrupt asks (step protocol ACTION 6) by whether an interruptible step was computing to stop (found=step) or not (found=none:"
    " the round in flight ends after its current step, and the ask is kept for the next step to start within 0.2 s, which it"
    " stops before it computes if that step is interruptible: an ask can reach the engine before its round).",
    ["found"],
)
STEPS_INTERRUPTED = Counter(
    "sluice_triton_local_steps_interrupted_total",
    "Steps of an interruptible round (bulk work) stopped midway, or before they computed, for an interrupt ask (an interactive arrival);"
    " their rows made no token and were stepped again later.",
)
EMBED_TEXTS = Counter("sluice_triton_local_embed_texts_total", "Texts embedded by the embedding model.")
EMBED_BATCH = Histogram(
    "sluice_triton_local_embed_batch_texts",
    "Texts per embedding request.",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)
EMBED_SECONDS = Histogram(
    "sluice_triton_local_embed_seconds",
    "Time the encoder spent on one embedding request.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)


def serve_metrics(port: int, addr: str, max_slots: int) -> WSGIServer:
    """Serves this process's metrics on `port` (prometheus_client's HTTP server, a daemon thread),
    the main engine's slots (MAX_SLOTS) set first: triton-local's model process, and the step model
    of deploy/triton (its METRICS_PORT), which serve the same names. shutdown() and server_close()
    stop it."""
    MAX_SLOTS.set(max_slots)
    server, _ = start_http_server(port, addr=addr)
    return server
