"""Pure-numpy continuous-batching inference engine for llama-architecture GGUF models."""

from sluice_common.sampling import Sampling, StructuredOutputs, StructuredOutputsError

from .step_engine import StepEngine

from .rows import DecodeRow, PrefillRow, ReleaseRow, Row, RowResult

__all__ = [
    "DecodeRow",
    "PrefillRow",
    "ReleaseRow",
    "Row",
    "RowResult",
    "Sampling",
    "StepEngine",
    "StructuredOutputs",
    "StructuredOutputsError",
]
