"""A request's class: interactive before bulk, in the waiting queue and in embedding batches alike."""

from __future__ import annotations

import enum


class Priority(enum.IntEnum):
    INTERACTIVE = 0
    BULK = 1
