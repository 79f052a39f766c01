"""A step's rows reach llama_decode in slot order with small gaps filled (llamacpp_model.contiguous_plan):
the logits each row gets back are its own, whatever the rows' order, and a filled slot's cells are
as they were after the step."""

from __future__ import annotations

import numpy as np
import pytest

import llama_cpp as lc
from sluice_triton_local.engine.llamacpp_model import GAP_FILL_MAX, LlamaCppModel, contiguous_plan, long_item_pieces, ubatch_rows
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


def test_ubatch_rows_take_the_same_share_of_each_sequence_in_a_run_of_consecutive_ids() -> None:
    """llama_batch_allocr::split_equal over a non-unified KV cache, as llama.cpp cuts a batch."""

    def rows(lengths: dict[int, int], ubatch: int = 512) -> list[list[int]]:
        seq_ids = np.concatenate([np.full(n, seq, dtype=np.int32) for seq, n in lengths.items()])
        got = ubatch_rows(seq_ids, ubatch).tolist()
        out, first = [], 0
        for n in lengths.values():
            out.append(got[first : first + n])
            first += n
        return out

    # A prompt beside a decode row: one row of each, then the prompt's other rows alone.
    assert rows({0: 1, 1: 64}) == [[1], [1] + [63] * 63]
    assert rows({0: 1, 1: 100, 2: 1}) == [[1], [1] + [99] * 99, [1]]
    # Not consecutive: a run each.
    assert rows({0: 1, 2: 100}) == [[1], [100] * 100]
    # Two prompts: the shorter one's length from each, then the rest of the longer.
    assert rows({3: 70, 4: 100}) == [[70] * 70, [70] * 70 + [30] * 30]
    # Six prompts of 100: 512 // 6 = 85 rows of each, then their last 15.
    assert rows({s: 100 for s in range(6)}) == [[85] * 85 + [15] * 15] * 6
    # One sequence longer than a ubatch.
    assert rows({5: 530}) == [[512] * 512 + [18] * 18]
    assert long_item_pieces(530, 512, 64) == [466, 64]
    assert long_item_pieces(1024, 512, 64) == [512, 512]
    assert long_item_pieces(1030, 512, 64) == [512, 454, 64]
    assert long_item_pieces(100, 64, 64) == [64, 36]  # a ubatch under two tiles: as llama.cpp would


def test_the_rows_that_ran_attentions_tiled_kernel_are_recorded(model: LlamaCppModel) -> None:
    """A prompt of 64+ tokens prefilled beside a decode row runs as 1 + the rest (ubatch_rows): 64
    tokens run row by row (their logits differ from the prompt's alone), 100 run tiled but for
    their first row, which at position 0 attends to itself alone: computed alike, the logits are
    those of the prompt alone."""
    rng = np.random.default_rng(5)
    p64, p100 = ([int(t) for t in rng.integers(200, 40000, n)] for n in (64, 100))
    for slot in range(6):
        model.release(slot)
    _prefill(model, [0])
    held = len(PROMPTS[0])
    alone = {}
    for prompt in (p64, p100):
        model.release(1)
        alone[len(prompt)] = model.forward([BatchItem(1, prompt, 0)])[0].copy()
        assert model.last_tiled == [[True] * len(prompt)]
    model.release(1)
    beside = model.forward([BatchItem(0, [42], held), BatchItem(1, p64, 0)])[1]
    assert model.last_tiled == [[False], [False] * 64]
    assert not np.array_equal(beside, alone[64])
    model.truncate(0, held)
    model.release(1)
    beside = model.forward([BatchItem(1, p100, 0), BatchItem(0, [42], held)])[0]
    assert model.last_tiled == [[False] + [True] * 99, [False]]
    assert np.array_equal(beside, alone[100])
    # Short items: row by row, alone or not.
    model.truncate(0, held)
    model.forward([BatchItem(0, [42], held), BatchItem(2, p64[:10], 0)])
    assert model.last_tiled == [[False], [False] * 10]


def test_a_prompt_longer_than_a_ubatch_computes_what_a_prefill_reusing_its_prefix_does() -> None:
    """llama.cpp cut a 530-token prompt into ubatches of 512 + 18, its last 18 rows computed row by
    row, while a prefill reusing 466 of its cells computes its 64 tiled: their logits differed by
    0.36, and the prefix cache took them for the same. forward cuts it into 466 + 64 itself."""
    model = LlamaCppModel(str(smollm2_gguf()), max_slots=3, max_context=1024, threads=2)
    try:
        rng = np.random.default_rng(6)
        prompt = [int(t) for t in rng.integers(200, 40000, 530)]
        cold = model.forward([BatchItem(1, prompt, 0)])[0].copy()
        assert model.last_tiled == [[True] * 530]
        for reused in (466, 400):
            model.truncate(1, reused)
            warm = model.forward([BatchItem(1, prompt[reused:], reused)])[0]
            assert np.array_equal(warm, cold), reused
        # Beside a decode row: the long prompt goes alone, in the same pieces, and the row after it.
        model.release(1)
        model.forward([BatchItem(0, PROMPTS[0], 0)])
        both = model.forward([BatchItem(0, [42], len(PROMPTS[0])), BatchItem(1, prompt, 0)])
        assert model.last_tiled == [[False], [True] * 530]
        assert np.array_equal(both[1], cold)
        assert lc.llama_memory_seq_pos_max(lc.llama_get_memory(model._ctx), 1) == 529  # noqa: SLF001
    finally:
        model.close()
