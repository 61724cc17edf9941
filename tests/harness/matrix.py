"""The conformance matrix's rows, shared by the tests and the summary hook (conftest.py)."""

ROWS: list[dict] = []
