"""Fails when a relative link in a Markdown file outside docs/ (README.md by default) points to no file.

`mkdocs build --strict` checks the links of docs/; README.md lies outside the site, so `make docs`
runs this for it. Usage: python3 tools/check_readme_links.py [FILE.md ...]
"""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# [text](target) and [text](target "title"); images too. Autolinks and reference links are not used here.
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def relative_links(markdown: str) -> list[str]:
    """Link targets outside code (fenced blocks and inline code can hold brackets that are no links)."""
    prose = INLINE_CODE.sub("", FENCE.sub("", markdown))
    targets = INLINE_LINK.findall(prose)
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.IGNORECASE) and not t.startswith("#")]


def broken_links(path: Path) -> list[str]:
    broken = []
    for target in relative_links(path.read_text()):
        file_part = target.split("#", 1)[0]
        if not (path.parent / file_part).exists():
            broken.append(target)
    return broken


def main(argv: list[str]) -> int:
    files = [Path(a) for a in argv] or [ROOT / "README.md"]
    failed = False
    for path in files:
        links = relative_links(path.read_text())
        broken = broken_links(path)
        for target in broken:
            print(f"{path}: link to {target}: no such file", file=sys.stderr)
        failed |= bool(broken)
        if not broken:
            print(f"{path}: {len(links)} relative links, every one to an existing file")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
