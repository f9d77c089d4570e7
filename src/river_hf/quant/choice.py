"""Kernel choices: which weight-only kernel each Linear of an exit layer gets, and the record of it.

A :class:`KernelChoice` is what a config names for a group of Linears (``RiverConfig.backend`` /
``exit_head``, looked up by :func:`~river_hf.quant.kernels.get_backend` in
:data:`~river_hf.quant.kernels.BACKENDS`): one kernel of :data:`~river_hf.quant.registry.KERNELS`,
or the fastest of several, chosen per Linear shape by a short measurement on the machine at hand
(:mod:`.autotune`). It builds a decoder layer's exit copy (:meth:`KernelChoice.build_layer`).

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
import warnings

import torch
from torch import nn

from ..errors import RiverError
from .modules import CastMemo, PromptRowsLinear, relative_error
from .registry import KERNELS, WeightOnlyKernel

__all__ = ["KernelChoice", "KernelPlan", "shape_key", "prompt_key", "PRIOR_SUFFIX", "PROMPT_ROWS", "PROMPT_MIN_ROWS", "PROMPT_KERNELS"]

#: rows at which a prompt kernel is measured against the one-row choice (a short prompt's length)
PROMPT_ROWS = 128
#: calls of at least this many rows run on the prompt kernel (a decode step has one row per sequence)
PROMPT_MIN_ROWS = 16
#: suffix of a ``kernel_choice`` key whose value says why the shape's kernel came from the prior
#: ranking, not a measurement (``"int4:896x4864#prior": "AVX-512: all candidates within 0.4 %"``)
PRIOR_SUFFIX = "#prior"
#: the prompt-kernel candidates per weight width (measured against the width's one-row choice)
PROMPT_KERNELS = {4: ("ort-int4",), 8: ("ort-int8",)}


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
        if all(k.keeps_dense_layer for k in self.candidates):  # ``copy``: the deep copy is the exit layer
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
                             + "; ".join(f"{k.name} needs {k.needs}" for k in self.candidates)
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

    A shape whose kernel came from the prior ranking because its timings were invalid
    (:mod:`.prior`; the tuner's ``last_prior``) also gets ``chosen[key + "#prior"] = "<feature set>:
    <why>"``. A saved choice marked so is re-validated when the machine is quiet: that shape goes to
    the tuner (its kernels.json entry, or a new measurement), and :attr:`revalidated` records it;
    while the machine is loaded (or without a tuner) it is reused, its mark kept.

    Args:
        tuner: a :class:`~river_hf.quant.autotune.KernelTuner` or None.
        saved: ``{shape key: kernel name}`` from a saved River folder, or None.

    Attributes:
        chosen: ``{shape key: kernel name}`` of this build's measured choices (and ``#prior`` marks).
        differs: ``{shape key: (saved kernel, kernel used, why)}`` for saved choices not reused.
        revalidated: ``{shape key: (saved kernel, kernel now, saved mark)}`` for saved choices of the
            prior ranking measured again on a quiet machine.
    """

    def __init__(self, tuner=None, saved: dict | None = None):
        self.tuner = tuner or None
        self.saved = dict(saved or {})
        self.chosen: dict[str, str] = {}
        self.differs: dict[str, tuple[str, str, str]] = {}
        self.revalidated: dict[str, tuple[str, str, str]] = {}
        self._quiet: bool | None = None

    def _revalidate(self, key: str) -> bool:
        """Whether the saved kernel of ``key``, which the prior ranking chose (no valid measurement),
        is measured again now: a tuner is at hand and the machine is quiet (asked once per plan)."""
        if self.tuner is None or key + PRIOR_SUFFIX not in self.saved or not hasattr(self.tuner, "quiet_now"):
            return False
        if self._quiet is None:
            self._quiet = bool(self.tuner.quiet_now())
        return self._quiet

    def pick(self, choice: KernelChoice, linear: nn.Linear) -> tuple[WeightOnlyKernel, dict]:
        """The kernel ``choice`` gives ``linear`` (see the class docstring) and the timings (µs per
        call) when it was measured."""
        candidates = choice.usable(linear)
        key = shape_key(choice.name, linear)
        want = self.saved.get(key)
        if not choice.measured and want is None:
            return candidates[0], {}
        timings: dict = {}
        revalidate = want is not None and choice.measured and self._revalidate(key)
        kernel = None if revalidate else next((k for k in candidates if k.name == want), None)
        if kernel is None and not revalidate and want in KERNELS and _same_grid(KERNELS[want], choice.candidates[0]) \
                and KERNELS[want].supports(linear) and KERNELS[want].available(linear.weight.device):
            kernel = KERNELS[want]  # a kernel this choice no longer measures (ort-int4), saved by an older build
        if kernel is None:
            if len(candidates) == 1 or self.tuner is None:
                kernel = candidates[0]
            else:
                kernel, timings = self.tuner.choose(candidates, linear)
                prior = getattr(self.tuner, "last_prior", None)
                if prior:  # no valid measurement: the prior ranking's kernel, and the folder says so
                    self.chosen[key + PRIOR_SUFFIX] = prior
            if revalidate:
                self.revalidated[key] = (want, kernel.name, self.saved[key + PRIOR_SUFFIX])
            elif want is not None and kernel.name != want:
                self.differs[key] = (want, kernel.name, _why_not(choice, want, linear))
        elif key + PRIOR_SUFFIX in self.saved:  # reused as saved (machine loaded, or nothing to measure with)
            self.chosen[key + PRIOR_SUFFIX] = self.saved[key + PRIOR_SUFFIX]
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
