"""bench-engine's measuring side (vs_llamacpp.py) counts the tokens its rows really produced: a row answered busy
or error did no work, and a sequence that stopped early is stepped no more."""

from __future__ import annotations

import vs_llamacpp as bench
from sluice_triton_local.engine.rows import DecodeRow, PrefillRow, ReleaseRow, RowResult

PROMPT_TOKENS = 10
PROMPT_IDS = tuple(range(1, PROMPT_TOKENS + 1))


class EarlyStopEngine:
    """Three sequences: 0 decodes to the end, 1 stops (EOS) at its 3rd decode step, 2 finds no
    free slot at prefill ("busy"). Decode rows of sequences not running answer an error, as
    StepEngine does."""

    def __init__(self) -> None:
        self.running: set[int] = set()
        self.decoded: dict[int, int] = {}
        self.decode_rows = 0
        self.prompts: list[object] = []

    def apply_chat_template(self, messages: list[tuple[str, str]]) -> str:
        return "prompt"

    def step(self, rows: list) -> list[RowResult]:
        return [self._answer(row) for row in rows]

    def _answer(self, row: object) -> RowResult:
        if isinstance(row, PrefillRow):
            self.prompts.append(row.prompt)
            if row.seq_id == 2:
                return RowResult(2, -1, "", "busy", 0, 0, "no free slot")
            self.running.add(row.seq_id)
            self.decoded[row.seq_id] = 0
            return RowResult(row.seq_id, 100, "a", "", PROMPT_TOKENS, 1)
        if isinstance(row, ReleaseRow):
            self.running.discard(row.seq_id)
            return RowResult(row.seq_id, -1, "", "", 0, 0)
        assert isinstance(row, DecodeRow)
        self.decode_rows += 1
        if row.seq_id not in self.running:
            return RowResult(row.seq_id, -1, "", "error", 0, 0, "not running")
        self.decoded[row.seq_id] += 1
        count = self.decoded[row.seq_id]
        finish = "stop" if row.seq_id == 1 and count == 3 else ("length" if count >= bench.DECODE_STEPS else "")
        if finish:
            self.running.discard(row.seq_id)
        return RowResult(row.seq_id, 100 + count, "b", finish, PROMPT_TOKENS, count + 1)


def test_only_rows_that_did_work_are_counted() -> None:
    engine = EarlyStopEngine()
    figures = bench.engine_run(engine, batch=3, prompt=PROMPT_IDS)  # type: ignore[arg-type]
    # Two prompts cached (the busy row cached none); sequence 0's DECODE_STEPS tokens and 1's three.
    assert figures["prefilled_tokens"] == 2 * PROMPT_TOKENS
    assert figures["decoded_tokens"] == bench.DECODE_STEPS + 3
    # Sequences that ended (or never started) were not stepped again.
    assert engine.decode_rows == bench.DECODE_STEPS + 3
    assert figures["tokens"] == [100, *range(101, 101 + bench.DECODE_STEPS)]


def test_the_engine_is_given_token_ids_as_llama_cpp_is() -> None:
    """The prompt is tokenized before either clock: the engine's prefill rows carry the ids, so its
    prefill clock does not run around its tokenizer while llama.cpp's side gets ids made beforehand."""
    engine = EarlyStopEngine()
    bench.engine_run(engine, batch=3, prompt=PROMPT_IDS)  # type: ignore[arg-type]
    assert engine.prompts == [PROMPT_IDS] * 3


def test_counting_helpers() -> None:
    results = [
        RowResult(0, 5, "x", "", 12, 1),
        RowResult(1, 6, "y", "stop", 12, 1),
        RowResult(2, -1, "", "busy", 0, 0, "no free slot"),
        RowResult(3, -1, "", "error", 12, 0, "bad row"),
    ]
    assert bench.prefilled_tokens(results) == 24
    assert bench.decoded_tokens(results) == 2


def test_llama_cpp_alone_runs_a_batch_and_reports_its_figures() -> None:
    """The baseline side itself, on the real GGUF: it loads through triton-local's llama.cpp setup (an
    import left relative when the benchmark moved out of the engine package broke `make bench-engine`)."""
    alone = bench.LlamaCppAlone([1, 2, 3, 4, 5, 6, 7, 8], threads=2)
    figures = alone.run(2)
    assert figures["prefill_tok_s"] > 0 and figures["decode_tok_s"] > 0
    assert len(figures["tokens"]) == bench.DECODE_STEPS + 1
