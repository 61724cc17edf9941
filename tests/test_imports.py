"""Imports run one way (docs/design.md, the rooms table): no cycle between molt's modules, and no module imports
a room of a higher layer. The sources are read with `ast`, nothing of molt is imported. Imports at module level
and inside functions count; those under `if TYPE_CHECKING:` do not (they never run).

An import names one module: `import molt.x.y` and `from molt.x import y` with y a submodule name molt.x.y;
`from molt.x import name` names molt.x (a package's __init__). Relative imports are resolved first. The import
of a parent package that Python runs on the way to a submodule is no edge (it would make every package a cycle
with its own submodules). So `pkg/__init__ -> pkg.sub` alone is no cycle, but `pkg.sub -> pkg` (a submodule
taking a name from its package's __init__, which imports that submodule) closes one and fails.

Layers (LAYERS): a module may import its own room and the rooms of a lower layer, never one of its own layer
or above. The configuration's functions (config_resolve, config_validate) are one room with its records
(config.py), below the trainer: `Actor.from_pretrained` builds its tree with `override`, `validate` and
`resolve`. `MOLT_IMPORTS_ROOT` points the test at another copy of the package (to see it fail).
"""

from __future__ import annotations

import ast
import graphlib
import os
from pathlib import Path

ROOT = Path(os.environ.get("MOLT_IMPORTS_ROOT", Path(__file__).resolve().parents[1] / "molt"))
LAYERS = {
    "types": 0,  # and the leaf utilities, which import nothing of molt
    "models": 0,
    "modeling": 0,  # what engines and the trainer share about a model
    "flags": 0,
    "algo": 1,
    "engine": 1,
    "inspect": 1,  # reads run directories: molt.types at most
    "capture": 2,
    "agents": 2,
    "envs": 3,  # hub environments, on the agent contract
    "config": 3,  # config.py, config_resolve.py, config_validate.py
    "trainer": 4,
    "runtime": 5,
    "cli": 6,
    "testing": 7,  # test support: everything
    "molt": 7,  # the package's own __init__
}


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1].removesuffix("_resolve").removesuffix("_validate") if len(parts) > 1 else "molt"


def modules(root: Path) -> dict[str, Path]:
    """{dotted name: file} of every module under `root` (the `molt` package directory)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = ("molt", *path.relative_to(root).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(module: str, path: Path, known: dict[str, Path]) -> list[tuple[int, str]]:
    """(line, molt module named) of each import in `path` that runs, TYPE_CHECKING blocks left out."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((node.lineno, a.name) for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            for a in node.names:
                target = f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                if target in known:
                    found.append((node.lineno, target))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return [(line, target) for line, target in found if target != module]


def graph(root: Path) -> dict[str, list[tuple[int, str]]]:
    known = modules(root)
    return {m: imports(m, path, known) for m, path in known.items()}


def test_no_cycles():
    edges = {m: {t for _, t in found} for m, found in graph(ROOT).items()}
    try:
        graphlib.TopologicalSorter(edges).prepare()
    except graphlib.CycleError as e:
        raise AssertionError(f"import cycle: {' -> '.join(reversed(e.args[1]))}") from None


def test_imports_go_down_the_layers():
    known = modules(ROOT)
    bad = [
        f"{known[m].relative_to(ROOT.parent)}:{line}: {m} ({room(m)}, layer {LAYERS[room(m)]}) imports {t} "
        f"({room(t)}, layer {LAYERS[room(t)]})"
        for m, found in graph(ROOT).items()
        for line, t in found
        if room(t) != room(m) and LAYERS[room(t)] >= LAYERS[room(m)]
    ]
    assert not bad, "imports from a lower layer up:\n" + "\n".join(bad)


def test_every_room_has_a_layer():
    assert {room(m) for m in modules(ROOT)} <= set(LAYERS)
