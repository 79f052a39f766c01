"""`python -m sluice_inference_adapter`: the scheduler in front of Triton, served over gRPC."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import replace

import structlog
from sluice.common.v1 import types_pb2
from sluice.inference.v1 import inference_pb2, inference_pb2_grpc

from sluice_common.adaptive_timeout import AdaptiveTimeout
from sluice_common.bootstrap import run_service
from sluice_common.loop_lag import monitor_loop_lag
from sluice_common.server import RunningServer, create_server, serve_until_signal
from sluice_common.supervision import Supervisor
from sluice_inference_adapter.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from sluice_inference_adapter import metrics
from sluice_inference_adapter.config import ENV_PREFIX, AdapterConfig
from sluice_inference_adapter.embed_batcher import EmbedBatcher
from sluice_inference_adapter.embedding_cache import CachedEmbedder, EmbeddingCache, cache_budget
from sluice_inference_adapter.metrics import CONCURRENCY_LIMIT
from sluice_inference_adapter.extra_models import ExtraModel
from sluice_inference_adapter.passthrough import PassthroughLimits, PassthroughScheduler
from sluice_inference_adapter.prefix_routing import PrefixRouter
from sluice_inference_adapter.replica_discovery import Discovery, parse_target
from sluice_inference_adapter.replica_pool import PROBE_MARGIN_S, BackendFactory, PooledEmbedBackend, ReplicaPool, SchedulerFactory
from sluice_inference_adapter.scheduler import Scheduler, SchedulerLimits
from sluice_inference_adapter.servicer import InferenceServicer
from sluice_inference_adapter.step_timeout import StepTimeouts
from sluice_inference_adapter.triton_backend import (
    Protocol,
    TritonEmbedBackend,
    TritonGenerateBackend,
    TritonStepBackend,
    detect_protocol,
    reports_logprobs,
)

log = structlog.stdlib.get_logger("sluice.adapter")

SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name

Backend = TritonStepBackend | TritonGenerateBackend

# How often a start-up wait for Triton says what it is waiting for (as a warning: it is an outage).
WAIT_LOG_INTERVAL_S = 30.0
# Between two looks at Triton during a start-up wait.
WAIT_RETRY_S = 0.5


class StartupWait:
    """A start-up wait for Triton, bounded by BACKEND_WAIT_S (0: for ever). Unbounded by default: a
    pod started during a Triton outage (a cold GPU deploy, a scale-out, a rollout) waits NOT_SERVING
    on readiness and SERVING on liveness, and serves once Triton does; exiting made it crash-loop,
    and its restart back-off delayed it past Triton's return. Says every WAIT_LOG_INTERVAL_S what it
    waits for."""

    def __init__(self, waiting_for: str, limit_s: float) -> None:
        self.waiting_for = waiting_for
        self.limit_s = limit_s
        self._started = self._told = time.monotonic()

    def over(self) -> bool:
        """Whether an operator's bound has passed (never without one)."""
        return self.limit_s > 0 and time.monotonic() - self._started > self.limit_s

    def tell(self, **details: object) -> None:
        now = time.monotonic()
        if now - self._told >= WAIT_LOG_INTERVAL_S:
            self._told = now
            bound = f"{self.limit_s:g}s" if self.limit_s > 0 else f"none ({ENV_PREFIX}BACKEND_WAIT_S=0)"
            log.warning("waiting_for_triton", waiting_for=self.waiting_for, waited_s=round(now - self._started), limit=bound, **details)


async def wait_for_a_ready_replica(config: AdapterConfig, discovery: Discovery, label: str = "") -> tuple[list[str], str]:
    """The replica addresses (DNS names resolved), and one whose Triton has the model ready.

    Names are resolved again on every round: at startup a headless Service may name no pod yet.
    `label`: the model's in the `replica` metric label (build_backends)."""
    probes: dict[str, TritonStepBackend] = {}
    wait = StartupWait(f"a Triton replica to report {config.triton_model} ready", config.backend_wait_s)
    try:
        while True:
            urls = sorted(await discovery.resolve())
            for url in urls:
                probes.setdefault(url, TritonStepBackend(url, config.triton_model, metrics_label=label))
            ready = await asyncio.gather(*(probes[url].is_ready() for url in urls))
            if any(ready):
                return urls, urls[ready.index(True)]
            if wait.over():
                found = f" (resolved: {', '.join(urls)})" if urls != list(config.triton_urls) else ""
                raise SystemExit(
                    f"no Triton replica ({', '.join(config.triton_urls)}){found} reported {config.triton_model}"
                    f" ready within {config.backend_wait_s:g}s ({ENV_PREFIX}BACKEND_WAIT_S; 0 waits for ever)"
                )
            wait.tell(triton_urls=list(config.triton_urls), resolved=urls)
            await asyncio.sleep(WAIT_RETRY_S)
    finally:
        await asyncio.gather(*(p.close() for p in probes.values()))


def build_backends(
    config: AdapterConfig, protocol: Protocol, urls: list[str], label: str = "", step_timeouts: StepTimeouts | None = None
) -> tuple[list[Backend], SchedulerFactory, BackendFactory]:
    """The first replicas' backends, how each replica's work is owned, and how a replica found
    later gets its backend. `label` tells an extra model's schedulers and backends apart from the
    main model's on the same replica (their owner-task names and `replica` metric labels).
    `step_timeouts`: the model's adaptive step timeout, one for the whole pool (step_timeout.py
    says why)."""
    make_backend: Callable[[str], Backend]
    make_scheduler: SchedulerFactory
    if protocol == "step":
        limits = SchedulerLimits(
            max_batch_size=config.max_batch_size,
            max_batch_tokens=config.max_batch_tokens,
            max_waiting=config.max_waiting,
            min_prefill_rows=config.min_prefill_rows,
            max_waiting_steps=config.max_waiting_steps,
            max_round_steps=config.max_round_steps,
            round_target_s=config.round_target_s,
            rounds_ahead=config.rounds_ahead,
            max_bulk_prefill_rows=config.max_bulk_prefill_rows,
            bulk_prefill_chunk=config.bulk_prefill_chunk,
            interactive_reserved_slots=config.interactive_reserved_slots,
            bulk_step_target_s=config.bulk_step_target_s,
            interrupt_bulk=config.interrupt_bulk,
        )
        make_backend = lambda url: TritonStepBackend(  # noqa: E731
            url, config.triton_model, config.step_timeout_s, step_timeouts, config.stream_interval_s, metrics_label=label
        )
        make_scheduler = lambda backend, on_step: Scheduler(backend, limits, on_step=on_step, replica=backend.url + label, timeouts=step_timeouts)  # type: ignore[arg-type]  # noqa: E731
    else:
        passthrough = PassthroughLimits(max_in_flight=config.max_in_flight, max_waiting=config.max_waiting)
        template = passthrough_chat_template(config)
        # Its probe's token is bounded as a step backend's is: by the pool's adaptive limit.
        make_backend = lambda url: TritonGenerateBackend(url, config.triton_model, config.step_timeout_s, step_timeouts, metrics_label=label)  # noqa: E731
        make_scheduler = lambda backend, on_step: PassthroughScheduler(  # noqa: E731
            backend,  # type: ignore[arg-type]  # a TritonGenerateBackend: make_backend's
            passthrough,
            template.render,
            on_step=on_step,
            replica=backend.url + label,
            timeouts=step_timeouts,
        )
    return [make_backend(url) for url in urls], make_scheduler, make_backend  # type: ignore[return-value]


def passthrough_chat_template(config: AdapterConfig) -> ChatTemplate:
    if not config.chat_template:
        raise SystemExit(
            f"{config.triton_model} is served by Triton's vLLM backend, which takes raw text: set"
            f" {ENV_PREFIX}CHAT_TEMPLATE to the model's GGUF file, tokenizer_config.json or a Jinja template"
        )
    try:
        template = load_chat_template(config.chat_template)
    except ChatTemplateError as exc:
        raise SystemExit(f"{ENV_PREFIX}CHAT_TEMPLATE: {exc}") from exc
    log.info("chat_template_loaded", source=template.source)
    return template


async def wait_for_a_healthy_replica(pool: ReplicaPool, timeout_s: float) -> None:
    """Probes until one replica answers a real token: ready checks alone can pass before that. A
    replica whose probe hangs holds up neither this wait (it looks every half second, each probe
    being bounded on its own) nor the other replicas' probes. `timeout_s` 0: for ever (StartupWait)."""
    wait = StartupWait("a Triton replica to generate a probe token", timeout_s)
    while True:
        await pool.probe_once(within_s=WAIT_RETRY_S)
        if pool.any_proven:
            return
        if wait.over():
            raise SystemExit(f"no Triton replica generated a token within {timeout_s:g}s ({ENV_PREFIX}BACKEND_WAIT_S; 0 waits for ever)")
        wait.tell(replicas=sorted(pool.names))
        await asyncio.sleep(WAIT_RETRY_S)


async def report_health(pool: ReplicaPool, running: RunningServer) -> None:
    """gRPC health follows the replicas: NOT_SERVING while none can take a request."""
    serving = True
    while True:
        await asyncio.sleep(0.5)
        if pool.any_healthy != serving:
            serving = pool.any_healthy
            await running.report("replicas", serving)
            log.warning("health_changed", serving=serving)


def build_embedding_cache(config: AdapterConfig) -> EmbeddingCache | None:
    budget, source = cache_budget(config.embed_cache_bytes, config.embed_cache_memory_share)
    if budget == 0:
        log.info("embedding_cache", enabled=False, source=source)
        return None
    try:
        cache = EmbeddingCache(budget, config.embedding_dimensions)
    except ValueError as exc:
        raise SystemExit(f"{ENV_PREFIX}EMBED_CACHE_BYTES / EMBED_CACHE_MEMORY_SHARE: {exc}") from exc
    log.info("embedding_cache", enabled=True, budget_bytes=budget, capacity_rows=cache.capacity_rows, source=source)
    return cache


def build_embedder(
    config: AdapterConfig, pool: ReplicaPool, supervisor: Supervisor
) -> tuple[EmbedBatcher, PooledEmbedBackend, CachedEmbedder] | None:
    if not config.triton_embedding_model:
        return None
    timeout = AdaptiveTimeout(config.embed_timeout_policy())
    metrics.REQUEST_TIMEOUT.labels(kind="embed_batch").set(timeout.current())
    backends = PooledEmbedBackend(pool, lambda url: TritonEmbedBackend(url, config.triton_embedding_model), timeout, dim=config.embedding_dimensions)
    embedder = EmbedBatcher(
        backends,
        max_batch=config.embed_max_batch,
        max_delay_s=config.embed_max_delay_s,
        max_waiting=config.embed_max_waiting,
        max_in_flight=config.embed_max_in_flight,
        dim=config.embedding_dimensions,
    )
    embedder.start(supervisor)
    front = CachedEmbedder(embedder, config.embedding_model_name, build_embedding_cache(config), embedder.max_texts_per_request)
    return embedder, backends, front


def concurrency_limit(config: AdapterConfig, protocol: Protocol) -> int:
    """What one replica runs at once of this model: its batch (step protocol) or its streams in flight."""
    return config.max_batch_size if protocol == "step" else config.max_in_flight


def prefix_router(config: AdapterConfig, protocol: Protocol) -> PrefixRouter | None:
    """Prefix-aware routing over the model's replicas, each remembering a few prompts per slot it runs."""
    if not config.prefix_routing:
        return None
    return PrefixRouter(concurrency_limit(config, protocol), config.prefix_routing_load_bound)


def extra_model_config(config: AdapterConfig, extra: ExtraModel) -> AdapterConfig:
    """The settings an extra generation model's pool runs with: the main model's, but its own
    Triton model and bound: its batch on the step protocol, its streams in flight on the generate
    one (a vLLM passthrough), whichever it turns out to speak (and a reserved interactive share that
    fits that bound). Its chat template, context length and max output tokens are the main model's:
    an extra model is a variant of it (the same tokenizer and template)."""
    return replace(
        config,
        model_name=extra.name,
        triton_model=extra.triton_model,
        max_batch_size=extra.max_batch_size,
        max_in_flight=extra.max_batch_size if extra.bounded else config.max_in_flight,
        interactive_reserved_slots=min(config.interactive_reserved_slots, extra.max_batch_size - 1),
        extra_models=(),
    )


async def start_extra_pool(
    config: AdapterConfig, discovery: Discovery, supervisor: Supervisor, info: types_pb2.ModelInfo | None = None
) -> ReplicaPool:
    """One extra generation model's pool, started once a replica serves it. Replica discovery
    (dns:/// names) adds and drains its replicas as it does the main model's: every replica is
    expected to serve every model; one that does not fails its probes and gets none of that model's work."""
    label = f"#{config.model_name}"
    urls, ready_url = await wait_for_a_ready_replica(config, discovery, label)
    protocol = await detect_protocol(ready_url, config.triton_model)
    if info is not None:
        info.logprobs = await reports_logprobs(ready_url, config.triton_model, protocol)
        info.token_prompts = takes_token_prompts(protocol)
        info.logit_bias = applies_logit_bias(protocol)
    step_timeouts = StepTimeouts(config.step_timeout_policy(), config.model_name)
    metrics.STEP_TIMEOUT.labels(model=config.model_name).set(step_timeouts.limit())
    backends, make_scheduler, make_backend = build_backends(config, protocol, urls, label, step_timeouts)
    CONCURRENCY_LIMIT.labels(model=config.model_name).set(concurrency_limit(config, protocol))
    pool = ReplicaPool(
        backends, make_scheduler, config.replica_failure_threshold, config.probe_interval_s, make_backend, metrics_label=label,  # type: ignore[arg-type]
        router=prefix_router(config, protocol), model=config.model_name, probe_token_interval_s=config.probe_token_interval_s,
        probe_timeout_s=probe_timeout_s(config),
    )  # fmt: skip
    await wait_for_a_healthy_replica(pool, config.backend_wait_s)
    pool.start(supervisor)
    log.info("extra_model_ready", model=config.model_name, triton_model=config.triton_model, protocol=protocol, max_batch_size=config.max_batch_size)
    return pool


def probe_timeout_s(config: AdapterConfig) -> float:
    """The pool's bound of one probe: the step timeout's ceiling, which bounds the probe's token at
    its backend, plus the ready checks before it."""
    return config.step_timeout_s + PROBE_MARGIN_S


def takes_token_prompts(protocol: str) -> bool:
    """Whether a model takes prompt_token_ids: the step protocol's engine prefills ids as given;
    Triton's vLLM backend takes only text_input (tests/fixtures/upstream/vllm_backend_interface.json)."""
    return protocol == "step"


def applies_logit_bias(protocol: str) -> bool:
    """Whether a model applies logit_bias: the step engine does; Triton's vLLM backend passes
    sampling_parameters' JSON to vLLM's SamplingParams as it is (vllm_backend_utils.py's from_dict
    converts only plain-typed fields), and vLLM then compares the object's string keys with token
    ids: every such request failed, on every replica."""
    return protocol == "step"


def model_info(config: AdapterConfig) -> types_pb2.ModelInfo:
    return types_pb2.ModelInfo(
        name=config.model_name,
        kind=types_pb2.MODEL_KIND_GENERATION,
        context_length=config.context_length,
        max_output_tokens=config.max_output_tokens,
        # Both ways of feeding Triton enforce them: the step engine and vLLM's structured_outputs.
        structured_outputs=True,
    )


async def serve(config: AdapterConfig) -> None:
    model = model_info(config)
    extra_configs = [extra_model_config(config, extra) for extra in config.extra_model_list()]
    embedding_model = (
        types_pb2.ModelInfo(
            name=config.embedding_model_name,
            kind=types_pb2.MODEL_KIND_EMBEDDING,
            embedding_dimensions=config.embedding_dimensions,
            context_length=config.embedding_context_length,
        )
        if config.triton_embedding_model
        else None
    )
    extra_infos = [model_info(c) for c in extra_configs]
    servicer = InferenceServicer(model, embedding_model, extra_infos)

    def register(server):  # type: ignore[no-untyped-def]
        inference_pb2_grpc.add_InferenceServiceServicer_to_server(servicer, server)
        return [SERVICE_NAME]

    # Health answers NOT_SERVING until a Triton replica has the model ready.
    running = await create_server(config.host, config.port, config.metrics_port, register, serving=False, tls=config.server_tls(ENV_PREFIX))
    running.supervisor.start("event-loop-lag", monitor_loop_lag)
    discovery = Discovery([parse_target(entry) for entry in config.triton_urls])
    urls, ready_url = await wait_for_a_ready_replica(config, discovery)
    protocol = await detect_protocol(ready_url, config.triton_model)
    # ListModels says which models report logprobs (the servicer holds these very messages).
    model.logprobs = await reports_logprobs(ready_url, config.triton_model, protocol)
    model.token_prompts = takes_token_prompts(protocol)
    model.logit_bias = applies_logit_bias(protocol)
    step_timeouts = StepTimeouts(config.step_timeout_policy(), config.model_name)
    metrics.STEP_TIMEOUT.labels(model=config.model_name).set(step_timeouts.limit())
    backends, make_scheduler, make_backend = build_backends(config, protocol, urls, step_timeouts=step_timeouts)
    CONCURRENCY_LIMIT.labels(model=config.model_name).set(concurrency_limit(config, protocol))
    pool = ReplicaPool(
        backends, make_scheduler, config.replica_failure_threshold, config.probe_interval_s, make_backend,  # type: ignore[arg-type]
        router=prefix_router(config, protocol), model=config.model_name, probe_token_interval_s=config.probe_token_interval_s,
        probe_timeout_s=probe_timeout_s(config),
    )  # fmt: skip
    await wait_for_a_healthy_replica(pool, config.backend_wait_s)
    # Every owner task is supervised: if one dies, health turns NOT_SERVING and its callers fail.
    supervisor = running.supervisor
    pool.start(supervisor)
    embedding = build_embedder(config, pool, supervisor)
    embedder = embedding[2] if embedding is not None else None
    extra_pools = {c.model_name: await start_extra_pool(c, discovery, supervisor, info) for c, info in zip(extra_configs, extra_infos)}
    servicer.attach(pool, embedder, extra_pools, step_timeouts if protocol == "step" else None)
    await running.set_serving(True)
    log.info("ready", replicas=sorted(pool.names), model=config.model_name, protocol=protocol)
    health_task = supervisor.start("health-from-replicas", lambda: report_health(pool, running))
    # Replicas of dns:/// names come and go with the addresses the names resolve to.
    discovery_task = (
        supervisor.start("replica-discovery", lambda: discovery.run([pool, *extra_pools.values()], config.triton_resolve_interval_s))
        if discovery.dynamic
        else None
    )

    async def on_stop() -> None:
        health_task.cancel()
        if discovery_task is not None:
            discovery_task.cancel()  # no replica joins while the pool stops
        if embedding is not None:
            await embedding[0].stop()
            await embedding[1].close()
        for extra_pool in extra_pools.values():
            await extra_pool.stop()
        await pool.stop()

    await serve_until_signal(running, config.shutdown_grace_s, on_stop)


def main() -> None:
    run_service("inference-adapter", AdapterConfig, ENV_PREFIX, serve)


if __name__ == "__main__":
    main()
