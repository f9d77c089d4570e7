"""A decode step's wall time by category of module, for ``benchmarks/step_profile.py``.

Attribution is by module forward hooks, exclusive (self) wall time: every module of the model gets
a category, a module's time minus its children's goes to its category, and River's own
per-pass work (``RiverRouter.begin`` / ``after_backbone`` / ``end``, the ``RiverLayer`` and
``RiverHead`` wrappers) goes to ``routing``. Categories:

- ``backbone products``: the backbone's ``nn.Linear`` modules (decoder layers);
- ``exit products``: the exit layers' Linear copies (quantized kernels, their input casts, the
  fused products and their slices), and the river-int4 products run inside a fused exit layer's
  C++ calls (timed by the kernel's product clock, ``river_int4.product_clock``: the activations'
  int8 quantization and the dot products; the rest of those calls, norms, rotary, SDPA and
  ``silu * up``, stays with the layer's category);
- ``head``: the LM head (original or exit head, and its wrapper);
- ``attention``: the attention modules minus their projections (rotary application, the KV-cache
  update, SDPA, reshapes);
- ``norms/rotary/elementwise``: norms, the rotary-embedding module, the MLP's activation and
  product, the decoder layers' residual adds, the embedding lookup;
- ``routing``: River's exit decision (state transition similarity, the rules) and its wrappers;
- ``forward glue``: the decoder stack and the CausalLM forward themselves (mask creation, output
  objects, logits slicing; in lossless verify passes, entering the verify kernel mode), or River's
  exit-mode step (``river.exit_step.ExitStep``, which reports its steps to the profiler: it calls
  no forward of the model or the stack; its exit-stack call is timed as the exit layers' C++ calls);
- ``generate loop``: the time between one forward pass's end and the next one's start
  (transformers' loop: logits processors, argmax, stopping criteria, streamer, input preparation,
  River's ``prepare_inputs_for_generation``; in lossless mode the drafter's and assisted
  decoding's work, charged to the pass that follows it).
"""

from __future__ import annotations

import time

import torch
from torch import nn

__all__ = ["CATEGORIES", "linear_like", "categories", "StepProfiler", "step_rows"]

CATEGORIES = ("backbone products", "exit products", "head", "attention", "norms/rotary/elementwise", "routing",
              "forward glue", "generate loop")
_PRODUCT_CATEGORIES = ("backbone products", "exit products", "head")


def linear_like(module: nn.Module) -> bool:
    """A weight product module: a Linear or one of river-hf's built copies of one (every module a
    registered kernel builds is a ``KernelModule``; quanto's ``QLinear`` by name)."""
    from ..quant.fused import FusedProjection, ProjectionSlice
    from ..quant.registry import KernelModule

    return isinstance(module, (nn.Linear, KernelModule, FusedProjection, ProjectionSlice)) \
        or type(module).__name__.startswith("QLinear")


def categories(model: nn.Module) -> dict[int, str]:
    """``{id(module): category}`` for every module of ``model`` (a River or plain model) but the
    top one (timed as ``forward glue`` by the pass hooks)."""
    from ..river.layer import RiverHead, RiverLayer

    cats: dict[int, str] = {}
    head = model.get_output_embeddings()

    def walk(module: nn.Module, where: str):
        for child in module.children():
            name = type(child).__name__
            if child is head or where == "head":
                cat, inner = "head", "head"
            elif isinstance(child, RiverLayer):
                cat, inner = "routing", "layer"
            elif linear_like(child):
                cat, inner = ("exit products" if where == "exit" else "backbone products"), where
            elif "Attention" in name:
                cat, inner = "attention", where
            elif isinstance(child, nn.ModuleList) or "Model" in name:
                cat, inner = "forward glue", where
            else:
                cat, inner = "norms/rotary/elementwise", where
            cats.setdefault(id(child), cat)
            if isinstance(child, RiverLayer):
                cats[id(child.backbone)] = "norms/rotary/elementwise"
                cats[id(child.exit_layer)] = "norms/rotary/elementwise"
                walk(child.backbone, "backbone")
                walk(child.exit_layer, "exit")
            elif isinstance(child, RiverHead):
                walk(child, "head")
            else:
                walk(child, inner)

    walk(model, "backbone")
    return cats


class StepProfiler:
    """Exclusive wall time per category of every forward pass of one model, and the gaps between
    passes (see the module docstring). Use as a context manager around ``generate``; afterwards
    :attr:`passes` holds one dict per top-level forward: ``tokens``, ``mode`` (the River router's
    mode during the pass, None for a plain model), ``start``/``end`` (perf_counter s), ``gap``
    (s since the previous pass ended; None for the first), ``seconds`` ({category: s})."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.cats = categories(model)
        self.passes: list[dict] = []
        self.stack: list[list] = []  # [category, start, child seconds]
        self.handles: list = []
        self.patched: list = []
        self.clock = None  # river-int4's product clock while profiling, when that kernel is loaded
        self.router = None  # the model's River router, if any
        self.hook_ids: tuple = ()

    def _product_seconds(self) -> float:
        return self.clock.product_ns() * 1e-9 if self.clock is not None else 0.0

    def push(self, cat: str, start: float | None = None) -> None:
        # [category, start, children's seconds, product clock at start, children's product seconds]
        self.stack.append([cat, time.perf_counter() if start is None else start, 0.0, self._product_seconds(), 0.0])

    def pop(self) -> float:
        """Close the innermost category; returns the time it closed at (perf_counter s)."""
        cat, start, child, product_start, child_products = self.stack.pop()
        now = time.perf_counter()
        elapsed = now - start
        products = self._product_seconds() - product_start
        # products timed by the kernel's clock inside a non-product module (a fused exit layer's
        # C++ calls) are exit products; inside a product or head module they are that module's time
        inner = 0.0 if cat in _PRODUCT_CATEGORIES else products - child_products
        if self.passes and self.passes[-1]["end"] is None:
            seconds = self.passes[-1]["seconds"]
            seconds[cat] = seconds.get(cat, 0.0) + elapsed - child - inner
            if inner:
                seconds["exit products"] = seconds.get("exit products", 0.0) + inner
        if self.stack:
            self.stack[-1][2] += elapsed
            self.stack[-1][4] += products
        return now

    def step_begin(self, tokens: int | None) -> None:
        """A forward pass (or River's exit-mode step, ``river.exit_step.ExitStep``) of ``tokens`` tokens a
        row begins: its record opens, its own time goes to ``forward glue``."""
        now = time.perf_counter()
        last = self.passes[-1]["end"] if self.passes else None
        self.passes.append({"tokens": tokens, "mode": self.router.mode if self.router is not None else None,
                            "start": now, "gap": None if last is None else now - last, "end": None, "seconds": {}})
        self.push("forward glue", now)

    def step_end(self) -> None:
        """The pass :meth:`step_begin` began ends."""
        self.passes[-1]["end"] = self.pop()

    def __enter__(self):
        from ..quant.river_int4 import product_clock
        from ..river.exit_step import ExitStep

        cats = self.cats
        self.clock = product_clock()
        if self.clock is not None:
            self.clock.set_product_clock(True)
        router = self.router = getattr(self.model, "river", None)
        ExitStep.observer = self  # River's exit-mode steps report to this profiler (they skip the model's forward)

        def pre(module, args):
            cat = cats.get(id(module))
            if cat is not None:
                self.push(cat)

        def post(module, args, output):
            if id(module) in cats:
                self.pop()

        def top_pre(module, args, kwargs):
            x = kwargs.get("input_ids", args[0] if args else None)
            self.step_begin(int(x.shape[1]) if isinstance(x, torch.Tensor) else None)

        def top_post(module, args, kwargs, output):
            self.step_end()

        self.handles = [nn.modules.module.register_module_forward_pre_hook(pre),
                        nn.modules.module.register_module_forward_hook(post, always_call=True),
                        self.model.register_forward_pre_hook(top_pre, with_kwargs=True, prepend=True),
                        self.model.register_forward_hook(top_post, with_kwargs=True, always_call=True)]
        self.hook_ids = (self.handles[2].id, self.handles[3].id)  # the model's: ExitStep's steps report instead
        if router is not None:
            for name in ("begin", "after_backbone", "end"):
                method = getattr(router, name)

                def timed(*a, _method=method, **k):
                    self.push("routing")
                    try:
                        return _method(*a, **k)
                    finally:
                        self.pop()

                setattr(router, name, timed)
                self.patched.append((router, name))
        return self

    def __exit__(self, *exc):
        from ..river.exit_step import ExitStep

        ExitStep.observer = None
        if self.clock is not None:
            self.clock.set_product_clock(False)
        for h in self.handles:
            h.remove()
        for obj, name in self.patched:
            delattr(obj, name)  # the instance attribute goes, the class's method is back
        self.handles, self.patched = [], []


def step_rows(passes: list[dict], mode: str) -> dict[str, dict]:
    """Mean ms per category of the decode passes (prefill left out; lossless: draft and verify
    passes apart), ``generate loop`` = mean gap before such a pass."""
    decode = passes[1:]
    if mode == "lossless":
        groups = {"lossless draft": [p for p in decode if p["tokens"] == 1 and p["mode"] in ("route", "exit")],
                  "lossless verify": [p for p in decode if (p["tokens"] or 0) > 1]}
    else:
        groups = {mode: decode}
    rows = {}
    for label, ps in groups.items():
        if not ps:
            continue
        ms = {c: 1e3 * sum(p["seconds"].get(c, 0.0) for p in ps) / len(ps) for c in CATEGORIES if c != "generate loop"}
        ms["generate loop"] = 1e3 * sum(p["gap"] or 0.0 for p in ps) / len(ps)
        rows[label] = {"ms": ms, "passes": len(ps), "tokens_per_pass": sum(p["tokens"] for p in ps) / len(ps)}
    return rows
