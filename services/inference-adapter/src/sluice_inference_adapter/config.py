"""inference-adapter settings, from SLUICE_ADAPTER_* environment variables."""

from __future__ import annotations

from dataclasses import dataclass

from sluice_common.adaptive_timeout import TimeoutPolicy
from sluice_common.config import ServerConfig, require
from sluice_inference_adapter.extra_models import ExtraModel, parse_extra_model
from sluice_inference_adapter.replica_discovery import parse_target

ENV_PREFIX = "SLUICE_ADAPTER_"


@dataclass(frozen=True)
class AdapterConfig(ServerConfig):
    port: int = 50061
    metrics_port: int = 9102
    # Triton gRPC endpoints (KServe v2), comma-separated: replicas serving the same model. Each is
    # host:port (one replica), or dns:///name:port (one replica per address the name resolves to,
    # re-resolved: the pods behind a headless Service; replica_discovery.py).
    triton_urls: tuple[str, ...] = ("127.0.0.1:8001",)
    # How often dns:/// names are resolved again (pods that appear are added, those gone drained).
    triton_resolve_interval_s: float = 10.0
    # The name clients use, and the Triton model that serves it: a step-protocol model (the
    # adapter batches) or a model behind Triton's vLLM backend (the engine batches), told apart
    # by the model's inputs.
    model_name: str = "smollm2-135m-instruct"
    triton_model: str = "smollm2_step"
    # Where the chat template of a vLLM-backend model comes from (that engine takes raw text):
    # the model's GGUF file, its tokenizer_config.json, or a Jinja template file. Step-protocol
    # models apply their own template and need none.
    chat_template: str = ""
    # More generation models on the same Triton replicas, each `name=triton_model` or
    # `name=triton_model:max_batch_size` (default MAX_BATCH_SIZE), comma-separated: each gets its
    # own replica pool and schedulers, so its batches never mix with the main model's. The local
    # stack serves triton-local's second variant this way (`sluice eval` compares the two).
    extra_models: tuple[str, ...] = ()
    # The embedding model clients name, and the Triton model serving it (empty: no embeddings).
    embedding_model_name: str = "all-minilm-l6-v2"
    triton_embedding_model: str = "minilm_embed"
    embedding_dimensions: int = 384
    # The embedding model's maximum input in tokens ([CLS] and [SEP] included), where it cuts longer
    # texts (all-MiniLM-L6-v2: 256, sentence-transformers' max_seq_length); must match the model.
    # ListModels reports it as the model's context_length, and Embed's truncate_prompt_tokens takes
    # it (or -1) as the one place it can cut.
    embedding_context_length: int = 256
    # Micro-batching: a batch leaves at EMBED_MAX_BATCH texts or EMBED_MAX_DELAY_S after the oldest.
    embed_max_batch: int = 32
    embed_max_delay_s: float = 0.005
    embed_max_waiting: int = 4096
    # Micro-batches at Triton at once (texts keep gathering meanwhile): with one, a batch stuck on a
    # wedged replica held every Embed caller until the embedding timeout cut it off.
    embed_max_in_flight: int = 2
    # The embedding cache (embedding_cache.py): at most EMBED_CACHE_BYTES (0: no cache), lowered to
    # EMBED_CACHE_MEMORY_SHARE of the container's memory limit (cgroup) when that is smaller.
    # 64 MiB holds ~35,000 384-d entries of sentence-length texts.
    embed_cache_bytes: int = 64 * 1024 * 1024
    embed_cache_memory_share: float = 0.0
    # Must match the model server's context (triton-local: SLUICE_TRITON_LOCAL_MAX_CONTEXT).
    context_length: int = 2048
    max_output_tokens: int = 1024
    # Measured with make bench-load (docs/operators/tuning.md, "Choosing the batch bounds"); at most the slots the
    # step model holds (triton-local: SLUICE_TRITON_LOCAL_MAX_SLOTS, 32).
    max_batch_size: int = 32
    # Generate models: streams held open per replica, so the engine's batch is full, not overfull.
    max_in_flight: int = 8
    # KV budget of a replica's batch: prompt + max_tokens summed over running sequences.
    max_batch_tokens: int = 65536
    max_waiting: int = 256
    # While a batch runs, prefills wait for MIN_PREFILL_ROWS companions, at most MAX_WAITING_STEPS steps.
    min_prefill_rows: int = 1
    max_waiting_steps: int = 8
    # Multi-step rounds: engine steps per round trip to Triton, at most MAX_ROUND_STEPS and no more
    # than fit ROUND_TARGET_S at the recent step time; 1 while requests wait to be admitted, and a
    # round is asked to end early when one arrives or a slot frees for it. MAX_ROUND_STEPS=1: one
    # round trip per token. 64 (the protocol's most) rather than 8: arrivals end a round anyway, and
    # each round boundary costs a request's way in and the engine's idle wait for it; at 1 stream on
    # 2 cores 64 decoded 1.047x the tokens/s of 8 (4 alternated rounds, docs/contributors/benchmarks.md).
    max_round_steps: int = 64
    round_target_s: float = 1.0
    # While a round runs, plan the next and send it to follow it at the engine, which then starts
    # it without waiting a round trip (round_ahead.py). Off by default: the request's way in then
    # costs CPU while the engine computes instead of while it waits, which on a box whose cores the
    # engine shares with the stack slowed 1-stream decoding (0.93x, `make bench-rounds-ahead`); on
    # when the engine has its own (a GPU) and the round trip is a larger share of a step.
    rounds_ahead: bool = False
    # How long a round's later steps may wait to share one response from Triton (and so one
    # message to the gateway and one chunk to the client): each response costs every process on
    # the way CPU, which a small box takes from the engine and a GPU from its feeding. A first
    # token, a finish and a round's end never wait. 0: one response per engine step.
    stream_interval_s: float = 0.05
    # Bulk beside interactive (scheduler.SchedulerLimits): bulk sequences caching their prompts
    # at once (0: no cap), prompt tokens a bulk sequence caches per step (0: its whole prompt),
    # and batch slots bulk sequences leave to interactive ones. The chunk bounds how long a step
    # in progress delays an interactive first token: 16 tokens on this CPU engine (~40 ms), a few
    # hundred on a GPU.
    max_bulk_prefill_rows: int = 1
    bulk_prefill_chunk: int = 16
    interactive_reserved_slots: int = 1
    # While interactive requests come (one ran in the last 30 s), no bulk sequence joins a batch
    # that already runs one while the recent step time is above this (0: no bound): an interactive
    # first token waits for the step in progress, and on this CPU engine 8-12 bulk rows made steps
    # of 100-250 ms; a GPU's steps stay under it. 0.1 s keeps most of a job's pace there (0.05 s
    # kept a fifth, and a job stalled beside a burst of interactive requests in e2e).
    bulk_step_target_s: float = 0.1
    # An interactive request that arrives while a round carrying bulk sequences runs asks the engine
    # to stop that round's step midway (step_protocol's INTERRUPT; its rows are stepped again at a
    # later round), so that its first token does not wait for a step made long by bulk rows. Costs
    # the stopped step's work, and a streaming interactive sequence in it one step's wait.
    interrupt_bulk: bool = True
    # Prefix-aware routing (prefix_routing.py): a generation request goes to the replica this
    # adapter sent the longest prefix of its prompt (its engine's prefix cache likely holds it),
    # unless that replica has more than PREFIX_ROUTING_LOAD_BOUND waiting plus running sequences
    # beyond the least loaded one (or a full batch while another has a free slot). Off: least loaded.
    prefix_routing: bool = True
    prefix_routing_load_bound: int = 8
    # A replica is unhealthy after this many consecutive failed steps or probes.
    replica_failure_threshold: int = 2
    # Replicas that have not answered a step for PROBE_INTERVAL_S are probed: Triton's ready checks,
    # plus one generated token for an unhealthy replica (readmitted on it) or a healthy one that has
    # generated none for PROBE_TOKEN_INTERVAL_S (0: every probe). A token is a whole forward pass: on
    # a CPU engine, every 2 s, 3-4% of a core per idle replica, and another adapter's round ended.
    probe_interval_s: float = 2.0
    probe_token_interval_s: float = 30.0
    # Adaptive timeouts (step_timeout.py, sluice_common.adaptive_timeout): TIMEOUT_MULTIPLIER x the
    # rolling p99 of the last TIMEOUT_WINDOW calls, within a floor and a ceiling; the ceiling until
    # TIMEOUT_MIN_SAMPLES calls have been seen. A call cut off counts as a failure of its replica.
    timeout_multiplier: float = 2.0
    timeout_window: int = 1000
    timeout_min_samples: int = 50
    # One step request to Triton. The floor keeps a noisy neighbour's pause (a shared CPU) from
    # failing a replica; STEP_TIMEOUT_S is the ceiling (the fixed timeout before it adapted).
    step_timeout_floor_s: float = 5.0
    step_timeout_s: float = 60.0
    # One embedding micro-batch sent to Triton.
    embed_timeout_floor_s: float = 2.0
    embed_timeout_s: float = 30.0
    # How long startup waits for Triton to report the model ready, and then again for a first
    # token; 0: for ever (NOT_SERVING on readiness meanwhile, SERVING on liveness), so that a pod
    # started during a Triton outage does not crash-loop. Set it to bound the wait (the process exits).
    backend_wait_s: float = 0.0

    def extra_model_list(self) -> list[ExtraModel]:
        return [parse_extra_model(entry, self.max_batch_size) for entry in self.extra_models]

    def step_timeout_policy(self) -> TimeoutPolicy:
        return TimeoutPolicy(self.timeout_multiplier, self.step_timeout_floor_s, self.step_timeout_s, self.timeout_window, self.timeout_min_samples)

    def embed_timeout_policy(self) -> TimeoutPolicy:
        return TimeoutPolicy(self.timeout_multiplier, self.embed_timeout_floor_s, self.embed_timeout_s, self.timeout_window, self.timeout_min_samples)

    def __post_init__(self) -> None:
        shared = (f"{ENV_PREFIX}TIMEOUT_MULTIPLIER", f"{ENV_PREFIX}TIMEOUT_WINDOW", f"{ENV_PREFIX}TIMEOUT_MIN_SAMPLES")
        problems: list[str] = []
        for kind, policy in (("STEP", self.step_timeout_policy()), ("EMBED", self.embed_timeout_policy())):
            for problem in policy.problems(shared[0], f"{ENV_PREFIX}{kind}_TIMEOUT_FLOOR_S", f"{ENV_PREFIX}{kind}_TIMEOUT_S", shared[1], shared[2]):
                if problem not in problems:  # the shared settings' problems once, not per kind
                    problems.append(problem)
        require(not problems, "; ".join(problems))
        require(self.max_bulk_prefill_rows >= 0, f"{ENV_PREFIX}MAX_BULK_PREFILL_ROWS must be >= 0, got {self.max_bulk_prefill_rows}")
        require(self.bulk_step_target_s >= 0, f"{ENV_PREFIX}BULK_STEP_TARGET_S must be >= 0 (0: no bound), got {self.bulk_step_target_s}")
        require(self.bulk_prefill_chunk >= 0, f"{ENV_PREFIX}BULK_PREFILL_CHUNK must be >= 0 (0: whole prompts), got {self.bulk_prefill_chunk}")
        require(
            0 <= self.interactive_reserved_slots < self.max_batch_size,
            f"{ENV_PREFIX}INTERACTIVE_RESERVED_SLOTS must be in [0, MAX_BATCH_SIZE), got {self.interactive_reserved_slots}",
        )
        require(self.max_batch_size >= 1, f"{ENV_PREFIX}MAX_BATCH_SIZE must be >= 1, got {self.max_batch_size}")
        # The step protocol's own bound (triton-local step_protocol.MAX_ROUND_STEPS).
        require(
            1 <= self.max_round_steps <= 64, f"{ENV_PREFIX}MAX_ROUND_STEPS must be in 1..64 (1: a round trip per token), got {self.max_round_steps}"
        )
        require(self.round_target_s > 0, f"{ENV_PREFIX}ROUND_TARGET_S must be > 0, got {self.round_target_s}")
        require(
            0 <= self.stream_interval_s <= 1,
            f"{ENV_PREFIX}STREAM_INTERVAL_S must be in 0..1 seconds (0: one response per engine step), got {self.stream_interval_s}",
        )
        require(len(self.triton_urls) >= 1, f"{ENV_PREFIX}TRITON_URLS needs at least one host:port")
        for entry in self.triton_urls:
            try:
                parse_target(entry)
            except ValueError as exc:
                require(False, f"{ENV_PREFIX}TRITON_URLS: {exc}")
        require(self.probe_interval_s > 0, f"{ENV_PREFIX}PROBE_INTERVAL_S must be > 0, got {self.probe_interval_s}")
        require(self.backend_wait_s >= 0, f"{ENV_PREFIX}BACKEND_WAIT_S must be >= 0 (0: wait for ever), got {self.backend_wait_s}")
        require(
            self.probe_token_interval_s >= 0,
            f"{ENV_PREFIX}PROBE_TOKEN_INTERVAL_S must be >= 0 (0: every probe generates a token), got {self.probe_token_interval_s}",
        )
        require(self.triton_resolve_interval_s > 0, f"{ENV_PREFIX}TRITON_RESOLVE_INTERVAL_S must be > 0, got {self.triton_resolve_interval_s}")
        require(self.embedding_context_length >= 1, f"{ENV_PREFIX}EMBEDDING_CONTEXT_LENGTH must be >= 1, got {self.embedding_context_length}")
        require(self.embed_max_in_flight >= 1, f"{ENV_PREFIX}EMBED_MAX_IN_FLIGHT must be >= 1, got {self.embed_max_in_flight}")
        require(self.embed_cache_bytes >= 0, f"{ENV_PREFIX}EMBED_CACHE_BYTES must be >= 0 (0: no cache), got {self.embed_cache_bytes}")
        require(
            0 <= self.embed_cache_memory_share < 1,
            f"{ENV_PREFIX}EMBED_CACHE_MEMORY_SHARE must be in [0, 1) (0: unset), got {self.embed_cache_memory_share}",
        )
        names = [self.model_name, self.embedding_model_name]
        for entry in self.extra_models:
            try:
                extra = parse_extra_model(entry, self.max_batch_size)
            except ValueError as exc:
                require(False, f"{ENV_PREFIX}EXTRA_MODELS: {exc}")
            require(extra.name not in names, f"{ENV_PREFIX}EXTRA_MODELS: the model name {extra.name!r} is used twice")
            names.append(extra.name)
        require(
            self.prefix_routing_load_bound >= 0,
            f"{ENV_PREFIX}PREFIX_ROUTING_LOAD_BOUND must be >= 0 (sequences beyond the least loaded replica), got {self.prefix_routing_load_bound}",
        )
        require(self.max_waiting >= 1, f"{ENV_PREFIX}MAX_WAITING must be >= 1, got {self.max_waiting}")
        require(
            0 < self.max_output_tokens < self.context_length,
            f"{ENV_PREFIX}MAX_OUTPUT_TOKENS must be in 1..CONTEXT_LENGTH-1, got {self.max_output_tokens}",
        )
