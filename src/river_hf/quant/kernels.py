"""Weight-only kernels: the strategy objects that turn one ``nn.Linear`` into its cheap copy.

A :class:`WeightOnlyKernel` takes a dense Linear (``weight: [out_features, in_features]``, model
dtype) and returns a *new* module with the same call signature and the same dtype at its
boundary: ``x: [..., in_features]`` in the model's dtype gives ``[..., out_features]`` in the
model's dtype. Only the matmul runs in the kernel's compute dtype (W8A16 / W4A16: 8- or 4-bit
weights, bf16 activations); the source Linear is not modified (a tied LM head stays tied).

Kernels (``KERNELS``):
    ``torch-int8``: per-output-channel symmetric int8 weights, bf16 activations, on torch's own
        weight-only kernel ``torch._weight_int8pack_mm`` (a small module around the op: torchao
        0.18's stable int8 config does not reach it on CPU without ``mslk``).
    ``torch-int4``: asymmetric 4-bit weights in groups of 128 (64 or 32 where ``in_features``
        needs it), bf16 activations, on ``torch._weight_int4pack_mm_for_cpu`` (CPU) /
        ``torch._weight_int4pack_mm`` (CUDA, tinygemm). Unlike quanto it also packs shapes whose
        ``in_features`` is not a multiple of 128 (SmolLM2's 576).
    ``torch-int4-g32``: the same kernel with groups of 32 input channels: a quarter more bytes
        (scales and zeros), about half the relative output error of groups of 128 on the
        Qwen2.5-Coder weights (docs/river.md).
    ``quanto-int4``: optimum-quanto ``qint4`` weights, group size 128, bf16 activations (packed
        int4 kernel where ``in_features % 128 == 0``, a slow dequantizing path elsewhere).
    ``quanto-int8``: optimum-quanto ``qint8`` weights, bf16 activations (quanto dispatches to
        ``torch._weight_int8pack_mm`` on CPU, through its tensor subclass).
    ``ort-int4`` / ``ort-int4-g32`` / ``ort-int8``: onnxruntime's ``MatMulNBits`` (MLAS), 4-bit
        asymmetric (blocks of 128, 64 or 32 / of 32) or 8-bit symmetric (blocks of 128, 64 or 32)
        weights, fp32 activations, accuracy level 4 (int8 dot products), one onnxruntime session
        per Linear (:class:`~river_hf.quant.external.OrtMatMulNBitsLinear`). Needs onnxruntime.
    ``torch-dyn-int8``: torch's fbgemm ``quantized::linear_dynamic``, per-channel int8 weights,
        activations quantized per call (:class:`~river_hf.quant.external.DynamicInt8Linear`).
    ``ark-int4`` / ``ark-int8``: Intel ARK ``woqgemm`` (auto-round-lib), 4-bit asymmetric groups of
        128 (64, 32) / 8-bit per channel, int8 compute (:class:`~river_hf.quant.external.ArkWoqLinear`).
        Needs auto-round-lib.
    ``copy``: an unquantized copy in the model's dtype: exit layers then compute exactly what the
        backbone computes, the reference for testing the routing itself.

    Each kernel is *available* (:meth:`WeightOnlyKernel.available`) only where its library is
    installed and a small product computes correctly on this CPU; a choice measures only the
    available ones.

Kernel *choices* (what ``RiverConfig.backend`` / ``exit_head`` name, see :func:`get_backend`):
    ``int4-g32``: ``torch-int4-g32``.
    ``int8`` / ``int4``: the fastest kernel of that weight width for each Linear's shape, chosen by
        a short measurement on the machine at hand (:mod:`.autotune`). The width is the quality
        knob (HumanEval pass@1 follows the exit layers' bits, docs/river.md); within one width the
        kernels quantize alike (same grid, relative output error within a few percent of each
        other, reported per Linear), so speed alone picks among them. The onnxruntime kernels are
        not candidates: each product is fast alone, but their thread pool shares the cores with
        torch's, and inside a whole decode step they lost (Qwen2.5-Coder-0.5B fully quantized on
        the 2-core AVX-512 machine: ``ort-int4`` 0.73x the decode speed of ``torch-int4``, and the
        measured choice with an onnxruntime head slower than without: docs/river.md). Name them to
        use them.
    any kernel name above: that kernel for every Linear (``quanto`` is kept as a name for
    ``quanto-int4``).

Prompt kernels: a measured choice (``int4``/``int8``) built with ``prompt=True`` (``RiverConfig.prompt_kernel``,
off by default) also measures, per shape, its one-row kernel against :data:`PROMPT_KERNELS` at
:data:`PROMPT_ROWS` rows; where another kernel is faster there, the exit Linear becomes a
:class:`~river_hf.quant.modules.PromptRowsLinear`: the one-row kernel for decode steps, the prompt
kernel for calls of :data:`PROMPT_MIN_ROWS` rows or more (a prompt pass through the exit layers),
at the cost of a second copy of those weights. onnxruntime's pool costs little there: one call per
Linear per prompt, each milliseconds long. The choice is recorded in ``kernel_choice`` under
:func:`prompt_key` (a saved folder reuses it without measuring, and warns where it cannot); with
nothing saved and no tuner (``RIVER_HF_AUTOTUNE=0``) no prompt kernel is added.

A measured choice is a property of the machine, and kernels of one width still differ in their
numerics (different rounding, scale dtypes, accumulation order), so the tokens depend on it.
:class:`KernelPlan` therefore records the kernel each measured shape got while a model is built
(keys from :func:`shape_key`, e.g. ``"int4:896x4864"``); ``enable_river`` stores that record in
``RiverConfig.kernel_choice``, a saved River folder carries it, and a later load reuses it where
that kernel exists on the machine (warning once, naming the shapes, where it cannot).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import warnings

import torch
from torch import nn

from ..errors import RiverError
from .external import ArkWoqLinear, DynamicInt8Linear, OrtMatMulNBitsLinear, ark_works, dynamic_int8_works, ort_works
from .modules import (CastLinear, CastMemo, Int4WeightOnlyLinear, Int8WeightOnlyLinear, PromptRowsLinear,  # noqa: F401
                      fast_kernel_fraction, kernel_name, linear_weight_bytes, relative_error)

__all__ = [
    "WeightOnlyKernel",
    "KERNELS",
    "KernelChoice",
    "get_backend",
    "BACKENDS",
    "Int8WeightOnlyLinear",
    "Int4WeightOnlyLinear",
    "CastLinear",
    "CastMemo",
    "linear_weight_bytes",
    "kernel_name",
    "relative_error",
    "KernelPlan",
    "shape_key",
    "prompt_key",
    "PromptRowsLinear",
    "PROMPT_ROWS",
    "PROMPT_MIN_ROWS",
    "PROMPT_KERNELS",
]


@dataclasses.dataclass(frozen=True)
class WeightOnlyKernel:
    """One way to run a Linear with cheaper weights.

    Attributes:
        name: registry name (``torch-int8``, ``torch-int4``, ``quanto-int4``, ``ort-int4``, ..., ``copy``).
        bits: weight bits.
        compute_dtype: activation dtype at the kernel's boundary; None keeps the model's dtype
            (``ort-*``, ``ark-*``, ``torch-dyn-int8``: float32 in and out, int8 dot products inside).
        group_size: the largest group of input channels sharing a scale (None: per output channel).
    """

    name: str
    bits: int
    compute_dtype: torch.dtype | None = torch.bfloat16
    group_size: int | None = None  # torch-int4: the largest group (input channels sharing a scale)

    def supports(self, linear: nn.Linear) -> bool:
        """Whether this kernel has a real (packed) implementation for ``linear``'s shape."""
        if self.name.startswith("torch-int4"):
            return Int4WeightOnlyLinear.supports(linear)
        if self.name == "torch-int8":
            return linear.in_features % 4 == 0
        if self.name.startswith("ort-") or self.name == "ark-int4":
            return linear.in_features % 32 == 0
        return True

    def available(self, device: torch.device | str = "cpu") -> bool:
        """Whether this machine has what the kernel runs on: torch's op for ``device``
        (``_weight_int4pack_mm_for_cpu`` / ``_weight_int4pack_mm`` / ``_weight_int8pack_mm``),
        optimum-quanto for the quanto kernels, and for ``ort-*`` / ``ark-*`` / ``torch-dyn-int8`` a
        CPU ``device`` and the library installed and computing a small product correctly here
        (:func:`~river_hf.quant.external.ort_works`, ``ark_works``, ``dynamic_int8_works``: checked
        once per process). ``copy`` is always available."""
        cpu = torch.device(device).type == "cpu"
        if self.name.startswith("torch-int4"):
            return hasattr(torch, "_weight_int4pack_mm_for_cpu" if cpu else "_weight_int4pack_mm")
        if self.name == "torch-int8":
            return hasattr(torch, "_weight_int8pack_mm")
        if self.name.startswith("quanto"):
            try:
                return importlib.util.find_spec("optimum.quanto") is not None
            except ImportError:  # no optimum at all
                return False
        if self.name.startswith("ort-"):
            return cpu and ort_works()
        if self.name.startswith("ark-"):
            return cpu and ark_works()
        if self.name == "torch-dyn-int8":
            return cpu and dynamic_int8_works()
        return True

    def build(self, linear: nn.Linear, memo: CastMemo | None = None) -> nn.Module:
        """Return the cheap copy of ``linear`` (``linear`` itself is not modified).

        Raises:
            RiverError: the kernel does not support this shape (see :meth:`supports`).
        """
        model_dtype = linear.weight.dtype
        if self.name == "copy":
            return copy.deepcopy(linear)
        with torch.no_grad():
            if self.name == "torch-int8":
                m = Int8WeightOnlyLinear(linear, self.compute_dtype)
                m.memo = memo
                return m
            if self.name.startswith("torch-int4"):
                m = Int4WeightOnlyLinear(linear, self.compute_dtype, self.group_size or 128)
                m.memo = memo
                return m
            if self.name.startswith(("ort-", "ark-", "torch-dyn")):
                if not self.supports(linear):
                    raise RiverError(f"{self.name} needs in_features divisible by 32, got "
                                     f"{linear.in_features}x{linear.out_features}")
                if self.name.startswith("ort-"):
                    m = OrtMatMulNBitsLinear(linear, self.bits, self.group_size or 128, 4, kernel=self.name)
                elif self.name.startswith("ark-"):
                    m = ArkWoqLinear(linear, self.bits, self.group_size or 128, kernel=self.name)
                else:
                    m = DynamicInt8Linear(linear)
                m.memo = memo
                return m
            from optimum.quanto import freeze, qint4, qint8, quantize

            compute = self.compute_dtype or model_dtype
            holder = nn.Sequential(copy.deepcopy(linear).to(compute))
            quantize(holder, weights={4: qint4, 8: qint8}[self.bits])
            freeze(holder)
            return holder[0] if compute == model_dtype else CastLinear(holder[0], compute, memo)

    def to_dict(self) -> dict:
        dtype = None if self.compute_dtype is None else str(self.compute_dtype).removeprefix("torch.")
        return {"name": self.name, "bits": self.bits, "compute_dtype": dtype}


KERNELS: dict[str, WeightOnlyKernel] = {
    k.name: k
    for k in (
        WeightOnlyKernel("torch-int8", 8),
        WeightOnlyKernel("torch-int4", 4, group_size=128),
        WeightOnlyKernel("torch-int4-g32", 4, group_size=32),
        WeightOnlyKernel("quanto-int8", 8),
        WeightOnlyKernel("quanto-int4", 4, group_size=128),
        WeightOnlyKernel("ort-int4", 4, torch.float32, group_size=128),
        WeightOnlyKernel("ort-int4-g32", 4, torch.float32, group_size=32),
        WeightOnlyKernel("ort-int8", 8, torch.float32, group_size=128),
        WeightOnlyKernel("torch-dyn-int8", 8, torch.float32),
        WeightOnlyKernel("ark-int4", 4, torch.float32, group_size=128),
        WeightOnlyKernel("ark-int8", 8, torch.float32),
        WeightOnlyKernel("copy", 16, None),
    )
}


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """What a config names for a group of Linears: one kernel, or the fastest of several.

    Attributes:
        name: the config's name (``int8``, ``int4``, a kernel name, ``quanto``).
        candidates: the kernels to choose from (one: no measurement).
        bits: their weight width.
    """

    name: str
    candidates: tuple[WeightOnlyKernel, ...]

    @property
    def bits(self) -> int:
        return self.candidates[0].bits

    def to_dict(self) -> dict:
        d = self.candidates[0].to_dict() if len(self.candidates) == 1 else {
            "name": self.name, "bits": self.bits, "compute_dtype": self.candidates[0].to_dict()["compute_dtype"]}
        d["name"] = self.name
        if len(self.candidates) > 1:
            d["candidates"] = [k.name for k in self.candidates]
        return d

    def build_layer(self, layer: nn.Module, tuner=None, *, report: list | None = None, prefix: str = "",
                    prompt: bool = False) -> nn.Module:
        """A copy of decoder ``layer`` whose ``nn.Linear`` children run on this choice's kernels.

        The copy keeps every attribute of the original (``layer_idx``, ``attention_type``, ...), so
        its attention writes to the same KV-cache slot; its Linears share one :class:`CastMemo`.
        ``report`` (when given) gets one dict per Linear (name, shape, kernel, timings).
        ``prompt``: also give each Linear a prompt kernel where one measures faster (module docstring).
        """
        exit_layer = copy.deepcopy(layer)
        if self.name == "copy":
            return exit_layer
        memo = CastMemo()
        linears = [(n, m) for n, m in exit_layer.named_modules() if type(m) is nn.Linear]
        for name, linear in linears:
            new, row = self.build_linear(linear, tuner, memo=memo, prompt=prompt)
            parent_name, _, child = name.rpartition(".")
            setattr(exit_layer.get_submodule(parent_name) if parent_name else exit_layer, child, new)
            if report is not None:
                report.append({"name": f"{prefix}{name}", **row})
        return exit_layer

    def build_linear(self, linear: nn.Linear, tuner=None, *, memo: CastMemo | None = None,
                     prompt: bool = False) -> tuple[nn.Module, dict]:
        """Build ``linear``'s copy on the chosen kernel; returns it and a report row. ``prompt``: add
        a prompt kernel where one measures faster at :data:`PROMPT_ROWS` rows (module docstring;
        the row then has ``prompt_kernel``, ``prompt_us_per_call`` and ``prompt_relative_error``)."""
        kernel, timings = self.pick(linear, tuner)
        new = kernel.build(linear, memo=memo)
        row = {"in_features": linear.in_features, "out_features": linear.out_features, "kernel": kernel.name,
               "relative_error": relative_error(linear, new)}
        if timings:
            row["us_per_call"] = timings
        if prompt:
            new = self._with_prompt_kernel(linear, kernel, new, tuner, row)
        return new, row

    def _with_prompt_kernel(self, linear: nn.Linear, kernel: WeightOnlyKernel, new: nn.Module, tuner,
                            row: dict) -> nn.Module:
        if not self.measured:
            return new
        plan = tuner if isinstance(tuner, KernelPlan) else None
        measurer = plan.tuner if plan is not None else tuner
        device = linear.weight.device
        others = [KERNELS[n] for n in PROMPT_KERNELS.get(self.bits, ())
                  if n != kernel.name and KERNELS[n].supports(linear) and KERNELS[n].available(device)]
        key = prompt_key(self.name, linear)
        want = plan.saved.get(key) if plan is not None else None
        fastest, timings = next((k for k in (kernel, *others) if k.name == want), None), {}
        if fastest is None and others and measurer is not None:
            fastest, timings = measurer.choose([kernel, *others], linear, rows=PROMPT_ROWS)
        if want is not None and (fastest is None or fastest.name != want):
            plan.differs[key] = (want, (fastest or kernel).name, "not available on this machine"
                                 if want in KERNELS else "not a prompt kernel of this river-hf")
        if fastest is None:
            return new
        if plan is not None:
            plan.chosen[key] = fastest.name  # the saved folder reuses it (the one-row kernel's name: none)
        if fastest is kernel:
            return new
        prompt_copy = fastest.build(linear)
        row.update(prompt_kernel=fastest.name, prompt_us_per_call=timings,
                   prompt_relative_error=relative_error(linear, prompt_copy, rows=PROMPT_ROWS))
        return PromptRowsLinear(new, prompt_copy, PROMPT_MIN_ROWS)

    @property
    def measured(self) -> bool:
        """Whether this choice picks among several kernels (by measurement): its pick is then a
        property of the machine, recorded by :class:`KernelPlan`."""
        return len(self.candidates) > 1

    def usable(self, linear: nn.Linear) -> list[WeightOnlyKernel]:
        """The candidates with a real implementation for ``linear``'s shape on this machine (when
        none has: the last candidate available here; ``int4``/``int8`` end with quanto, which packs
        every shape, on a slow path where it must).

        Raises:
            RiverError: no candidate can run here at all (a named kernel whose library is not
                installed, e.g. ``ark-int4`` without auto-round-lib); the message names what it needs.
        """
        device = linear.weight.device
        usable = [k for k in self.candidates if k.supports(linear) and k.available(device)]
        if usable:
            return usable
        available = [k for k in self.candidates if k.available(device)]
        if not available:
            raise RiverError(f"exit-layer kernel {self.name!r} cannot run on {torch.device(device).type} here: "
                             + "; ".join(f"{k.name} needs {_NEEDS.get(k.name.split('-')[0], 'its library')}"
                                         for k in self.candidates)
                             + " (or choose another kernel, e.g. int4)")
        return available[-1:]

    def pick(self, linear: nn.Linear, tuner=None) -> tuple[WeightOnlyKernel, dict]:
        """The kernel for ``linear`` and the candidates' timings (µs per call; empty when nothing
        was measured). ``tuner``: a :class:`~river_hf.quant.autotune.KernelTuner`, a
        :class:`KernelPlan` (saved choices first), or None (the first usable candidate)."""
        if isinstance(tuner, KernelPlan):
            return tuner.pick(self, linear)
        candidates = self.usable(linear)
        if len(candidates) == 1 or tuner is None:
            return candidates[0], {}
        return tuner.choose(candidates, linear)


#: what each kernel family needs, for the error when none of a choice's kernels can run
_NEEDS = {
    "ort": "onnxruntime (pip install 'river-hf[ort]') on a CPU",
    "ark": "auto-round-lib (pip install 'river-hf[ark]'; wheels for Linux x86-64, CPython >= 3.11, torch >= 2.13) "
           "on a CPU",
    "quanto": "optimum-quanto",
    "torch": "an op this torch build lacks on this device (torch._weight_int4pack_mm / _weight_int8pack_mm, or the "
             "fbgemm engine for torch-dyn-int8)",
}


def _same_grid(a: WeightOnlyKernel, b: WeightOnlyKernel) -> bool:
    """Whether two kernels quantize to the same width and group size (a saved choice of one may stand
    for the other's choice)."""
    return a.bits == b.bits and a.group_size == b.group_size


def _why_not(choice: KernelChoice, name: str, linear: nn.Linear) -> str:
    """Why the saved kernel ``name`` cannot serve ``linear`` under ``choice`` (for the warning)."""
    if name not in KERNELS or not _same_grid(KERNELS[name], choice.candidates[0]):
        return f"not a {choice.name} kernel of this river-hf"
    if not KERNELS[name].available(linear.weight.device):
        return "not available on this machine"
    return "cannot pack this shape"


def shape_key(choice: str, linear: nn.Linear) -> str:
    """The key of ``RiverConfig.kernel_choice`` for ``linear`` under the kernel choice ``choice``:
    ``"<choice>:<in>x<out>"``, with ``"+bias"`` for a Linear with a bias (a biased and an unbiased
    Linear of one shape are timed apart), e.g. ``"int4:896x4864"``, ``"int4:896x896+bias"``."""
    return f"{choice}:{linear.in_features}x{linear.out_features}" + ("+bias" if linear.bias is not None else "")


def prompt_key(choice: str, linear: nn.Linear) -> str:
    """The ``RiverConfig.kernel_choice`` key of ``linear``'s prompt-kernel choice:
    :func:`shape_key` plus ``"@128rows"`` (:data:`PROMPT_ROWS`), e.g. ``"int4:896x4864@128rows"``;
    its value is the prompt kernel, or the one-row kernel's name where that measured faster."""
    return f"{shape_key(choice, linear)}@{PROMPT_ROWS}rows"


class KernelPlan:
    """The kernels one model build gives its measured choices (``int4``/``int8``), per shape.

    A shape with a saved choice (``saved``, what ``RiverConfig.kernel_choice`` holds, keys from
    :func:`shape_key`) gets that kernel whenever it is one of the choice's candidates and usable
    here (:meth:`WeightOnlyKernel.supports` and :meth:`~WeightOnlyKernel.available`); nothing is
    measured then. Any other shape is measured by ``tuner`` (None: the first usable candidate).
    :attr:`chosen` records every measured choice's kernel per shape (what a saved folder stores);
    :meth:`warn_if_differs` warns once about saved choices that could not be honoured.

    Args:
        tuner: a :class:`~river_hf.quant.autotune.KernelTuner` or None.
        saved: ``{shape key: kernel name}`` from a saved River folder, or None.

    Attributes:
        chosen: ``{shape key: kernel name}`` of this build's measured choices.
        differs: ``{shape key: (saved kernel, kernel used, why)}`` for saved choices not reused.
    """

    def __init__(self, tuner=None, saved: dict | None = None):
        self.tuner = tuner or None
        self.saved = dict(saved or {})
        self.chosen: dict[str, str] = {}
        self.differs: dict[str, tuple[str, str, str]] = {}

    def pick(self, choice: KernelChoice, linear: nn.Linear) -> tuple[WeightOnlyKernel, dict]:
        """The kernel ``choice`` gives ``linear`` (see the class docstring) and the timings (µs per
        call) when it was measured."""
        candidates = choice.usable(linear)
        key = shape_key(choice.name, linear)
        want = self.saved.get(key)
        if not choice.measured and want is None:
            return candidates[0], {}
        timings: dict = {}
        kernel = next((k for k in candidates if k.name == want), None)
        if kernel is None and want in KERNELS and _same_grid(KERNELS[want], choice.candidates[0]) \
                and KERNELS[want].supports(linear) and KERNELS[want].available(linear.weight.device):
            kernel = KERNELS[want]  # a kernel this choice no longer measures (ort-int4), saved by an older build
        if kernel is None:
            if len(candidates) == 1 or self.tuner is None:
                kernel = candidates[0]
            else:
                kernel, timings = self.tuner.choose(candidates, linear)
            if want is not None and kernel.name != want:
                self.differs[key] = (want, kernel.name, _why_not(choice, want, linear))
        self.chosen[key] = kernel.name
        return kernel, timings

    def warn_if_differs(self, stacklevel: int = 2) -> None:
        """One ``UserWarning`` naming every shape whose saved kernel could not be reused (the exit
        layers then compute slightly different numbers than the saved model's); nothing when all
        saved choices were honoured. ``stacklevel`` as for ``warnings.warn``."""
        if not self.differs:
            return
        shapes = "; ".join(f"{key}: saved {want} ({why}), using {used}"
                           for key, (want, used, why) in sorted(self.differs.items()))
        warnings.warn(
            f"the saved kernel choice could not be reused for {len(self.differs)} shape(s) ({shapes}): these exit "
            "Linears run another kernel of the same width, so outputs may differ slightly from the saved model's "
            "(install the missing kernel's package, or save the folder again on this machine)",
            UserWarning, stacklevel=stacklevel + 1)


#: rows at which a prompt kernel is measured against the one-row choice (a short prompt's length)
PROMPT_ROWS = 128
#: calls of at least this many rows run on the prompt kernel (a decode step has one row per sequence)
PROMPT_MIN_ROWS = 16
#: the prompt-kernel candidates per weight width (measured against the width's one-row choice)
PROMPT_KERNELS = {4: ("ort-int4",), 8: ("ort-int8",)}

#: the fixed-kernel names, and the two measured choices. ``quanto`` is the old name of ``quanto-int4``.
BACKENDS: dict[str, KernelChoice] = {
    "int8": KernelChoice("int8", tuple(KERNELS[k] for k in ("torch-int8", "torch-dyn-int8", "ark-int8", "quanto-int8"))),
    "int4": KernelChoice("int4", tuple(KERNELS[k] for k in ("torch-int4", "ark-int4", "quanto-int4"))),
    "int4-g32": KernelChoice("int4-g32", (KERNELS["torch-int4-g32"],)),
    **{name: KernelChoice(name, (k,)) for name, k in KERNELS.items()},
    "quanto": KernelChoice("quanto", (KERNELS["quanto-int4"],)),
}


def get_backend(name: str | KernelChoice) -> KernelChoice:
    """Look a kernel choice up by name (see the module docstring).

    Raises:
        RiverError: an unknown name, or a quanto kernel without optimum-quanto installed.
    """
    if isinstance(name, KernelChoice):
        return name
    if name not in BACKENDS:
        raise RiverError(f"unknown quantization backend {name!r}: choose one of {', '.join(BACKENDS)}")
    if any(k.name.startswith("quanto") for k in BACKENDS[name].candidates):
        try:
            import optimum.quanto  # noqa: F401
        except ImportError as e:  # pragma: no cover - it is a dependency
            raise RiverError("the quanto kernels need optimum-quanto: pip install optimum-quanto") from e
    return BACKENDS[name]
