"""Count the logic lines under molt/: non-blank, non-comment Python lines, docstrings not counted (the budget of
docs/design.md: 8,500)."""

import ast
import sys
import tokenize
from pathlib import Path

SKIP = (
    tokenize.COMMENT,
    tokenize.NL,
    tokenize.NEWLINE,
    tokenize.ENCODING,
    tokenize.INDENT,
    tokenize.DEDENT,
    tokenize.ENDMARKER,
)


def docstring_lines(path: Path) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(ast.parse(path.read_bytes())):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
            first = body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def count(path: Path) -> int:
    lines: set[int] = set()
    with open(path, "rb") as f:
        for tok in tokenize.tokenize(f.readline):
            if tok.type not in SKIP:
                lines.update(range(tok.start[0], tok.end[0] + 1))
    return len(lines - docstring_lines(path))


if __name__ == "__main__":
    root = Path(next((a for a in sys.argv[1:] if not a.startswith("-")), "molt"))
    per = {p: count(p) for p in sorted(root.rglob("*.py"))}
    if "-v" in sys.argv:
        for p, n in sorted(per.items(), key=lambda kv: -kv[1]):
            print(f"{n:6d} {p}")
    print(f"{sum(per.values())} logic lines in {root}/ (docstrings not counted; budget 8,500)")
