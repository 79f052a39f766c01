"""The measuring side of `make bench-structured`, run in triton-local's environment:

  python bench/engine/structured.py SCHEMAS_JSON THREADS ROUNDS   (triton-local's environment)

SCHEMAS_JSON: a list of {"name", "prompt", "schema"}. One StepEngine (llama.cpp forward pass, no prefix
cache, so that no side reuses the other's prompts) measures:

  compile     each schema compiled against the vocabulary by a fresh compiler (nothing cached) and
              its first matcher made: what a request waits before its first step
  throughput  at batch 1 (the first BATCH1_SCHEMAS schemas) and batch 8 (all of them): the prompts
              in waves of the batch size, each wave prefilled in one step and decoded greedily until
              every row ends, once with the schema as the rows' constraint ("structured") and once
              without, each row's max_tokens set to the number of tokens its structured twin
              generated ("free": the same prompts, the same lengths unless the model ends earlier,
              which the figures show). Each wave's two runs back to back, which one first in turns,
              ROUNDS times; tokens/s over all of them.
  validity    every greedy structured output (batch 8) and one sampled one per schema (temperature
              1, seeded): finished "stop", parses as JSON, validates against its schema (jsonschema)
  masks       the engine's own count of time spent computing and applying masks, per masked token

Prints one JSON line.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass, replace
from typing import Any

from sluice_common.sampling import Sampling
from sluice_common.sampling import StructuredOutputs
from sluice_triton_local.engine.constraints import ConstraintCompiler
from sluice_triton_local.engine.step_engine import StepEngine
from sluice_triton_local.engine.rows import DecodeRow, PrefillRow, RowResult
from sluice_triton_local.model_files import gguf_path

BATCHES = (1, 8)
BATCH1_SCHEMAS = 8  # batch 1 decodes one row at a time: a subset keeps the run short
MAX_TOKENS = 200


@dataclass(frozen=True)
class Job:
    prompt: tuple[int, ...]
    params: Sampling
    constraint: StructuredOutputs | None


@dataclass(frozen=True)
class Output:
    text: str
    finish: str
    tokens: int


def run_waves(engine: StepEngine, jobs: list[Job], batch: int) -> tuple[list[Output], float]:
    """Runs the jobs `batch` at a time (a wave ends when all its rows have); outputs and seconds."""
    outputs: list[Output] = []
    started = time.perf_counter()
    for first in range(0, len(jobs), batch):
        wave = jobs[first : first + batch]
        results: dict[int, list[RowResult]] = {i: [] for i in range(len(wave))}
        step = engine.step([PrefillRow(i, job.prompt, replace(job.params, structured_outputs=job.constraint)) for i, job in enumerate(wave)])
        while True:
            for r in step:
                if r.finish_reason == "error":
                    raise RuntimeError(f"row {r.seq_id} failed: {r.error}")
                results[r.seq_id].append(r)
            live = [i for i, rs in results.items() if not rs[-1].finish_reason]
            if not live:
                break
            step = engine.step([DecodeRow(i) for i in live])
        outputs += [Output("".join(r.text for r in rs), rs[-1].finish_reason, rs[-1].completion_tokens) for rs in results.values()]
    return outputs, time.perf_counter() - started


def compile_times(engine: StepEngine, schemas: list[dict[str, Any]]) -> list[float]:
    compiler = ConstraintCompiler(engine.tokenizer)  # its own cache, empty
    times = []
    for entry in schemas:
        started = time.perf_counter()
        compiler.compile(StructuredOutputs.json_schema(entry["schema"])).matcher()
        times.append((time.perf_counter() - started) * 1000)
    return times


def valid(output: Output, schema: dict[str, Any]) -> bool:
    import jsonschema  # a dev dependency of triton-local: the bench's check, not the engine's

    if output.finish != "stop":
        return False
    try:
        jsonschema.validate(json.loads(output.text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def throughput(engine: StepEngine, prompts: list[tuple[int, ...]], schemas: list[dict[str, Any]], batch: int, rounds: int) -> dict[str, Any]:
    """Structured and free side by side, wave by wave (each wave's two runs back to back, in turns
    first), so that this shared machine's drift hits both alike; tokens/s over all rounds."""
    structured = [Job(p, Sampling(max_tokens=MAX_TOKENS), StructuredOutputs.json_schema(s)) for p, s in zip(prompts, schemas)]
    seconds = {"structured": 0.0, "free": 0.0}
    tokens = {"structured": 0, "free": 0}
    outputs: list[Output] = []
    free: list[Job] = []
    mask_seconds = engine.constraint_mask_seconds_total
    for r in range(rounds):
        for wave, first in enumerate(range(0, len(structured), batch)):
            order = ("structured", "free") if r == 0 or (r + wave) % 2 == 0 else ("free", "structured")
            for side in order:
                jobs = (structured if side == "structured" else free)[first : first + batch]
                out, spent = run_waves(engine, jobs, batch)
                if side == "structured" and r == 0:
                    outputs += out  # the free twins take their lengths from the first round
                    free += [Job(j.prompt, Sampling(max_tokens=o.tokens), None) for j, o in zip(jobs, out)]
                seconds[side] += spent
                tokens[side] += sum(o.tokens for o in out)
    return {
        "structured_tok_s": tokens["structured"] / seconds["structured"],
        "free_tok_s": tokens["free"] / seconds["free"],
        "structured_tokens": tokens["structured"] // rounds,
        "free_tokens": tokens["free"] // rounds,
        "mask_share": (engine.constraint_mask_seconds_total - mask_seconds) / seconds["structured"],
        "outputs": outputs,
    }


def measure(schemas_path: str, threads: int, rounds: int) -> dict[str, Any]:
    with open(schemas_path) as f:
        entries: list[dict[str, Any]] = json.load(f)
    engine = StepEngine(gguf_path(), max_slots=max(BATCHES), max_context=1024, threads=threads, prefix_cache=False)
    started = time.perf_counter()
    engine.compile_constraint(StructuredOutputs.json_object())  # builds the engine's vocabulary for llguidance once
    tokenizer_ms = (time.perf_counter() - started) * 1000
    compile_ms = compile_times(engine, entries)
    schemas = [e["schema"] for e in entries]
    prompts = [tuple(engine.encode_chat([("user", e["prompt"])])) for e in entries]
    result: dict[str, Any] = {
        "schemas": len(entries),
        "tokenizer_build_ms": tokenizer_ms,
        "compile_ms_p50": statistics.median(compile_ms),
        "compile_ms_max": max(compile_ms),
    }
    greedy: list[Output] = []
    for batch in BATCHES:
        n = BATCH1_SCHEMAS if batch == 1 else len(entries)
        figures = throughput(engine, prompts[:n], schemas[:n], batch, rounds)
        if batch == max(BATCHES):
            greedy = figures["outputs"]
        result[f"batch{batch}"] = {k: v for k, v in figures.items() if k != "outputs"}
    masks_before, seconds_before = engine.constraint_masks_total, engine.constraint_mask_seconds_total
    sampled, _ = run_waves(
        engine,
        [
            Job(p, Sampling(max_tokens=MAX_TOKENS, temperature=1.0, seed=i), StructuredOutputs.json_schema(s))
            for i, (p, s) in enumerate(zip(prompts, schemas))
        ],
        max(BATCHES),
    )
    masks = engine.constraint_masks_total - masks_before
    result["mask_ms_per_token_sampled"] = 1000 * (engine.constraint_mask_seconds_total - seconds_before) / max(masks, 1)
    result["mask_ms_per_token"] = 1000 * engine.constraint_mask_seconds_total / max(engine.constraint_masks_total, 1)
    result["valid_greedy"] = [valid(o, s) for o, s in zip(greedy, schemas)]
    result["valid_sampled"] = [valid(o, s) for o, s in zip(sampled, schemas)]
    result["invalid"] = [
        {"name": e["name"], "mode": mode, "finish": o.finish, "text": o.text[:300]}
        for mode, outs in (("greedy", greedy), ("sampled", sampled))
        for e, o, s in zip(entries, outs, schemas)
        if not valid(o, s)
    ]
    result["examples"] = [{"name": e["name"], "greedy": o.text} for e, o in list(zip(entries, greedy))[:3]]
    return result


def main(argv: list[str]) -> None:
    print(json.dumps(measure(argv[0], int(argv[1]), int(argv[2]))))


if __name__ == "__main__":
    main(sys.argv[1:])
