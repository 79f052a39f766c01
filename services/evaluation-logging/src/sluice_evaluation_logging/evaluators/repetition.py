"""Repeated word n-grams (character n-grams in scripts without spaces, such as Chinese, Japanese or
Thai): value = share of the output's n-grams that repeat an earlier one (0 = none)."""

from __future__ import annotations

import re

from sluice_evaluation_logging.evaluators.base import CompletionEvent, EvalContext, ScoreResult, has_text

NAME = "repetition"
# For comparisons (`sluice eval`): which way is better.
HIGHER_IS_BETTER = False
# Tokenizes the whole output and counts every n-gram in Python: ~170 us per KB here.
CPU_HEAVY = True
# Scripts written without spaces between words (Han, kana, Thai, Lao, Khmer, Myanmar): `\w+` would
# make a whole run one "word", so a reply looping on one phrase scored 0; each character is a token
# instead. Other scripts: runs of word characters, and each punctuation mark.
_UNSPACED = (
    "\u0e00-\u0eff"  # Thai, Lao
    "\u1000-\u109f"  # Myanmar
    "\u1780-\u17ff"  # Khmer
    "\u3040-\u30ff\u31f0-\u31ff\uff66-\uff9f"  # kana, halfwidth katakana
    "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0003134f"  # Han
)
_WORD = re.compile(f"[{_UNSPACED}]|[^\\W{_UNSPACED}]+|[^\\w\\s]")
# The detail names the most repeated n-gram; a "word" can be a whole 60 kB output without spaces.
DETAIL_CHARS = 80


def repeated_ngram_ratio(text: str, n: int) -> tuple[float, str]:
    words = _WORD.findall(text.lower())
    total = len(words) - n + 1
    if total <= 1:
        return 0.0, ""
    seen: dict[tuple[str, ...], int] = {}
    repeats = 0
    for i in range(total):
        gram = tuple(words[i : i + n])
        if gram in seen:
            repeats += 1
        seen[gram] = seen.get(gram, 0) + 1
    if not repeats:  # every n-gram once: no need to look for the most repeated one
        return 0.0, ""
    top, count = max(seen.items(), key=lambda item: item[1])
    return repeats / total, (f"most repeated: {' '.join(top)[:DETAIL_CHARS]!r} x{count}" if count > 1 else "")


def evaluate(event: CompletionEvent, ctx: EvalContext) -> ScoreResult | None:
    if not has_text(event) or not event.output.strip():
        return None
    ratio, detail = repeated_ngram_ratio(event.output, ctx.settings.repetition_ngram)
    return ScoreResult(NAME, ratio, ratio <= ctx.settings.repetition_max_ratio, detail)
