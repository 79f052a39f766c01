"""The process's one engine, shared by the step model and the self-batching generate model."""

from __future__ import annotations

import threading
import time

from sluice_triton_local import metrics
from sluice_triton_local.engine.step_engine import Row, RowResult, StepEngine


class SharedEngine:
    """Serializes steps (the KV slots are not thread-safe) and records the model metrics."""

    def __init__(self, engine: StepEngine) -> None:
        self._engine = engine
        self._lock = threading.Lock()

    @property
    def context_length(self) -> int:
        return self._engine.context_length

    def count_tokens(self, text: str) -> int:
        return self._engine.count_tokens(text)

    def apply_chat_template(self, messages: list[tuple[str, str]]) -> str:
        return self._engine.apply_chat_template(messages)

    def step(self, rows: list[Row]) -> list[RowResult]:
        with self._lock:
            started = time.perf_counter()
            before = self._engine.tokens_generated_total
            results = self._engine.step(rows)
            metrics.TOKENS_GENERATED.inc(self._engine.tokens_generated_total - before)
            metrics.ACTIVE_SLOTS.set(self._engine.active_slots)
            metrics.STEP_ROWS.observe(len(rows))
            metrics.STEP_SECONDS.observe(time.perf_counter() - started)
        return results
