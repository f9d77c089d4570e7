"""Routing of small-batch fp32 Linear calls on CPU to a faster GEMM orientation.

A forward over a few tokens (R-Stitch's partial prefill of 2-16 tokens, the verify step of
assisted generation) calls each Linear with an input of ``rows`` = 2..64 tokens. On CPU, torch's
fp32 ``F.linear`` (MKL ``sgemm`` on ``x @ W.T``) runs such shapes 1.5-2.9x slower than computing
the same product as ``(W @ x.T).T``, measured on this project's 2-core AMD EPYC with torch 2.13:
at ``rows`` = 4 a 1536→8960 Linear reads its weights at ~4 GB/s instead of ~15 GB/s, so a 4-token
forward of a 1.5B model costs 2.3-2.7 one-token decode steps instead of about one (see
``benchmarks/small_batch_linear.py`` and docs/stitch.md). One token (``rows`` = 1) is a GEMV and
is already fast; bf16 shows no such gap, and from ~128 rows on the stock path is as fast or faster.

:class:`SmallBatchLinear` is a ``TorchFunctionMode``: inside ``with SmallBatchLinear():`` every
``F.linear`` call whose input is fp32 on CPU with 2..``max_rows`` rows is computed as
``torch.mm(W, x.T).T`` (+ bias); every other call (an ``out=`` argument, CPU autocast on, mixed
dtypes or devices) is passed through untouched. No module is
modified, so the models, their hooks (accelerate offload) and their saved weights are as they were.
The result equals ``F.linear``'s up to fp32 summation order (relative error ~1e-7).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["SmallBatchLinear"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)


class SmallBatchLinear(TorchFunctionMode):
    """Compute fp32 CPU ``F.linear`` calls of 2..``max_rows`` rows as ``(W @ x.T).T``.

    Args:
        max_rows: largest number of input rows (tokens × batch) that is rerouted (default 64;
            at 128 rows and above MKL's own orientation is as fast or faster on the measured CPU).

    Inside the mode, a call ``F.linear(x, W, b)`` with ``x: float32 [..., in_features]`` on CPU,
    ``W: float32 [out_features, in_features]`` and ``2 <= x.numel() // in_features <= max_rows``
    returns ``float32 [..., out_features]`` (contiguous), computed as ``torch.mm(W, x2d.T).T + b``.
    Anything else (one row, other dtypes or devices, quantized weights) goes to ``F.linear``.

    Raises:
        ValueError: ``max_rows`` is not an int >= 2.
    """

    def __init__(self, max_rows: int = 64):
        super().__init__()
        if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 2:
            raise ValueError(f"max_rows must be an int >= 2 (one row is already a fast GEMV), got {max_rows!r}")
        self.max_rows = max_rows
        self.calls_rerouted = 0

    def _eligible(self, x, weight, bias) -> bool:
        if not all(t is None or type(t) in _PLAIN for t in (x, weight, bias)):
            return False  # tensor subclasses (quantized weights) keep their own kernels
        if any(t is not None and (t.device.type != "cpu" or t.dtype != torch.float32) for t in (x, weight, bias)):
            return False  # F.linear itself decides (and raises) for mixed devices or dtypes
        if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
            return False
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        return 2 <= rows <= self.max_rows

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and "out" not in kwargs and not torch.is_autocast_enabled("cpu"):  # F.linear is torch._C._nn.linear
            x = args[0] if args else kwargs["input"]
            weight = args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if self._eligible(x, weight, bias):
                self.calls_rerouted += 1
                x2d = x.reshape(-1, x.shape[-1])
                out = torch.mm(weight, x2d.t()).t().contiguous()
                if bias is not None:
                    out += bias
                return out.reshape(*x.shape[:-1], weight.shape[0])
        return func(*args, **kwargs)
