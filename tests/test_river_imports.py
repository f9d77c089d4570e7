"""The River modules import in one direction (no cycle), without imports inside functions to dodge one.

Static (reads the sources with ``ast``), so it costs no torch import. cli*.py are left out: they
import lazily on purpose, so that ``river-hf --help`` does not wait for torch.
"""

from __future__ import annotations

import ast
from pathlib import Path

RIVER = Path(__file__).resolve().parent.parent / "src" / "river_hf" / "river"
MODULES = sorted(p.stem for p in RIVER.glob("*.py") if p.stem != "__init__" and not p.stem.startswith("cli"))


def _sibling_imports(tree: ast.AST, top_level: bool) -> set[str]:
    nodes = tree.body if top_level else [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef,
                                                                                     ast.AsyncFunctionDef))]
    found = set()
    for node in nodes:
        for sub in [node] if top_level else ast.walk(node):
            if isinstance(sub, ast.ImportFrom) and sub.level == 1 and sub.module in MODULES:
                found.add(sub.module)
    return found


def test_river_modules_import_without_a_cycle():
    graph = {m: _sibling_imports(ast.parse((RIVER / f"{m}.py").read_text()), top_level=True) for m in MODULES}
    assert graph["serialization"] and "modeling" in MODULES
    done: list[str] = []
    while len(done) < len(graph):
        ready = [m for m in graph if m not in done and graph[m] <= set(done)]
        assert ready, f"import cycle among {sorted(set(graph) - set(done))}: {graph}"
        done += sorted(ready)
    assert done.index("modeling") > done.index("serialization") > done.index("offload") > done.index("arch")


def test_no_function_level_sibling_imports():
    for m in MODULES:
        inner = _sibling_imports(ast.parse((RIVER / f"{m}.py").read_text()), top_level=False)
        assert not inner, f"{m}.py imports {inner} inside a function"


def test_old_import_paths_still_work():
    """The CLI and benchmarks import settings from .modeling; folders saved earlier import
    river_class from .serialization."""
    import river_hf.river.serialization as serialization
    from river_hf.river.modeling import RiverConfig, default_config, enable_river, river_class

    assert serialization.river_class is river_class and callable(enable_river)
    assert isinstance(default_config(), RiverConfig)


def test_only_layer_py_reads_the_routers_thread_local():
    """The router's per-thread state (``RiverRouter._local``: the pass in flight and the
    overrides) is layer.py's own; a generate call's state is its ``GenerateCall``, reached through
    ``router.current_call``."""
    package = RIVER.parent
    readers = sorted(str(p.relative_to(package)) for p in package.rglob("*.py")
                     if p != RIVER / "layer.py"
                     and any(isinstance(n, ast.Attribute) and n.attr == "_local" for n in ast.walk(ast.parse(p.read_text()))))
    assert not readers, f"{readers} read a RiverRouter's private _local; use router.current_call or a router method"
    assert any(isinstance(n, ast.Attribute) and n.attr == "_local"
               for n in ast.walk(ast.parse((RIVER / "layer.py").read_text())))  # (the check can see one)
