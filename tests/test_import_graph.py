"""No import cycle anywhere in ``src/river_hf`` (static: read with ``ast``, no module is imported).

One node per module; a package's ``__init__`` is its own node (``river_hf.river``). An edge is:

- an ``import river_hf.x`` or ``from river_hf.x import y`` / ``from .x import y`` / ``from . import y``
  anywhere in the file: at the top or inside a function (a lazy import still runs the imported
  module, and an import cycle entered lazily is still a cycle); ``from pkg import name`` is an
  edge to ``pkg.name`` when that is a module, else to ``pkg``;
- a lazy export: the ``_EXPORTS`` dict passed to ``lazy_exports`` in an ``__init__.py`` gives an
  edge from the package to every module it names (reading the name imports it);
- in a module that calls ``importlib.import_module``, every string constant naming a river-hf
  module (``cli.COMMAND_MODULES``: the entry point imports each command module).

Not an edge: the one lazy export of a plain module, ``river/serialization.py``'s ``river_class``
(bound from ``river.modeling`` on first read). It exists only for folders saved by earlier
versions, whose ``modeling_river.py`` imports ``river_class`` from ``serialization``; new folders
import it from ``modeling``. ``tests/test_river_imports.py`` pins ``serialization`` below
``modeling``, so the name cannot be a real import there.

Importing a module also runs its parents' ``__init__``; that is not an edge here (every module
would then depend on ``river_hf/__init__``, whose lazy exports reach everything).
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = SRC / "river_hf"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


FILES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _known(name: str) -> str | None:
    """``name`` or its nearest ancestor that is a module of the package (None: not river-hf)."""
    while name:
        if name in FILES:
            return name
        name = name.rpartition(".")[0]
    return None


def _lazy_export_targets(tree: ast.Module, module: str) -> set[str]:
    """Modules named by the dict passed to ``lazy_exports(__name__, _EXPORTS)`` in an ``__init__``."""
    assigned = {t.id: node.value for node in tree.body if isinstance(node, ast.Assign)
                for t in node.targets if isinstance(t, ast.Name)}
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "lazy_exports" and len(node.args) == 2:
            spec = node.args[1]
            if isinstance(spec, ast.Name):
                spec = assigned[spec.id]
            # the dict is built of string literals and comprehensions over tuples of them
            exports = eval(compile(ast.Expression(spec), "<_EXPORTS>", "eval"), {"__builtins__": {}}, {})
            found |= {_known(importlib.util.resolve_name(target, module)) for target in exports.values()}
    return found


def _edges(module: str, path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {_known(alias.name) for alias in node.names if alias.name.split(".")[0] == "river_hf"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module if is_package else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                base = f"{base}.{node.module}" if node.module else base
            elif (node.module or "").split(".")[0] == "river_hf":
                base = node.module
            else:
                continue
            for alias in node.names:
                out.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in FILES else _known(base))
    if is_package:
        out |= _lazy_export_targets(tree, module)
    calls_import_module = any(isinstance(n, ast.Attribute) and n.attr == "import_module" for n in ast.walk(tree))
    if calls_import_module:
        out |= {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in FILES}
    out.discard(None)
    out.discard(module)
    return out


GRAPH = {module: _edges(module, path) for module, path in FILES.items()}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in sorted(graph):
        if state.get(root):
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_the_graph_sees_what_it_should():
    """The reader finds the kinds of edge it is meant to (so an empty graph cannot pass)."""
    assert "river_hf.river.modeling" in GRAPH["river_hf.river"]  # lazy export of an __init__
    assert "river_hf.river" in GRAPH["river_hf"]  # a subpackage exported by name
    assert "river_hf.river.serialization" in GRAPH["river_hf.river.modeling"]  # top-level relative import
    assert "river_hf.eval.metrics" in GRAPH["river_hf.eval.tasks"]  # from . import <subpackage>
    assert "river_hf.river.plain" in GRAPH["river_hf.bench"]  # an import inside a function
    assert "river_hf.stitch.generation" in GRAPH["river_hf.stitch.custom_generate.generate"]  # absolute import
    assert "river_hf.river.cli" in GRAPH["river_hf.cli"]  # importlib.import_module over COMMAND_MODULES


def test_find_cycle_names_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_in_the_package():
    cycle = _find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_dev_extras_bring_pytest_timeout():
    """`pip install -e '.[dev]'` brings pytest-timeout, so a hung test can be cut off with
    `pytest --timeout N` (issue 40)."""
    import tomllib

    root = Path(__file__).resolve().parent.parent
    dev = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    assert any(req.split(">")[0].split("=")[0].strip() == "pytest-timeout" for req in dev), dev
