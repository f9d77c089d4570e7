"""The kernel registry (``river_hf.quant.registry``): one table of kernel classes, and modules that
name their kernel and count their bytes, so a new kernel is one module and one registered class."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from river_hf.quant import BACKENDS, KERNELS, WeightOnlyKernel, get_backend, kernel_name, linear_weight_bytes
from river_hf.quant.modules import CastLinear, PromptRowsLinear
from river_hf.quant.registry import KernelModule, register


def dense_bytes(linear: nn.Linear) -> int:
    return sum(t.numel() * t.element_size() for t in (linear.weight, linear.bias) if t is not None)


def test_every_kernel_is_a_registered_class_whose_copies_name_it():
    """Each name of KERNELS is an instance of a WeightOnlyKernel subclass (no name-switched base
    objects), and what it builds names that kernel and reads fewer weight bytes than the dense
    Linear (``copy``: exactly as many; it is ``dense``)."""
    linear = nn.Linear(128, 64)
    assert all(type(k) is not WeightOnlyKernel and isinstance(k, WeightOnlyKernel) for k in KERNELS.values())
    assert all(name == k.name for name, k in KERNELS.items())
    built = 0
    for name, kernel in KERNELS.items():
        if not (kernel.supports(linear) and kernel.available("cpu")):
            continue
        copy_ = kernel.build(linear)
        built += 1
        if name == "copy":
            assert kernel_name(copy_) == "dense" and linear_weight_bytes(copy_) == dense_bytes(linear)
        else:  # quanto-int4 packs 128 input channels on CPU only on its slow path: the name says so
            assert kernel_name(copy_).removesuffix(" (slow fallback)") == name
            assert 0 < linear_weight_bytes(copy_) < dense_bytes(linear), name
    assert built >= 6  # torch-int8, torch-int4, torch-int4-g32, quanto-int8, quanto-int4, copy at least


def test_wrappers_are_named_and_counted_by_what_a_decode_step_runs():
    linear = nn.Linear(128, 64)
    decode, prompt = KERNELS["torch-int4"].build(linear), KERNELS["torch-int8"].build(linear)
    both = PromptRowsLinear(decode, prompt, 16)
    assert kernel_name(both) == "torch-int4"
    assert linear_weight_bytes(both) == linear_weight_bytes(decode) < linear_weight_bytes(nn.ModuleList([decode, prompt]))
    cast = KERNELS["quanto-int8"].build(linear)  # an fp32 Linear: quanto's QLinear runs in bf16 inside
    assert isinstance(cast, CastLinear) and kernel_name(cast) == kernel_name(cast.inner) == "quanto-int8"
    assert linear_weight_bytes(cast) == linear_weight_bytes(cast.inner)


class HalfLinear(KernelModule):
    """A stand-in kernel's module: fp16 weights, the caller's dtype at the boundary."""

    river_kernel = "test-half"

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.register_buffer("weight_half", linear.weight.detach().half())
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight_half.to(x.dtype), self.bias)


@dataclasses.dataclass(frozen=True)
class HalfKernel(WeightOnlyKernel):
    def build(self, linear: nn.Linear, memo=None) -> nn.Module:
        with torch.no_grad():
            return HalfLinear(linear)


@pytest.fixture
def half_kernel():
    kernel = register(HalfKernel("test-half", 16, None))
    yield kernel
    del KERNELS["test-half"]


def test_a_new_kernel_is_one_module_and_one_registered_class(half_kernel):
    """Nothing else is taught about it: a choice builds exit layers on it, and the report, the
    kernel names and the weight bytes all know it."""
    from river_hf.quant import KernelChoice

    assert KERNELS["test-half"] is half_kernel and half_kernel.available() and half_kernel.supports(nn.Linear(3, 5))
    layer = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16, bias=False))
    report: list[dict] = []
    exit_layer = KernelChoice("test-half", (half_kernel,)).build_layer(layer, report=report)
    assert [r["kernel"] for r in report] == ["test-half", "test-half"]
    assert [kernel_name(m) for m in exit_layer] == ["test-half", "dense", "test-half"]
    assert linear_weight_bytes(exit_layer) == (64 * 32 + 16 * 32) * 2 + 32 * 4  # fp16 weights, the fp32 bias
    x = torch.randn(2, 64)
    assert torch.allclose(exit_layer(x), layer(x), atol=1e-2)
    assert "test-half" not in BACKENDS  # the config names are fixed at import: a choice is built as above


def test_register_refuses_a_second_kernel_under_a_taken_name(half_kernel):
    assert register(half_kernel) is half_kernel  # the same kernel again: nothing changes
    with pytest.raises(ValueError, match="already registered"):
        register(HalfKernel("test-half", 8, None))
    with pytest.raises(ValueError, match="already registered"):
        register(HalfKernel("torch-int4", 4))
    assert KERNELS["torch-int4"].bits == 4 and type(KERNELS["torch-int4"]).__name__ == "TorchInt4Kernel"


def test_choices_ask_the_kernel_classes_not_their_names():
    """What used to switch on name prefixes: the library a kernel needs (the error when none of a
    choice's kernels can run), and ``copy`` copying a layer whole."""
    assert KERNELS["ort-int4"].needs.startswith("onnxruntime") and KERNELS["ark-int8"].needs.startswith("auto-round")
    assert KERNELS["quanto-int4"].needs == "optimum-quanto" and "torch" in KERNELS["torch-dyn-int8"].needs
    assert [k.name for k in KERNELS.values() if k.keeps_dense_layer] == ["copy"]
    assert get_backend("copy").build_layer(nn.Sequential(nn.Linear(4, 4)))[0].weight.shape == (4, 4)
