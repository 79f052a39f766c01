"""SLUICE_ADAPTER_EXTRA_MODELS entries: more generation models on the same Triton replicas.

Apart from config.py, which holds the one settings dataclass (deploy/tests reads its fields)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExtraModel:
    """One more generation model: the name clients use, the Triton model, its batch bound."""

    name: str
    triton_model: str
    max_batch_size: int
    # Whether the entry set the bound (":N"): then it bounds a passthrough model's streams too.
    bounded: bool = False


def parse_extra_model(entry: str, default_batch: int) -> ExtraModel:
    """`name=triton_model` or `name=triton_model:max_batch_size`."""
    name, sep, rest = entry.partition("=")
    triton_model, _, batch = rest.partition(":")
    if not sep or not name.strip() or not triton_model.strip():
        raise ValueError(f"{entry!r}: expected name=triton_model or name=triton_model:max_batch_size")
    try:
        size = int(batch) if batch.strip() else default_batch
    except ValueError:
        raise ValueError(f"{entry!r}: the max batch size after ':' must be a whole number") from None
    if size < 1:
        raise ValueError(f"{entry!r}: the max batch size must be >= 1")
    return ExtraModel(name.strip(), triton_model.strip(), size, bounded=bool(batch.strip()))
