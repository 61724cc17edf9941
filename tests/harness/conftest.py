"""The conformance matrix: each test of this folder adds a row (harness, version, turns, status codes, segments);
the rows are printed at the end of the run and written to $MOLT_HARNESS_MATRIX when set."""

import os

from matrix import ROWS


def pytest_terminal_summary(terminalreporter):
    if not ROWS:
        return
    head = ["harness", "version", "turns", "status codes", "segments"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    lines += ["| " + " | ".join(str(r[k]) for k in head) + " |" for r in ROWS]
    terminalreporter.write_sep("-", "harness conformance matrix")
    terminalreporter.write_line("\n".join(lines))
    if os.environ.get("MOLT_HARNESS_MATRIX"):
        with open(os.environ["MOLT_HARNESS_MATRIX"], "w") as f:
            f.write("\n".join(lines) + "\n")
