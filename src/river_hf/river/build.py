"""Building River's exit path on a loaded model, and taking it off again.

What :func:`~river_hf.river.modeling.enable_river` does besides giving the model River's class:
the settings in force (:func:`settings_for`, the checks), an exit copy of every decoder layer and the
exit head (:func:`build_exit_path`: quantized by the ``RiverConfig.backend`` kernels, per shape
through a :class:`~river_hf.quant.KernelPlan`), each wrapped with its backbone in a
:class:`~river_hf.river.layer.RiverLayer` / :class:`~river_hf.river.layer.RiverHead`; the forward
hooks that tell the router where a pass begins and ends; the weight bytes one decode step reads
per exit layer and strategy (``_river_step_bytes``, for the GB/s figures); and the weight
fingerprints that let ``generate`` rebuild exit copies whose backbone changed
(:func:`refresh_exit_layers`). :func:`disable_river` undoes it.

Nothing here needs :class:`~river_hf.river.modeling.RiverForCausalLM` itself: a River model is
told by its class (:func:`~river_hf.river.arch.is_river_class`).
"""

from __future__ import annotations

import copy
import dataclasses
import sys
import threading
import time
import warnings

import torch
from torch import nn
from tqdm.auto import tqdm

from ..compat import architecture_forwards
from ..errors import RiverError
from ..quant.dense import WeightFingerprint
from ..quant import KernelPlan, default_tuner, get_backend, linear_weight_bytes
from ..quant.kernels import KERNELS, PROMPT_KERNELS, PROMPT_ROWS
from ..quant.fused import fuse_projections, fused_groups
from .arch import SUPPORTED_MODEL_TYPES, base_class, decoder_stack, is_river_class
from .config import RiverConfig, default_config, warn_if_negative_tau
from .controllers import ExitRule, ExitRuleList, MinLayerRule, StateTransitionSimilarityRule
from .exit_pass import install_exit_pass
from .fused_layer import fused_exit_layer
from . import fused_llama  # noqa: F401  (registers the Llama / Qwen2 / Mistral fused exit layer)
from . import lossless
from .layer import LOSSLESS, RiverHead, RiverLayer, RiverRouter
from .offload import build_exit_layer, is_offloaded, offload_backbone
from .strategies import STRATEGIES, cache_of
from .verify_kernel import backbone_hooks

__all__ = ["build_exit_path", "build_exit_copy", "disable_river", "refresh_exit_layers", "settings_for", "warn_negative_taus",
           "RIVER_ATTRIBUTES", "KEEP"]

_REBUILD_LOCK = threading.Lock()  # one rebuild of exit copies at a time
KEEP = object()  # "not given" for settings where None is a value (exit_head=None: no exit head)

#: Attributes ``enable_river`` puts on the model (``disable_river`` removes them).
RIVER_ATTRIBUTES = ("river", "river_config", "river_build_seconds", "river_kernel_report",
                    "_river_step_bytes", "_river_hooks", "_river_verify_linear",
                    "_river_verify_costs",
                    "_river_warned_lossless_batch",
                    "_river_prints")


def check_supported(model: nn.Module, allow_untested: bool) -> None:
    if is_river_class(type(model)):
        raise RiverError("River is already enabled on this model; use model.set_river_tau(tau) to change tau")
    model_type = getattr(model.config.get_text_config(decoder=True), "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES and not allow_untested:
        raise RiverError(
            f"model type {model_type!r} is not supported by River (supported: {', '.join(SUPPORTED_MODEL_TYPES)}); "
            "pass allow_untested=True to try the generic per-layer routing anyway"
        )


def check_min_layer(rules: ExitRuleList, num_layers: int, model: nn.Module) -> None:
    """Refuse a MinLayerRule that would never let a pass leave the backbone."""
    for rule in rules:
        if isinstance(rule, MinLayerRule) and rule.min_layer >= num_layers:
            raise RiverError(
                f"min_layer={rule.min_layer} but this {type(model).__name__} has {num_layers} decoder layers: an exit "
                f"can only follow a backbone layer before the last one; choose min_layer from 1 to {num_layers - 1}"
            )


def warn_negative_taus(rules: ExitRuleList, stacklevel: int) -> None:
    """One warning per negative τ among ``rules``, pointing ``stacklevel`` frames above the caller."""
    min_layer = next((r.min_layer for r in rules if isinstance(r, MinLayerRule)), None)
    for tau in sorted({r.tau for r in rules if isinstance(r, StateTransitionSimilarityRule)}):
        warn_if_negative_tau(tau, min_layer, stacklevel=stacklevel + 1)


def settings_for(model, config: RiverConfig | None, *, rules, exit_head, **fields) -> RiverConfig:
    """The per-model default (or ``config``) with the given fields overriding it."""
    if config is None:
        model_type = getattr(model.config.get_text_config(decoder=True), "model_type", None)
        config = default_config(getattr(model.config, "name_or_path", None), model_type)
    overrides = {k: v for k, v in fields.items() if v is not None}
    if exit_head is not KEEP:
        overrides["exit_head"] = exit_head
    if rules is not None:
        overrides["rules"] = [r.to_dict() if isinstance(r, ExitRule) else r for r in rules]
    return dataclasses.replace(config, **overrides)


def build_exit_path(model: nn.Module, config: RiverConfig, rule_list: ExitRuleList, tuner, progress: bool,
                    stacklevel: int = 1) -> dict:
    """Build the exit copies and the exit head of ``model`` (in place: its layers and LM head are
    wrapped, the hooks registered) and return the attributes ``enable_river`` puts on the model,
    ``river_config`` with this build's measured kernel choices. ``stacklevel``: where the warning
    about saved kernel choices not reused points, as for ``warnings.warn`` seen from the caller (1:
    the caller of this function, 2: its caller)."""
    stack, layers = decoder_stack(model)
    if tuner is None:
        tuner = default_tuner()
    router = RiverRouter(rule_list, len(layers), prefill=config.prefill, strategy=config.strategy)
    if config.lossless:
        router.mode = LOSSLESS
    report: list[dict] = []
    start = time.perf_counter()
    asked = config
    if config.prompt_kernel and not _prompt_copies_fit(layers, config, stacklevel + 1):
        config = dataclasses.replace(config, prompt_kernel=False)  # this build only; the setting is kept
    plan = KernelPlan(tuner or None, config.kernel_choice)  # a saved folder's kernels first, then measured
    announce = progress and plan.tuner is not None and getattr(plan.tuner, "on_measure", False) is None
    say_prior = None
    if announce:
        plan.tuner.on_measure = _announce_measurement(plan.tuner)
        if hasattr(plan.tuner, "on_invalid") and plan.tuner.on_invalid is None:
            plan.tuner.on_invalid = say_prior = _announce_prior()
    try:
        backbone_bytes, exit_bytes = _wrap_layers(layers, router, config, plan, report, progress)
        head_bytes, exit_head_bytes = _wrap_head(model, router, config, plan, report)
    finally:
        if announce:
            plan.tuner.on_measure = None
            if say_prior is not None and plan.tuner.on_invalid is say_prior:
                plan.tuner.on_invalid = None
    build_seconds = time.perf_counter() - start
    if progress:
        for key, (saved, now, why) in sorted(plan.revalidated.items()):
            tqdm.write(f"[river-hf] the saved kernel choice for {key} ({saved}) came from the prior ranking ({why}); "
                       f"re-validated on this quiet machine: {now}", file=sys.stderr)
    plan.warn_if_differs(stacklevel=stacklevel + 1)
    if config.prompt_kernel and not any(row.get("prompt_kernel") for row in report):
        _warn_no_prompt_kernel(config, plan, stacklevel + 1)
    config = dataclasses.replace(asked, kernel_choice=plan.chosen or None)  # saved with the folder
    if config.offload_from is not None:  # backbones not already offloaded at load (see offload.py)
        offload_backbone(layers, config.offload_from, config.offload_dir)
    hooks = _register_router_hooks(stack, router)
    exit_pass = install_exit_pass(stack, router)  # exit-mode one-token passes without the stack's glue
    if exit_pass is not None:
        hooks.append(exit_pass)
    head = model.get_output_embeddings()
    # the Linears of model.river_backbone_modules(): the kernel modes reroute only those
    backbones = [layer.backbone if isinstance(layer, RiverLayer) else layer for layer in layers]
    backbones += [head.backbone if isinstance(head, RiverHead) else head] if head is not None else []
    hooks += backbone_hooks([m for b in backbones for m in b.modules() if isinstance(m, nn.Linear)], router)
    hooks.append(model.register_load_state_dict_post_hook(_refresh_after_load))
    return {"river": router, "river_config": config, "river_build_seconds": build_seconds,
            "river_kernel_report": report,
            "_river_step_bytes": _step_bytes(layers, backbone_bytes, exit_bytes, head_bytes, exit_head_bytes),
            "_river_hooks": hooks, "_river_prints": _fingerprints(model, layers)}


def _prompt_copies_fit(layers, config: RiverConfig, stacklevel: int) -> bool:
    """Whether the prompt kernels' copies may be built: at most ``bits / 8`` bytes (plus an eighth
    for scales and zero points) per decoder-layer weight, within lossless mode's rule for its packed
    copy (:data:`~river_hf.river.lossless.PACK_MEMORY_SHARE` of the memory available now). Warns
    once when not."""
    weights = sum(m.weight.numel() for layer in layers for m in layer.modules() if isinstance(m, nn.Linear))
    need = weights * get_backend(config.backend).bits / 8 * 1.125
    available = lossless.available_memory_bytes()  # looked up on the module: tests stand in for it there
    if available is not None and need <= lossless.PACK_MEMORY_SHARE * available:
        return True
    have = "unknown" if available is None else f"{available / 1e9:.2f} GB"
    warnings.warn(f"prompt_kernel=True: the prompt kernels' copies would need up to {need / 1e9:.2f} GB, more than "
                  f"{lossless.PACK_MEMORY_SHARE:.0%} of the memory available ({have}); not built, the exit layers' prompt "
                  "passes run on their one-row kernels", UserWarning, stacklevel=stacklevel + 1)
    return False


def _warn_no_prompt_kernel(config: RiverConfig, plan: KernelPlan, stacklevel: int) -> None:
    """``prompt_kernel`` was asked for and no exit Linear got one: say why, once (nothing to say when
    every shape's one-row kernel measured faster at 128 rows, the choice working as meant)."""
    choice = get_backend(config.backend)
    measured_here = any(key.endswith(f"@{PROMPT_ROWS}rows") for key in plan.chosen)
    if not choice.measured:
        why = f"backend {choice.name!r} is not a measured choice (prompt kernels need int4 or int8)"
    elif not any(KERNELS[n].available("cpu") for names in PROMPT_KERNELS.values() for n in names):
        why = "no prompt kernel is available here (onnxruntime is not installed: pip install 'river-hf[ort]')"
    elif plan.tuner is None and not measured_here:
        why = "nothing was measured (RIVER_HF_AUTOTUNE=0 or tuner=False) and no saved choice names one"
    else:
        return
    warnings.warn(f"prompt_kernel=True has no effect: {why}; the exit layers' prompt passes run on their one-row "
                  "kernels", UserWarning, stacklevel=stacklevel + 1)


def _announce_measurement(tuner):
    """A KernelTuner ``on_measure`` callback: one line per shape measured (a first build on a machine
    spends most of its time there, seconds per shape, with the layer bar standing still)."""
    where = tuner.cache_file if tuner.cache_file is not None else "not kept"

    def say(shape: str, dtype: str, why: str) -> None:
        tqdm.write(f"[river-hf] timing the exit kernels for {shape} ({dtype}) on this machine: {why}; "
                   f"once per machine, cached in {where}", file=sys.stderr)

    return say


def _announce_prior():
    """A KernelTuner ``on_invalid`` callback: one line per shape whose timings were invalid, the
    prior ranking deciding (river_config.kernel_choice marks the shape ``#prior``)."""
    seen = set()

    def say(shape: str, why: str, features: str, kernel: str) -> None:
        if (shape, kernel) not in seen:
            seen.add((shape, kernel))
            tqdm.write(f"[river-hf] kernel timings for {shape} look invalid ({why}): using the prior ranking for "
                       f"{features} ({kernel}); measured again at the first load on a quiet machine "
                       f"(or now: `river-hf kernels --remeasure` when nothing else runs)", file=sys.stderr)

    return say


def _step_bytes(layers, backbone_bytes: list[int], exit_bytes: list[int], head_bytes: int,
                exit_head_bytes: int) -> dict[str, list[int]]:
    """Weight bytes one decode step reads when its exit layer is k, per strategy: backbone 0..k-1;
    then River's exit layers k..L-1 (state propagation: their K/V projections; the other
    baselines: nothing); and the exit head when the step left the backbone (k < L), else the
    original head."""
    L = len(layers)
    after_exit = {"river": exit_bytes, "state-propagation": [_kv_weight_bytes(layer.backbone) for layer in layers]}
    return {name: [sum(backbone_bytes[:k]) + sum(after_exit.get(name, [0] * L)[k:])
                   + (exit_head_bytes if k < L else head_bytes) for k in range(L + 1)]
            for name in STRATEGIES}


def refresh_exit_layers(model: nn.Module) -> list[str]:
    """Rebuild the exit copy of every backbone layer, and the exit head, whose weights changed
    since the copy was made; returns the names rebuilt (see
    :meth:`~river_hf.river.modeling.RiverForCausalLM.river_refresh_exit_layers`)."""
    prints = model.__dict__.get("_river_prints")
    if not prints:
        return []
    changed = [i for i, pairs in prints["layers"].items() if any(not fp.matches(getattr(m, name)) for m, name, fp in pairs)]
    head = prints["head"]
    head_changed = head is not None and not head[1].matches(head[0].weight)
    if not changed and not head_changed:
        return []
    config = model.river_config
    plan = KernelPlan(None, config.kernel_choice)
    _, layers = decoder_stack(model)
    rebuilt = []
    with _REBUILD_LOCK, torch.no_grad():
        for i in changed:
            layer = layers[i]
            exit_layer = build_exit_copy(layer.backbone, config, plan, report=[], prefix=f"layers.{i}.")
            layer.exit_layer = exit_layer.eval()
            prints["layers"][i] = _weight_prints(layer.backbone)
            rebuilt.append(f"layers.{i}")
        if head_changed:
            river_head = model.get_output_embeddings()
            river_head.exit_head, _ = get_backend(config.exit_head).build_linear(river_head.backbone, plan)
            prints["head"] = (river_head.backbone, WeightFingerprint(river_head.backbone.weight))
            rebuilt.append("lm_head")
    return rebuilt


def _refresh_after_load(model: nn.Module, incompatible_keys) -> None:
    """Load-state-dict post-hook of a River model: the exit copies follow the weights just loaded
    (``generate`` would rebuild them too; this also covers a plain ``forward``)."""
    refresh_exit_layers(model)


def build_exit_copy(backbone: nn.Module, config: RiverConfig, tuner, *, report: list | None = None,
                    prefix: str = "") -> nn.Module:
    """The exit copy of decoder layer ``backbone`` under ``config``: its Linears on the kernels of
    ``config.backend`` (``KernelChoice.build_layer``, ``tuner`` a :class:`KernelPlan`,
    a tuner or None), with q/k/v and gate/up stacked into one product each first when
    ``config.fuse_projections`` (:func:`river_hf.quant.fused.fuse_projections`; the stacked
    Linears are then measured and quantized as Linears of their own shape), and a prompt kernel
    per Linear where one measures faster when ``config.prompt_kernel``. An adapter layer of PEFT
    (a LoRA ``Linear`` around the original one) is copied as its base layer: the exit copy is
    made from the base weights, never holds an adapter. ``backbone`` is not modified; ``report``
    gets one row per built Linear. With ``config.exit_layer_impl`` ``fused`` / ``auto`` the copy is
    then wrapped in River's fused layer of its family where one supports it and passes its build
    check (:func:`river_hf.river.fused_layer.fused_exit_layer`, on the same kernel modules)."""
    exit_copy = _exit_copy(backbone, config, tuner, report, prefix)
    return fused_exit_layer(exit_copy, config.exit_layer_impl, prefix.rstrip("."))


def _exit_copy(backbone: nn.Module, config: RiverConfig, tuner, report: list | None, prefix: str) -> nn.Module:
    """The architecture's exit copy of ``backbone`` (:func:`build_exit_copy` before the fused layer)."""
    choice = get_backend(config.backend)
    fuse = config.fuse_projections and fused_groups(backbone)
    if not fuse and not _adapter_layers(backbone):
        return _own_forwards(choice.build_layer(backbone, tuner, report=report, prefix=prefix,
                                                prompt=config.prompt_kernel))
    # a copy of the layer's structure that shares its tensors (build_layer copies it for real), in
    # which adapters give way to their base layers and the siblings are replaced by one stacked
    # Linear each: no second copy of the weights
    memo = {id(t): t for t in (*backbone.parameters(), *backbone.buffers())}
    shell = copy.deepcopy(backbone, memo)
    for name, adapter in _adapter_layers(shell):
        parent, _, child = name.rpartition(".")
        setattr(shell.get_submodule(parent) if parent else shell, child, adapter.get_base_layer())
    if config.fuse_projections and fused_groups(shell):
        fuse_projections(shell)
    return _own_forwards(choice.build_layer(shell, tuner, report=report, prefix=prefix, prompt=config.prompt_kernel))


def _own_forwards(exit_copy: nn.Module) -> nn.Module:
    """``exit_copy`` running the architecture's own torch code in every module: a Hub kernel that
    transformers' ``kernelize`` put on the backbone layer (:func:`river_hf.compat.architecture_forwards`)
    reads ``nn.Linear`` weights, which the exit copy's quantized Linears do not have."""
    architecture_forwards(exit_copy)
    return exit_copy


def _adapter_layers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, layer)`` of the outermost adapter layers in ``module``: PEFT's tuner layers, told by
    their ``get_base_layer()`` method and ``base_layer`` submodule (peft is not imported)."""
    found, inside = [], set()
    for name, m in module.named_modules():
        if id(m) in inside:
            continue
        if callable(getattr(m, "get_base_layer", None)) and "base_layer" in m._modules:
            found.append((name, m))
            inside.update(id(sub) for sub in m.modules())
    return found


def _weight_prints(module: nn.Module) -> list:
    """``(owner, name, fingerprint)`` of every parameter of ``module`` (Linear weights and biases,
    norm weights, ...): what its exit copy is made of. An adapter's base layer counts, the
    adapter's own parameters (LoRA's A and B) do not: they are not in the exit copy."""
    skip = set()
    for _, adapter in _adapter_layers(module):
        skip.update(id(sub) for sub in adapter.modules())
        skip.difference_update(id(sub) for sub in adapter.get_base_layer().modules())
    return [(m, name, WeightFingerprint(p)) for m in module.modules() if id(m) not in skip
            for name, p in m.named_parameters(recurse=False)]


def _fingerprints(model: nn.Module, layers) -> dict:
    """:class:`~river_hf.quant.dense.WeightFingerprint` of every weight the exit copies were built
    from: ``{"layers": {i: [(module, name, print), ...]}, "head": (linear, print) or None}`` (offloaded
    backbones are left out: their weights are not in memory to change)."""
    prints: dict = {"layers": {}, "head": None}
    for i, layer in enumerate(layers):
        if isinstance(layer, RiverLayer) and not is_offloaded(layer.backbone):
            prints["layers"][i] = _weight_prints(layer.backbone)
    head = model.get_output_embeddings()
    if isinstance(head, RiverHead) and head.exit_head is not None:
        prints["head"] = (head.backbone, WeightFingerprint(head.backbone.weight))
    return prints


def disable_river(model: nn.Module) -> nn.Module:
    """Undo :func:`enable_river`, in place, and return the same model object.

    The model gets back the architecture's own class, its original decoder layers and LM head
    (the very module objects River kept as backbones, weights untouched), and loses River's
    forward hooks and attributes; it then generates exactly the tokens it generated before
    ``enable_river``. The exit layers are dropped. Backbone layers that River offloaded
    (``offload_from``) stay offloaded through accelerate's hooks, which compute the same.

    Raises:
        RiverError: River is not enabled on ``model``.
    """
    if not is_river_class(type(model)):
        raise RiverError(f"River is not enabled on this {type(model).__name__}; nothing to disable")
    _, layers = decoder_stack(model)
    for hook in model.__dict__.get("_river_hooks", ()):
        hook.remove()
    for i, layer in enumerate(layers):
        if isinstance(layer, RiverLayer):
            layers[i] = layer.backbone
    head = model.get_output_embeddings()
    if isinstance(head, RiverHead):
        model.set_output_embeddings(head.backbone)
    model.__class__ = base_class(type(model))
    for name in RIVER_ATTRIBUTES:
        model.__dict__.pop(name, None)
    return model


def _kv_weight_bytes(layer: nn.Module) -> int:
    """Weight bytes of a decoder layer's K and V projections (what state propagation reads)."""
    attn = getattr(layer, "self_attn", None)
    return sum(linear_weight_bytes(getattr(attn, name)) for name in ("k_proj", "v_proj") if hasattr(attn, name))


def _wrap_layers(layers: nn.ModuleList, router: RiverRouter, config: RiverConfig, tuner, report: list,
                 progress: bool) -> tuple[list[int], list[int]]:
    """Build each layer's exit copy and put a RiverLayer in its place; returns the weight bytes of
    each backbone layer and of each exit layer."""
    choice = get_backend(config.backend)
    backbone_bytes, exit_bytes = [], []

    def build(layer, i):
        return build_exit_copy(layer, config, tuner, report=report, prefix=f"layers.{i}.")

    with torch.no_grad():
        for i in tqdm(range(len(layers)), desc=f"building exit layers ({choice.name}, {choice.bits}-bit)",
                      disable=not progress, unit="layer"):
            backbone = layers[i]
            exit_layer = build_exit_layer(lambda layer: build(layer, i), backbone)  # reads an offloaded backbone in
            exit_layer.eval()
            backbone_bytes.append(linear_weight_bytes(backbone))
            exit_bytes.append(linear_weight_bytes(exit_layer))
            layers[i] = RiverLayer(backbone, exit_layer, router, i)
    router.layers = layers  # the live list: RiverLayer._stack reads the layers after it
    return backbone_bytes, exit_bytes


def _wrap_head(model: nn.Module, router: RiverRouter, config: RiverConfig, tuner, report: list) -> tuple[int, int]:
    """Put a RiverHead (original head + exit head) in place of the LM head; returns the weight bytes
    of the original head and of the head exited steps read."""
    head = model.get_output_embeddings()
    if head is None:
        return 0, 0
    head_bytes = linear_weight_bytes(head)
    if config.exit_head is None or not isinstance(head, nn.Linear):
        exit_head = None
    else:
        with torch.no_grad():
            exit_head, row = get_backend(config.exit_head).build_linear(head, tuner)
        report.append({"name": "lm_head (exit head)", **row})
    model.set_output_embeddings(RiverHead(head, exit_head, router))
    return head_bytes, head_bytes if exit_head is None else linear_weight_bytes(exit_head)


@torch.compiler.disable
def _refuse_compile() -> None:
    """Raises RiverError; called while torch.compile traces a River forward pass. Excluded from
    tracing, so it runs (and raises) for real instead of being folded into a graph break."""
    raise RiverError(
        "River models cannot be compiled with torch.compile: the exit decision after each backbone layer is "
        "data-dependent Python control flow; run the model uncompiled (a static cache works uncompiled)"
    )


def _register_router_hooks(stack: nn.Module, router: RiverRouter) -> list:
    """Tell the router where each forward pass of the decoder stack begins and ends; returns the
    hook handles."""

    def new_tokens(args, kwargs) -> tuple[int, int]:
        x = kwargs.get("input_ids")
        if x is None:
            x = kwargs.get("inputs_embeds")
        if x is None and args:
            x = args[0]
        return (x.shape[0], x.shape[1]) if isinstance(x, torch.Tensor) and x.dim() >= 2 else (1, 1)

    def begin(module, args, kwargs):
        if torch.compiler.is_compiling():
            _refuse_compile()
        batch, tokens = new_tokens(args, kwargs)
        router.begin(kwargs.get("attention_mask"), tokens, cache_of(kwargs), batch=batch)

    def end(module, args, kwargs, output):
        batch, tokens = new_tokens(args, kwargs)
        router.end(batch, tokens, cache_of(kwargs))

    return [stack.register_forward_pre_hook(begin, with_kwargs=True),
            stack.register_forward_hook(end, with_kwargs=True)]
