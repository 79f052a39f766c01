"""What the gateway and its job-worker role both hold: tenants, the adapter, admission, events."""

from __future__ import annotations

import asyncio
import functools
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sluice.inference.v1 import inference_pb2_grpc
from sluice.ratelimit.v1 import ratelimit_pb2_grpc

from sluice_common.channels import open_channel
from sluice_common.supervision import Supervisor
from sluice_gateway.path.admission import Admission
from sluice_gateway.path.completion_events import CompletionEvents
from sluice_gateway.config import ENV_PREFIX, SharedSettings
from sluice_gateway.path.default_deadline import DefaultDeadline
from sluice_gateway.path.inference_path import InferencePath
from sluice_gateway.path.model_catalog import ModelCatalog
from sluice_common.tenants import TenantDirectory


@dataclass
class GatewayCore:
    tenants: TenantDirectory
    channel: Any
    adapter: inference_pb2_grpc.InferenceServiceStub
    models: ModelCatalog
    completion_events: CompletionEvents
    admission: Admission
    ratelimit_channel: Any
    default_max_tokens: int
    # Held here, not by the path: every front's requests feed one set of rolling p99s.
    default_deadline: DefaultDeadline | None = None

    @functools.cached_property
    def path(self) -> InferencePath:
        """The one path every front (gRPC, HTTP, job worker) sends its requests through, built once."""
        return InferencePath(
            self.adapter, self.models, self.admission, self.completion_events, self.default_max_tokens, self.default_deadline,
            self.channel,
        )  # fmt: skip

    @classmethod
    def build(cls, config: SharedSettings, spill_port: int) -> GatewayCore:
        try:
            tenants = TenantDirectory.from_file(config.tenants_file)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"gateway: cannot load {ENV_PREFIX}TENANTS_FILE: {exc}") from None
        channel = open_channel(config.adapter_url, config.adapter_tls.for_channel())
        adapter = inference_pb2_grpc.InferenceServiceStub(channel)
        spill_file = Path(config.events_spill_file or Path(tempfile.gettempdir()) / f"sluice-gateway-{spill_port}-events.spill")
        completion_events = CompletionEvents.create(
            config.amqp_url, config.amqp_prefix, config.events_outbox_size, config.events_max_in_flight, spill_file
        )
        ratelimit_channel = open_channel(config.ratelimit_url, config.ratelimit_tls.for_channel()) if config.ratelimit_url else None
        admission = Admission(
            ratelimit_pb2_grpc.RateLimitServiceStub(ratelimit_channel) if ratelimit_channel else None,
            config.ratelimit_policy,
            config.ratelimit_timeout_s,
            config.ratelimit_lease_ttl_s,
        )
        return cls(
            tenants,
            channel,
            adapter,
            ModelCatalog(adapter),
            completion_events,
            admission,
            ratelimit_channel,
            config.default_max_tokens,
            DefaultDeadline(config.default_deadline_policy()),
        )

    async def start(self, config: SharedSettings, supervisor: Supervisor) -> None:
        await self.models.wait_first_load(config.adapter_wait_s)
        self.models.start_refreshing(config.models_refresh_s, supervisor)
        self.completion_events.start(supervisor)

    async def close(self, flush_s: float) -> None:
        """The events and lease commits still owed, side by side within `flush_s` (then the events
        are spilled), then the channels."""
        await asyncio.gather(self.completion_events.stop(flush_s), self.admission.drain(flush_s))
        if self.ratelimit_channel is not None:
            await self.ratelimit_channel.close()
        await self.models.stop()
        await self.channel.close()
