"""The measuring side of `make bench-engine` (bench/bench_engine.py), run in triton-local's environment:

  services/triton-local/.venv/bin/python bench/engine/vs_llamacpp.py THREADS ROUNDS BATCH [BATCH ...]
  services/triton-local/.venv/bin/python bench/engine/vs_llamacpp.py --numpy THREADS BATCH [BATCH ...]

Two sides, each with a llama.cpp context of its own on the same GGUF and thread count:

  engine    triton-local's StepEngine: step rows, KV slot bookkeeping, sampling, stop handling
            and incremental detokenization around llama.cpp's forward pass (the prompt's
            tokenization is outside both clocks)
  llamacpp  llama.cpp through its C API alone, as its `batched` example drives it: one
            llama_decode of every prompt, then one llama_decode per step with one token per
            sequence, llama.cpp's own greedy sampler, and a context sized for the batch alone
            (n_seq_max = the batch), with whichever KV layout (unified or per sequence) is faster

For each batch size the two alternate ROUNDS times (engine first, then llama.cpp, then the other
way round), each side's best kept, so that this shared machine's drift hits both alike. Prefill:
the batch's prompts in one step, clock around it. Decode: DECODE_STEPS greedy steps after it.
Both start from the same prompt token ids, tokenized once before either clock: the engine's prefill
rows carry the ids (a PrefillRow takes a tuple of them), not the text (until 2026-12-07 the engine
side's prefill clock also ran around its tokenizer). `--numpy` measures the engine on its numpy forward
pass instead (a reference; BLAS threads are fixed when numpy is imported, so a process of its own).
Prints one JSON line.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from sluice_common.sampling import Sampling
from sluice_triton_local.engine.step_engine import StepEngine
from sluice_triton_local.engine.rows import DecodeRow, PrefillRow, ReleaseRow, RowResult
from sluice_triton_local.model_files import gguf_path

DECODE_STEPS = 48
PROMPT = "Write a long story about a dragon and a knight who become friends after a long war."

Figures = dict[str, Any]  # prefill_tok_s, decode_tok_s, tokens (sequence 0's)


def prefilled_tokens(results: list[RowResult]) -> int:
    """Prompt tokens cached by the prefill rows that took a slot: a row answered busy (no free
    slot) or error did no work and counts nothing."""
    return sum(r.prompt_tokens for r in results if r.finish_reason not in ("busy", "error"))


def decoded_tokens(results: list[RowResult]) -> int:
    """Tokens a decode step produced: rows that answered no token (an error) did no work."""
    return sum(1 for r in results if r.token_id >= 0 and r.finish_reason != "error")


def prompt_ids(engine: StepEngine) -> tuple[int, ...]:
    """PROMPT in the chat template, tokenized: what both sides prefill."""
    return tuple(engine.tokenizer.encode(engine.apply_chat_template([("user", PROMPT)])))


def engine_run(engine: StepEngine, batch: int, prompt: tuple[int, ...]) -> Figures:
    """The batch's prompts (`prompt`'s token ids, tokenized before the clock as llama.cpp's side's
    are) in one step, then up to DECODE_STEPS greedy steps of the sequences still running; tokens
    per second count only the rows that did work (a sequence that stopped early is stepped no more)."""
    params = Sampling(max_tokens=DECODE_STEPS + 1, temperature=0.0)
    seqs = list(range(batch))
    started = time.perf_counter()
    first = engine.step([PrefillRow(s, prompt, params) for s in seqs])
    prefill_s = time.perf_counter() - started
    prefilled = prefilled_tokens(first)
    running = [r.seq_id for r in first if r.token_id >= 0 and not r.finish_reason]
    tokens = [first[0].token_id]
    decoded = 0
    started = time.perf_counter()
    for _ in range(DECODE_STEPS):
        if not running:
            break
        results = engine.step([DecodeRow(s) for s in running])
        decoded += decoded_tokens(results)
        tokens += [r.token_id for r in results if r.seq_id == 0 and r.token_id >= 0]
        running = [r.seq_id for r in results if r.token_id >= 0 and not r.finish_reason]
    decode_s = time.perf_counter() - started
    engine.step([ReleaseRow(s) for s in seqs])
    return {
        "prefill_tok_s": prefilled / prefill_s,
        "decode_tok_s": decoded / decode_s if decode_s > 0 else 0.0,
        "prefilled_tokens": prefilled,
        "decoded_tokens": decoded,
        "tokens": tokens,
    }


class LlamaCppAlone:
    def __init__(self, ids: list[int], threads: int) -> None:
        import llama_cpp as lc

        from sluice_triton_local.engine.llamacpp_model import init_backend_once

        init_backend_once()
        self.lc, self.ids, self.threads = lc, ids, threads
        self.model = lc.llama_model_load_from_file(gguf_path().encode(), lc.llama_model_default_params())

    def run(self, batch: int) -> Figures:
        """The faster KV layout for prefill and decode alike; the tokens of the per-sequence one,
        the engine's (a unified cache rounds differently after a few dozen tokens)."""
        unified, per_sequence = (self._context_run(batch, u) for u in (True, False))
        return {
            "prefill_tok_s": max(unified["prefill_tok_s"], per_sequence["prefill_tok_s"]),
            "decode_tok_s": max(unified["decode_tok_s"], per_sequence["decode_tok_s"]),
            "tokens": per_sequence["tokens"],
        }

    def _context_run(self, batch: int, unified: bool) -> Figures:
        from sluice_triton_local.engine.llamacpp_model import context_params

        lc = self.lc
        params = context_params(batch, 1024, max(2048, batch * len(self.ids)), self.threads, unified=unified)
        ctx = lc.llama_init_from_model(self.model, params)
        sampler = lc.llama_sampler_init_greedy()
        try:
            return self._decode(ctx, sampler, batch)
        finally:
            lc.llama_sampler_free(sampler)
            lc.llama_free(ctx)

    def _decode(self, ctx: Any, sampler: Any, batch: int) -> Figures:
        lc, ids = self.lc, self.ids
        n_prompt = len(ids)
        prompts = lc.llama_batch_init(batch * n_prompt, 0, 1)
        for s in range(batch):
            for j, token in enumerate(ids):
                k = s * n_prompt + j
                prompts.token[k], prompts.pos[k], prompts.n_seq_id[k] = token, j, 1
                prompts.seq_id[k][0] = s
                prompts.logits[k] = j == n_prompt - 1
        prompts.n_tokens = batch * n_prompt
        started = time.perf_counter()
        if lc.llama_decode(ctx, prompts) != 0:
            raise RuntimeError("llama_decode failed on the prompts")
        last = [lc.llama_sampler_sample(sampler, ctx, s * n_prompt + n_prompt - 1) for s in range(batch)]
        prefill_s = time.perf_counter() - started
        lc.llama_batch_free(prompts)
        tokens = [last[0]]
        step = lc.llama_batch_init(batch, 0, 1)
        started = time.perf_counter()
        for i in range(DECODE_STEPS):
            for s in range(batch):
                step.token[s], step.pos[s], step.n_seq_id[s], step.logits[s] = last[s], n_prompt + i, 1, 1
                step.seq_id[s][0] = s
            step.n_tokens = batch
            if lc.llama_decode(ctx, step) != 0:
                raise RuntimeError("llama_decode failed on a step")
            last = [lc.llama_sampler_sample(sampler, ctx, s) for s in range(batch)]
            tokens.append(last[0])
        decode_s = time.perf_counter() - started
        lc.llama_batch_free(step)
        return {"prefill_tok_s": batch * n_prompt / prefill_s, "decode_tok_s": batch * DECODE_STEPS / decode_s, "tokens": tokens}


def best(runs: list[Figures]) -> Figures:
    return {
        "prefill_tok_s": max(r["prefill_tok_s"] for r in runs),
        "decode_tok_s": max(r["decode_tok_s"] for r in runs),
        "tokens": runs[0]["tokens"],
        "same_tokens_every_run": all(r["tokens"] == runs[0]["tokens"] for r in runs),
    }


def compare(threads: int, rounds: int, batches: list[int]) -> dict[str, Any]:
    # No prefix cache: every run prefills the same prompt, which the cache would serve from the first run on.
    engine = StepEngine(gguf_path(), max_slots=max(batches), max_context=1024, engine="llamacpp", threads=threads, prefix_cache=False)
    ids = prompt_ids(engine)
    alone = LlamaCppAlone(list(ids), threads)
    engine_run(engine, 1, ids), alone.run(1)  # warm both up
    out: dict[str, Any] = {"prompt_tokens": len(ids), "engine": {}, "llamacpp": {}}
    for batch in batches:
        runs: dict[str, list[Figures]] = {"engine": [], "llamacpp": []}
        for r in range(rounds):
            order = ("engine", "llamacpp") if r % 2 == 0 else ("llamacpp", "engine")
            for side in order:
                runs[side].append(engine_run(engine, batch, ids) if side == "engine" else alone.run(batch))
        for side, side_runs in runs.items():
            out[side][str(batch)] = best(side_runs)
    return out


def numpy_reference(threads: int, batches: list[int]) -> dict[str, Any]:
    engine = StepEngine(gguf_path(), max_slots=max(batches), max_context=1024, engine="numpy", threads=threads, prefix_cache=False)
    ids = prompt_ids(engine)
    engine_run(engine, 1, ids)
    return {"numpy": {str(b): best([engine_run(engine, b, ids)]) for b in batches}}


def main(argv: list[str]) -> None:
    if argv[0] == "--numpy":
        result = numpy_reference(int(argv[1]), [int(b) for b in argv[2:]])
    else:
        result = compare(int(argv[0]), int(argv[1]), [int(b) for b in argv[2:]])
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
