"""Lazy package exports (PEP 562), so that ``river-hf --help`` and argument errors do not wait
for torch and transformers to import (several seconds on a small CPU).

A package lists ``{public name: submodule}``; the submodule is imported the first time the name
is read (``from river_hf import RiverForCausalLM`` or ``river_hf.RiverForCausalLM``), and the
value is then bound on the package so later reads are plain attribute lookups.
"""

from __future__ import annotations

import importlib
import sys


def lazy_exports(package: str, exports: dict[str, str]):
    """Return ``(__getattr__, __dir__)`` for ``package`` that import ``exports[name]`` (a relative
    submodule such as ``".modeling"``, relative to ``package``; from a module rather than a package,
    ``"..modeling"`` names a sibling module) on first access of ``name``; ``{"stitch": ".stitch"}``
    exports the subpackage itself. ``dir(package)`` lists ``__all__`` and the exports.

    Raises (from the returned ``__getattr__``):
        AttributeError: ``name`` is not exported by ``package``.
    """

    def __getattr__(name: str):
        submodule = exports.get(name)
        if submodule is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(submodule, package)
        value = module if submodule == "." + name else getattr(module, name)  # a subpackage itself
        setattr(sys.modules[package], name, value)
        return value

    def __dir__():
        public = getattr(sys.modules[package], "__all__", [])
        return sorted(set(public) | set(exports))

    return __getattr__, __dir__
