"""Pure-numpy continuous-batching inference engine for llama-architecture GGUF models."""

from sluice_common.sampling import Sampling

from .constraints import Constraint, ConstraintError
from .step_engine import (
    DecodeRow,
    PrefillRow,
    ReleaseRow,
    Row,
    RowResult,
    StepEngine,
)

__all__ = [
    "Constraint",
    "ConstraintError",
    "DecodeRow",
    "PrefillRow",
    "ReleaseRow",
    "Row",
    "RowResult",
    "Sampling",
    "StepEngine",
]
