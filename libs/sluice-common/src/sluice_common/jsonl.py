"""JSON lines (a batch input file, a CLI dataset or row file): where one line ends."""

from __future__ import annotations


def jsonl_lines(text: str) -> list[str]:
    """The lines of a JSON-lines text: split at "\\n" only (a trailing "\\r" dropped), never at the other
    breaks str.splitlines knows (U+2028, U+2029, U+0085, ...), which a JSON string may hold unescaped."""
    return [line.removesuffix("\r") for line in text.split("\n")]
