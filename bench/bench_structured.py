"""`make bench-structured`: the step engine's constrained decoding (llguidance) against free generation.

Runs bench/engine/structured.py in triton-local's environment (its docstring says
what is measured and how) over the schemas in fixtures/structured_schemas.json: nested objects, arrays,
enums, anyOf, numbers with bounds, strings with patterns, each with a prompt. Prints, side by side from
one run:

  BENCH structured_vs_free_batch1 / _batch8   tokens/s with a nested JSON schema as the constraint
                                              over tokens/s of the same prompts unconstrained, for
                                              the same number of tokens (target >= 0.9 at batch 8)
  BENCH structured_compile_ms                 p50 over the schemas of compiling one against the
                                              model's vocabulary (and making its first matcher)
  BENCH structured_valid_fraction             greedy outputs that finish "stop", parse and validate
                                              against their schema (target 1.0); the sampled ones
                                              (temperature 1) are printed too

BENCH_THREADS sets the engine's threads (default: this machine's cores), BENCH_ROUNDS the rounds
(default 2).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from sluice_stack import REPO_ROOT

THREADS = int(os.environ.get("BENCH_THREADS", str(os.cpu_count() or 1)))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "2"))
PYTHON = REPO_ROOT / "services" / "triton-local" / ".venv" / "bin" / "python"
SCHEMAS = Path(__file__).resolve().parent / "fixtures" / "structured_schemas.json"


def measure() -> dict[str, Any]:
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS=str(THREADS))
    command = [str(PYTHON), str(REPO_ROOT / "bench" / "engine" / "structured.py"), str(SCHEMAS), str(THREADS), str(ROUNDS)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench_lines(result: dict[str, Any]) -> list[str]:
    greedy, sampled = result["valid_greedy"], result["valid_sampled"]
    lines = []
    for batch in ("batch1", "batch8"):
        side = result[batch]
        target = " (target >= 0.9)" if batch == "batch8" else ""
        lines.append(f"BENCH structured_vs_free_{batch} {side['structured_tok_s'] / side['free_tok_s']:.2f} x{target}")
    lines.append(f"BENCH structured_compile_ms {result['compile_ms_p50']:.2f} ms (p50 over {result['schemas']} schemas)")
    lines.append(f"BENCH structured_valid_fraction {sum(greedy) / len(greedy):.2f} (greedy, {len(greedy)} schemas; target 1.0)")
    lines.append(f"BENCH structured_valid_fraction_sampled {sum(sampled) / len(sampled):.2f} (temperature 1)")
    return lines


def main() -> int:
    print(f"structured vs free: {THREADS} threads, {ROUNDS} rounds, schemas from {SCHEMAS.name} ...", flush=True)
    result = measure()
    print(f"\n{'batch':>5} | {'structured tok/s':>16} | {'free tok/s':>10} | {'tokens s/f':>11} | mask share of time")
    for batch in ("batch1", "batch8"):
        side = result[batch]
        tokens = f"{side['structured_tokens']}/{side['free_tokens']}"
        print(f"{batch[5:]:>5} | {side['structured_tok_s']:>16.1f} | {side['free_tok_s']:>10.1f} | {tokens:>11} | {side['mask_share']:.1%}")
    print(
        f"\nllguidance tokenizer from the GGUF vocabulary: {result['tokenizer_build_ms']:.0f} ms (once per engine);"
        f" compile p50 {result['compile_ms_p50']:.2f} ms, max {result['compile_ms_max']:.2f} ms;"
        f" mask computed and applied: {result['mask_ms_per_token']:.3f} ms per constrained token"
        f" ({result['mask_ms_per_token_sampled']:.3f} ms sampled)"
    )
    for example in result["examples"]:
        print(f"  {example['name']}: {example['greedy']}")
    for bad in result["invalid"]:
        print(f"  INVALID {bad['name']} ({bad['mode']}, finish {bad['finish']}): {bad['text']}")
    print("\n".join(bench_lines(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
