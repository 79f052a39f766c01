"""The adapter's Prometheus metrics: what an operator watches to size batches and replicas."""

from prometheus_client import Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

WAITING = Gauge("sluice_adapter_waiting_requests", "Requests waiting for a batch slot.", ["priority"])
SLOTS_IN_USE = Gauge("sluice_adapter_kv_slots_in_use", "Sequences holding a KV-cache slot at Triton.")
BATCH_SIZE = Histogram(
    "sluice_adapter_batch_size", "Token-producing rows per step.", buckets=(1, 2, 4, 8, 16, 32, 64, 128)
)
STEP_SECONDS = Histogram("sluice_adapter_step_seconds", "Round trip of one step request to Triton.", buckets=_LATENCY_BUCKETS)
QUEUE_SECONDS = Histogram("sluice_adapter_queue_seconds", "Time from arrival to prefill.", buckets=_LATENCY_BUCKETS)
TIME_TO_FIRST_TOKEN = Histogram(
    "sluice_adapter_time_to_first_token_seconds", "Time from arrival to the first token.", buckets=_LATENCY_BUCKETS
)
INTER_TOKEN = Histogram(
    "sluice_adapter_inter_token_seconds", "Gap between consecutive tokens of a sequence.", buckets=_LATENCY_BUCKETS
)
REJECTIONS = Counter("sluice_adapter_rejections_total", "Requests refused before scheduling.", ["reason"])
CANCELLATIONS = Counter("sluice_adapter_cancellations_total", "Sequences stopped before they finished.", ["reason"])
BACKEND_READY = Gauge("sluice_adapter_backend_ready", "1 when the Triton endpoint and model answer ready.", ["endpoint"])
