"""Count non-blank, non-comment Python lines under molt/ (docstrings count): the budget of docs/design.md."""
import sys
import tokenize
from pathlib import Path


def count(path: Path) -> int:
    lines: set[int] = set()
    with open(path, "rb") as f:
        for tok in tokenize.tokenize(f.readline):
            if tok.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.ENCODING,
                            tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
                continue
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return len(lines)


if __name__ == "__main__":
    root = Path(next((a for a in sys.argv[1:] if not a.startswith("-")), "molt"))
    per = {p: count(p) for p in sorted(root.rglob("*.py"))}
    if "-v" in sys.argv:
        for p, n in sorted(per.items(), key=lambda kv: -kv[1]):
            print(f"{n:6d} {p}")
    print(f"{sum(per.values())} code lines in {root}/ (budget 9,000)")
