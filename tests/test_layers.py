"""The layers of phalanx: imports point down only, no module imports itself back, and light stays light.

Every module under ``src/phalanx`` is parsed with ``ast``; every import of a
phalanx module counts, at module level, inside a function or inside an
``if TYPE_CHECKING:`` block (such an import never runs, but a type that a lower
module names from a higher one is the same dependency, and a cycle through it
is the same tangle). A module may import its own layer and the layers below
it, never one above, and no chain of imports may lead from a module back to
itself.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "phalanx"

# Lowest first. A module belongs to the first layer with a matching entry: a module name, or a
# package prefix ending in "." (its modules and the package itself).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # Leaf modules everything uses: exceptions, settings, atomic files, what a buffer is and which
    # device a rank uses (the backends move Buffers and the nccl backend picks devices: below comm).
    ("base", ("phalanx._errors", "phalanx._settings", "phalanx._files", "phalanx._arrays", "phalanx._devices",
              "phalanx._net", "phalanx._drain",
              "phalanx._layout")),  # the sharding layout, which torch and JAX sharding both use
    ("comm", ("phalanx.comm", "phalanx.comm.")),
    # _current holds which world is this process's, below _world so that the trace recorder (which the
    # world calls) can read it for start_trace.
    ("world/collectives", ("phalanx._current", "phalanx._trace",
                           "phalanx._world", "phalanx._collectives", "phalanx._objects", "phalanx._shards", "phalanx._nonblocking", "phalanx._agreement", "phalanx._failure",
                           "phalanx._output", "phalanx._groups", "phalanx._shutdown", "phalanx._p2p", "phalanx._epochs", "phalanx._epoch_keys", "phalanx._epochs_ulfm",
                           "phalanx._reconfigure",  # what follows a re-formed world: the registry reform() drives
                           "phalanx._reform")),
    # `phalanx` itself re-exports these and the layers below.
    ("sync/data/tree/gradients", ("phalanx", "phalanx._sync", "phalanx._data", "phalanx._tree",
                                  "phalanx._gradients",
                                  "phalanx.jax._pytrees",  # phalanx.allreduce_gradients' JAX path
                                  "phalanx._sync_errors")),
    ("torch/jax", ("phalanx.torch", "phalanx.torch.", "phalanx.jax", "phalanx.jax.", "phalanx._torch_plugin")),
    ("train", ("phalanx.train", "phalanx.train.", "phalanx.examples", "phalanx.examples.")),
    ("launch", ("phalanx.launch", "phalanx.launch.")),
    ("horovod", ("phalanx.horovod", "phalanx.horovod.")),  # horovod.run starts jobs through the launcher
    ("testing", ("phalanx.testing", "phalanx.testing.")),
    ("cli", ("phalanx.cli", "phalanx.cli.", "phalanx.__main__")),
]
HEAVY = ("torch", "mpi4py", "jax")


def layer_of(module: str) -> int | None:
    for level, (_, entries) in enumerate(LAYERS):
        for entry in entries:
            if module == entry or entry.endswith(".") and module.startswith(entry):
                return level
    return None


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def _import_nodes(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return found


def imports_of(module: str) -> dict[str, int]:
    """The phalanx modules ``module`` imports, each with the line of its first import."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets: dict[str, int] = {}
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # `from pkg import mod` imports the module pkg.mod; `from mod import name` imports mod.
            names = [f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES else source for a in node.names]
        for name in names:
            while name and name not in MODULES and "." in name:  # `import phalanx.torch._x.y` -> longest module
                name = name.rpartition(".")[0]
            if name in MODULES and name != module:
                targets.setdefault(name, node.lineno)
    return targets


GRAPH = {module: imports_of(module) for module in MODULES}


def test_every_module_has_a_layer() -> None:
    unplaced = [m for m in MODULES if layer_of(m) is None]
    assert not unplaced, f"modules in no layer (add them to LAYERS in {__file__}): {unplaced}"


def test_no_module_imports_a_higher_layer() -> None:
    upward = []
    for module, targets in GRAPH.items():
        level = layer_of(module)
        for target, line in targets.items():
            there = layer_of(target)
            if level is not None and there is not None and there > level:
                upward.append(f"{MODULES[module].relative_to(SRC.parent)}:{line}: {module} "
                              f"({LAYERS[level][0]}) imports {target} ({LAYERS[there][0]})")
    assert not upward, "imports that point up:\n" + "\n".join(upward)


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, {}):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_between_modules() -> None:
    cycles = _cycles(GRAPH)
    described = [" <-> ".join(c) + "\n    " + "\n    ".join(
        f"{a} imports {b} (line {GRAPH[a][b]})" for a in c for b in GRAPH[a] if b in c) for c in cycles]
    assert not cycles, "modules that import each other (directly or through others):\n" + "\n".join(described)


def test_imports_under_type_checking_count() -> None:
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from phalanx._world import World\n")
    assert sorted(n.module or "" for n in _import_nodes(tree) if isinstance(n, ast.ImportFrom)) == [
        "phalanx._world", "typing"]


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b": 1}, "b": {}}) == []


@pytest.mark.parametrize("module", ["phalanx", "phalanx.train", "phalanx.launch", "phalanx.testing", "phalanx.cli"])
def test_importing_loads_no_heavy_framework(module: str) -> None:
    code = f"import sys, {module}; print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"`import {module}` imported {out.stdout.strip()}"
