"""The output equals the reference after normalization (case, whitespace, surrounding quotes and
final punctuation ignored). Value 1 = a match. Reference-based: only for scored completions
(`ScoreCompletions`, `sluice eval`) that carry a reference; completion events have none."""

from __future__ import annotations

import re

from sluice_evaluation_logging.evaluators.base import CompletionEvent, EvalContext, ScoreResult, has_text

NAME = "exact_match"
# For comparisons (`sluice eval`): which way is better.
HIGHER_IS_BETTER = True

_SPACE = re.compile(r"\s+")
# Stripped from both ends: a model that answers "Paris." or "\"Paris\"" to a reference "Paris" matches.
_EDGES = " \t\n\"'`.,;:!?"


def normalize(text: str) -> str:
    return _SPACE.sub(" ", text.casefold()).strip(_EDGES)


def evaluate(event: CompletionEvent, reference: str, ctx: EvalContext) -> ScoreResult | None:
    if not reference or not has_text(event):
        return None
    matched = normalize(event.output) == normalize(reference)
    detail = "" if matched else f"expected {normalize(reference)[:80]!r}, got {normalize(event.output)[:80]!r}"
    return ScoreResult(NAME, 1.0 if matched else 0.0, matched, detail)
