"""A step's rows reach llama_decode in slot order with small gaps filled (llamacpp_model.contiguous_plan):
the logits each row gets back are its own, whatever the rows' order, and a filled slot's cells are
as they were after the step."""

from __future__ import annotations

import numpy as np
import pytest

import llama_cpp as lc
from sluice_triton_local.engine.llamacpp_model import GAP_FILL_MAX, LlamaCppModel, contiguous_plan
from sluice_triton_local.engine.model import BatchItem
from sluice_triton_local.model_files import smollm2_gguf


def test_rows_are_ordered_by_slot() -> None:
    order, fillers = contiguous_plan([5, 2, 3, 4])
    assert order == [1, 2, 3, 0]
    assert fillers == []


def test_small_gaps_are_filled_and_large_ones_left_to_their_own_ubatch() -> None:
    _, fillers = contiguous_plan([0, 2, 5, 6, 20])
    assert fillers == [1, 3, 4]  # 6 -> 20 is wider than GAP_FILL_MAX: a pass over the weights is cheaper
    _, fillers = contiguous_plan([0, GAP_FILL_MAX + 1])
    assert fillers == list(range(1, GAP_FILL_MAX + 1))
    _, fillers = contiguous_plan([0, GAP_FILL_MAX + 2])
    assert fillers == []


PROMPTS = [[1, 504, 3458, 282, 253, 1345, 28], [1, 339, 1176, 314, 260, 3458, 30, 216], [1, 1032, 17, 1035, 253, 1345, 28]]


@pytest.fixture(scope="module")
def model() -> LlamaCppModel:
    m = LlamaCppModel(str(smollm2_gguf()), max_slots=6, max_context=256, threads=2)
    yield m
    m.close()


def _prefill(model: LlamaCppModel, slots: list[int]) -> None:
    model.forward([BatchItem(slot, PROMPTS[i % len(PROMPTS)], 0) for i, slot in enumerate(slots)])


def _decode(model: LlamaCppModel, rows: list[tuple[int, int]]) -> np.ndarray:
    """One token for each (slot, token), after the cells the slot holds."""
    memory = lc.llama_get_memory(model._ctx)
    return model.forward([BatchItem(slot, [token], lc.llama_memory_seq_pos_max(memory, slot) + 1) for slot, token in rows])


def test_each_row_gets_its_own_logits_whatever_the_order(model: LlamaCppModel) -> None:
    slots = [0, 1, 2]
    for slot in slots:
        model.release(slot)
    _prefill(model, slots)
    in_order = _decode(model, [(0, 42), (1, 43), (2, 44)])
    for slot in slots:
        model.truncate(slot, len(PROMPTS[slot]))
    reversed_rows = _decode(model, [(2, 44), (1, 43), (0, 42)])
    assert [int(np.argmax(r)) for r in reversed_rows] == [int(np.argmax(r)) for r in in_order[::-1]]
    np.testing.assert_allclose(reversed_rows, in_order[::-1], rtol=0, atol=1e-4)
    assert not np.allclose(in_order[0], in_order[1])  # the rows differ: a mix-up would show


def test_a_filled_gap_slot_keeps_its_cells(model: LlamaCppModel) -> None:
    for slot in range(6):
        model.release(slot)
    _prefill(model, [0, 1, 3])  # slot 1 will sit in the gap between 0 and 3, holding a prefix
    memory = lc.llama_get_memory(model._ctx)
    held = lc.llama_memory_seq_pos_max(memory, 1)
    before = _decode(model, [(1, 42)])  # what slot 1 answers next, alone
    model.truncate(1, held + 1)
    _decode(model, [(3, 43), (0, 42)])  # slots 0 and 3: 1 and 2 are filled
    assert lc.llama_memory_seq_pos_max(memory, 1) == held
    assert lc.llama_memory_seq_pos_max(memory, 2) == -1
    after = _decode(model, [(1, 42)])
    np.testing.assert_allclose(after, before, rtol=0, atol=1e-4)
