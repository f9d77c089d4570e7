"""The kernel treatments the benchmarks give their methods: the plain model on prepacked oneDNN
(:func:`plain_onednn_mode`), a kernel mode entered around given Linears (:func:`linears_in_mode`,
as River enters its own), the verify-kernel mode entered for multi-row forwards only
(:func:`multi_row_kernel_hooks`) and prompt kernels bypassed (:func:`prompt_kernels_off`)."""

from __future__ import annotations

import contextlib

import torch

__all__ = ["plain_onednn_mode", "linears_in_mode", "multi_row_kernel_hooks", "prompt_kernels_off", "all_modules"]


def all_modules(model) -> list:
    """Every module of ``model``, a River model's exit copies included (``model.modules()`` gives
    the architecture's modules only; ``river_hf.river.exit_modules`` the copies)."""
    from ..river.layer import exit_modules

    return [*model.modules(), *(m for _, m in exit_modules(model))]


def plain_onednn_mode(river, plain, max_rows: int):
    """The ``TorchFunctionMode`` that runs every fp32 Linear call of ``plain`` (one row included, up to
    ``max_rows`` rows) on prepacked oneDNN, and a note saying which copy it uses.

    Where River's lossless mode packed its backbone for verifies (``river_hf.river.lossless.verify_mode``,
    which ``plain`` shares tensors with), this is a view of that copy
    (:meth:`~river_hf.quant.dense.PrepackedLinear.with_rows`, no memory added); otherwise a new copy of
    the plain model's Linears, under the library's memory rule (at most ``PACK_MEMORY_SHARE`` of the
    memory available).

    Raises:
        ValueError: no copy exists and a new one would not fit (or this torch has no oneDNN)."""
    from ..quant.dense import PrepackedLinear, onednn_available
    from ..river import lossless

    config = river.river_config
    mode, _ = lossless.verify_mode(river, config.verify_kernel, config.max_draft_tokens + 1)
    if isinstance(mode, PrepackedLinear):
        return mode.with_rows(min_rows=1, max_rows=max_rows), "lossless mode's verify copy, shared"
    if not onednn_available():
        raise ValueError("this torch build has no oneDNN")
    linears = [m for m in plain.modules() if isinstance(m, torch.nn.Linear)]
    need, available = sum(m.weight.numel() * m.weight.element_size() for m in linears), lossless.available_memory_bytes()
    if available is None or need > lossless.PACK_MEMORY_SHARE * available:
        have = "unknown" if available is None else f"{available / 1e9:.1f} GB"
        raise ValueError(f"the packed copy of the plain model's Linears needs {need / 1e9:.2f} GB, more than "
                         f"{lossless.PACK_MEMORY_SHARE:.0%} of the memory available ({have})")
    return PrepackedLinear(linears, max_rows=max_rows, min_rows=1), "its own copy"


@contextlib.contextmanager
def linears_in_mode(linears, mode):
    """Within the block, each of ``linears`` (``nn.Linear``) runs its forward inside the
    ``TorchFunctionMode`` ``mode`` (:func:`river_hf.quant.dense.linear_mode_hooks`), the scope River
    gives its own backbone kernel modes: a baseline on the same kernel pays the same dispatch, no
    more (a mode around the whole forward sends every op through Python). Yields ``mode``."""
    from ..quant.dense import linear_mode_hooks

    handles = linear_mode_hooks(list(linears), lambda: mode)
    try:
        yield mode
    finally:
        for handle in handles:
            handle.remove()


def multi_row_kernel_hooks(model, mode) -> list:
    """Forward hooks on ``model`` that run each forward of more than one input token (``input_ids``
    or ``inputs_embeds`` ``[batch, tokens, ...]`` with tokens > 1) inside the ``TorchFunctionMode``
    ``mode`` (and nothing else); returns the handles to remove."""
    entered: list = []

    def enter(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        use = ids is not None and ids.dim() >= 2 and ids.shape[1] > 1
        if use:
            mode.__enter__()
        entered.append(use)

    def leave(module, args, kwargs, output=None):
        if entered.pop():
            mode.__exit__(None, None, None)

    return [model.register_forward_pre_hook(enter, with_kwargs=True),
            model.register_forward_hook(leave, with_kwargs=True, always_call=True)]


@contextlib.contextmanager
def prompt_kernels_off(model):
    """Within the block, every exit Linear with a prompt kernel (``PromptRowsLinear``) sends all
    calls to its one-row kernel: the model as built without ``prompt_kernel``, same weights.
    Yields how many Linears it switched."""
    from ..quant.modules import PromptRowsLinear

    wrapped = [m for m in all_modules(model) if isinstance(m, PromptRowsLinear)]
    old = [m.min_rows for m in wrapped]
    for m in wrapped:
        m.min_rows = 1 << 62
    try:
        yield len(wrapped)
    finally:
        for m, rows in zip(wrapped, old):
            m.min_rows = rows
