"""Pure-numpy continuous-batching inference engine for llama-architecture GGUF models."""

from .step_engine import (
    DecodeRow,
    PrefillRow,
    ReleaseRow,
    Row,
    RowResult,
    SamplingParams,
    StepEngine,
)

__all__ = [
    "DecodeRow",
    "PrefillRow",
    "ReleaseRow",
    "Row",
    "RowResult",
    "SamplingParams",
    "StepEngine",
]
