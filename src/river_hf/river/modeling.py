"""River-LLM on a transformers causal LM: ``enable_river``, ``RiverForCausalLM`` and ``RiverConfig``.

``enable_river(model, tau=...)`` builds a quantized exit copy of every decoder layer, wraps each
layer in a :class:`~river_hf.river.layer.RiverLayer`, and gives the model River's mixin in front
of its own class (``LlamaForCausalLM`` becomes ``RiverLlamaForCausalLM``), so ``generate``,
``pipeline`` and every generation option work as before. After each ``generate`` the model's
``river_stats`` dict holds the exit statistics and speed of that call.

Source: River-LLM (exit layers built by quantizing each decoder layer; KV share; state transition
similarity compared with one threshold tau, sequence-level at prefill and token-level at decode).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from pathlib import Path

import torch
from torch import nn

from ..errors import RiverError
from ..quant import get_backend, linear_weight_bytes
from .cache import RiverCache
from .controllers import ExitRuleList, MinLayerRule, StateTransitionSimilarityRule, rules_from_config
from .layer import BACKBONE_ONLY, EXIT_ONLY, PREFILL_POLICIES, ROUTE, RiverHead, RiverLayer, RiverRouter
from .offload import build_exit_layer, loading_kwargs, offload_backbone
from .serialization import RiverPretrainedMixin, check_base_weights, saved_river_config

__all__ = ["RiverConfig", "RiverForCausalLM", "enable_river", "default_config", "SUPPORTED_MODEL_TYPES"]

#: model_type values whose decoder layers River has been tested on (tests/test_architectures.py).
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral", "gemma3_text")

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


@dataclasses.dataclass
class RiverConfig:
    """River settings; round-trips through ``to_dict``/``from_dict`` (and so through config.json).

    Attributes:
        tau: state-transition-similarity threshold τ; the rest of the layers run as exit layers
            once a backbone layer's similarity exceeds it. ``tau > 1`` never exits (exactness).
        min_layer: backbone layers that always run before an exit is considered (>= 1).
        backend: kernel choice of the exit layers' Linears (:func:`river_hf.quant.get_backend`):
            ``int8`` / ``int4`` (fastest kernel of that width per shape, measured on this machine),
            or one kernel (``torch-int8``, ``torch-int4``, ``quanto-int4`` = ``quanto``,
            ``quanto-int8``, ``copy``).
        exit_head: kernel choice of the *exit head*, a quantized copy of the LM head that serves
            every step whose forward pass left the backbone (same names as ``backend``); None: the
            original head serves every step. The backbone path always keeps the original head.
        prefill: ``route`` (the prompt pass takes River's sequence-level exit decision) or
            ``backbone`` (the prompt runs on the backbone: exact KV for the prompt; only decode
            steps exit).
        rules: explicit exit-rule list (``ExitRuleList.to_list()``); when set it replaces the
            rules built from ``tau`` and ``min_layer``.
        offload_from: first backbone layer kept off the compute device (None: no offload).
        offload_dir: folder for disk offload on CPU-only machines (None: a temporary folder).
    """

    tau: float = 0.95
    min_layer: int = 1
    backend: str = "quanto"
    exit_head: str | None = None
    prefill: str = "route"
    rules: list[dict] | None = None
    offload_from: int | None = None
    offload_dir: str | None = None

    def __post_init__(self):
        try:
            self.tau = float(self.tau)
        except (TypeError, ValueError):
            raise RiverError(f"tau must be a number (e.g. 0.95; above 1 never exits), got {self.tau!r}") from None
        if math.isnan(self.tau):
            raise RiverError("tau must be a number, got NaN")
        if not isinstance(self.min_layer, int) or self.min_layer < 1:
            raise RiverError(f"min_layer must be an integer >= 1, got {self.min_layer!r}")
        get_backend(self.backend)
        if self.exit_head is not None:
            get_backend(self.exit_head)
        if self.prefill not in PREFILL_POLICIES:
            raise RiverError(f"prefill must be one of {', '.join(PREFILL_POLICIES)}, got {self.prefill!r}")
        if self.offload_from is not None and (not isinstance(self.offload_from, int) or self.offload_from < 0):
            raise RiverError(f"offload_from must be a layer index >= 0 or None, got {self.offload_from!r}")
        if self.rules is not None:
            try:
                rules_from_config(self.rules)
            except (TypeError, ValueError) as e:
                raise RiverError(f"invalid River exit rules {self.rules!r}: {e}") from None

    def build_rules(self) -> ExitRuleList:
        if self.rules is not None:
            return rules_from_config(self.rules)
        return ExitRuleList([MinLayerRule(self.min_layer), StateTransitionSimilarityRule(self.tau)])

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["rules"] = self.build_rules().to_list()
        d["quantization"] = get_backend(self.backend).to_dict()
        if self.exit_head is not None:
            d["exit_head_quantization"] = get_backend(self.exit_head).to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> RiverConfig:
        """Raises RiverError for unknown keys or invalid values."""
        if not isinstance(d, dict):
            raise RiverError(f"River settings must be a JSON object, got {type(d).__name__}")
        d = {k: v for k, v in d.items() if k not in ("quantization", "exit_head_quantization")}
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise RiverError(f"unknown River settings {sorted(unknown)}; known: {[f.name for f in dataclasses.fields(cls)]}")
        return cls(**d)


def default_config(name_or_key: str | None = None, model_type: str | None = None) -> RiverConfig:
    """Per-model defaults from ``configs/<key>.json``, else ``configs/default.json``.

    ``name_or_key`` may be a model key, its Hub id, or a folder whose name is a key (the cache
    folders made by :func:`river_hf.models.resolve` are).
    """
    from ..models import REGISTRY

    candidates = []
    if name_or_key:
        base = Path(str(name_or_key).rstrip("/")).name
        candidates += [name_or_key, base]
        candidates += [e.key for e in REGISTRY.values() if e.hub_id.lower() == str(name_or_key).lower()]
    if model_type:
        candidates.append(f"default-{model_type}")
    candidates.append("default")
    for c in candidates:
        path = CONFIG_DIR / f"{c}.json"
        if path.is_file():
            return RiverConfig.from_dict(json.loads(path.read_text()))
    return RiverConfig()


def _decoder_stack(model: nn.Module) -> tuple[nn.Module, nn.ModuleList]:
    """The module that runs the decoder loop, and its list of decoder layers."""
    config = model.config.get_text_config(decoder=True)
    n = getattr(config, "num_hidden_layers", None)
    base = model.get_decoder() if hasattr(model, "get_decoder") else None
    if base is not None and isinstance(getattr(base, "layers", None), nn.ModuleList):
        return base, base.layers
    for module in model.modules():
        layers = getattr(module, "layers", None)
        if isinstance(layers, nn.ModuleList) and len(layers) == n:
            return module, layers
    raise RiverError(
        f"cannot find the decoder layers of {type(model).__name__}; River supports model types "
        f"{', '.join(SUPPORTED_MODEL_TYPES)}"
    )


class RiverMixin(RiverPretrainedMixin):
    """Put in front of a causal-LM class by :func:`enable_river`. Adds River's generate bookkeeping,
    and ``save_pretrained``/``from_pretrained`` of River folders (:mod:`.serialization`).

    Attributes set by ``enable_river``:
        river: the :class:`RiverRouter` (rules, mode, per-pass log).
        river_config: the :class:`RiverConfig` in force.
        river_build_seconds: wall time spent building the exit layers (seconds).
        river_stats: dict describing the last ``generate`` call (see :meth:`river_summary`).
    """

    def set_river_tau(self, tau: float) -> None:
        """Change τ (and rebuild the rule list) without rebuilding exit layers."""
        self.river_config = dataclasses.replace(self.river_config, tau=tau, rules=None)
        self.river.rules = self.river_config.build_rules()

    @contextlib.contextmanager
    def river_mode(self, mode: str):
        """Temporarily run ``"backbone"`` only (the unmodified model), ``"exit"`` only (the fully
        quantized model) or ``"route"`` (River)."""
        if mode not in (ROUTE, BACKBONE_ONLY, EXIT_ONLY):
            raise ValueError(f"mode must be one of route, backbone, exit; got {mode!r}")
        old, self.river.mode = self.river.mode, mode
        try:
            yield self
        finally:
            self.river.mode = old

    def generate(self, *args, **kwargs):
        self.river.log.clear()
        self._river_generate_start = time.perf_counter()
        out = super().generate(*args, **kwargs)
        self.river_stats = self.river_summary(time.perf_counter() - self._river_generate_start)
        return out

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        user_cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
        if (
            user_cache is None
            and generation_config.use_cache is not False
            and generation_config.cache_implementation in (None, "dynamic")
        ):
            model_kwargs["cache"] = RiverCache(config=self.config.get_text_config(decoder=True))
            return
        return super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)

    def river_summary(self, seconds: float | None = None) -> dict:
        """Statistics of the forward passes since the last ``generate`` started.

        Returns a dict with:
            num_layers: L.
            prefill_exit_layer: exit layer of the first pass (prefill).
            decode_steps: number of decode passes.
            mean_exit_layer: mean over decode steps of the exit layer (= backbone layers run;
                L means no exit).
            exit_fraction: fraction of decode steps that left the backbone early.
            exit_layer_counts: list of L+1 counts; entry k = decode steps whose exit layer is k.
            new_tokens: generated tokens (batch x passes).
            seconds, tokens_per_s: wall time of the call (s) and new tokens per second over it.
            prefill_seconds: from the call's start to the end of the first forward pass (TTFT, s).
            decode_seconds, decode_tokens_per_s: time of the decode passes (s) and their tokens per
                second (batch x decode steps / decode_seconds): decode speed without the prefill.
            weight_bytes_per_token: mean weight bytes read per decode step (bytes).
            bandwidth_gb_s: weight_bytes_per_token x decode steps per second / 1e9 (GB/s), over
                the decode passes.
        """
        log = self.river.log
        L = self.river.num_layers
        decode = [entry[2] for entry in log[1:]]
        counts = [0] * (L + 1)
        for e in decode:
            counts[e] += 1
        batch = log[0][0] if log else 0
        new_tokens = batch * len(log)
        stats = {
            "num_layers": L,
            "prefill_exit_layer": log[0][2] if log else None,
            "decode_steps": len(decode),
            "mean_exit_layer": (sum(decode) / len(decode)) if decode else None,
            "exit_fraction": (sum(e < L for e in decode) / len(decode)) if decode else None,
            "exit_layer_counts": counts,
            "new_tokens": new_tokens,
        }
        if decode:
            stats["weight_bytes_per_token"] = sum(self._river_step_bytes[e] for e in decode) / len(decode)
        if seconds is not None:
            stats["seconds"] = seconds
            stats["tokens_per_s"] = new_tokens / seconds if seconds > 0 else None
            start = getattr(self, "_river_generate_start", None)
            if log and start is not None:
                stats["prefill_seconds"] = log[0][3] - start
            if decode:
                decode_seconds = log[-1][3] - log[0][3]
                stats["decode_seconds"] = decode_seconds
                if decode_seconds > 0:
                    stats["decode_tokens_per_s"] = batch * len(decode) / decode_seconds
                    stats["bandwidth_gb_s"] = stats["weight_bytes_per_token"] * len(decode) / decode_seconds / 1e9
        return stats

    def river_kernels(self) -> list[dict]:
        """Which kernel each group of exit Linears got: one dict per (shape, kernel) with ``shape``
        (``"in x out"``), ``kernel``, ``count`` (Linears), ``names`` (the first few), ``us_per_call``
        (the tuner's cold-cache one-token timings of every candidate, µs; absent when only one
        kernel was allowed) and ``relative_error`` (mean over the group of ||copy(x) - W x|| /
        ||W x|| on the real weights)."""
        groups: dict[tuple, dict] = {}
        for row in self.river_kernel_report:
            where = "exit head" if row["name"].startswith("lm_head") else "exit layers"
            key = (where, row["in_features"], row["out_features"], row["kernel"])
            g = groups.setdefault(key, {"where": where, "shape": f"{row['in_features']}x{row['out_features']}",
                                        "kernel": row["kernel"], "count": 0, "names": [], "errors": []})
            g["count"] += 1
            g["errors"].append(row["relative_error"])
            if len(g["names"]) < 3:
                g["names"].append(row["name"])
            if "us_per_call" in row:
                g["us_per_call"] = row["us_per_call"]
        out = []
        for g in groups.values():
            errors = g.pop("errors")
            g["relative_error"] = sum(errors) / len(errors)
            out.append(g)
        return out


_CLASS_CACHE: dict[type, type] = {}


def _river_class(cls: type) -> type:
    if issubclass(cls, RiverMixin):
        return cls
    if cls not in _CLASS_CACHE:
        _CLASS_CACHE[cls] = type(f"River{cls.__name__}", (RiverMixin, cls), {"__module__": cls.__module__})
    return _CLASS_CACHE[cls]


_KEEP = object()  # "not given" for settings where None is a value (exit_head=None: no exit head)


def enable_river(
    model: nn.Module,
    tau: float | None = None,
    *,
    min_layer: int | None = None,
    backend: str | None = None,
    exit_head=_KEEP,
    prefill: str | None = None,
    rules: ExitRuleList | list | None = None,
    config: RiverConfig | None = None,
    allow_untested: bool = False,
    progress: bool = True,
    tuner=None,
) -> nn.Module:
    """Turn a loaded transformers causal LM into a River model, in place, and return it.

    Args:
        model: a ``*ForCausalLM`` of a supported family (:data:`SUPPORTED_MODEL_TYPES`).
        tau: threshold τ; None takes the per-model default from ``configs/``.
        min_layer, backend, exit_head, prefill: override the defaults (see :class:`RiverConfig`).
        rules: an explicit :class:`ExitRuleList` (or its ``to_list()`` form) instead of tau/min_layer.
        config: a whole :class:`RiverConfig`; the other keyword arguments override its fields.
        allow_untested: try model types outside :data:`SUPPORTED_MODEL_TYPES`.
        progress: show a progress bar while building the exit layers.
        tuner: a :class:`river_hf.quant.KernelTuner` for the ``int8``/``int4`` choices (None: the
            default one, cached under the cache dir; ``False``: no measurement, first candidate).

    Returns:
        The same model object, whose class now has River's mixin in front. ``model.river_kernels()``
        tells which kernel each exit Linear (and the exit head) got.

    Raises:
        RiverError: River already enabled, unsupported architecture, invalid settings.
    """
    _check_supported(model, allow_untested)
    config = _settings(model, config, tau=tau, min_layer=min_layer, backend=backend, exit_head=exit_head,
                       prefill=prefill, rules=rules)
    if tuner is None:
        from ..quant import default_tuner

        tuner = default_tuner()
    stack, layers = _decoder_stack(model)
    router = RiverRouter(config.build_rules(), len(layers), prefill=config.prefill)
    report: list[dict] = []
    start = time.perf_counter()
    backbone_bytes, exit_bytes = _wrap_layers(layers, router, config, tuner or None, report, progress)
    head_bytes, exit_head_bytes = _wrap_head(model, router, config, tuner or None, report)
    build_seconds = time.perf_counter() - start
    if config.offload_from is not None:  # backbones not already offloaded at load (see offload.py)
        offload_backbone(layers, config.offload_from, config.offload_dir)
    _register_router_hooks(stack, router)

    # Weight bytes one decode step reads when its exit layer is k: backbone 0..k-1, exit k..L-1, and
    # the exit head when the step left the backbone (k < L), else the original head.
    L = len(layers)
    step_bytes = [sum(backbone_bytes[:k]) + sum(exit_bytes[k:]) + (exit_head_bytes if k < L else head_bytes)
                  for k in range(L + 1)]
    model.__class__ = _river_class(type(model))
    model.river = router
    model.river_config = config
    model.river_build_seconds = build_seconds
    model.river_kernel_report = report
    model._river_step_bytes = step_bytes
    model.river_stats = {}
    return model


def _check_supported(model: nn.Module, allow_untested: bool) -> None:
    if isinstance(model, RiverMixin):
        raise RiverError("River is already enabled on this model; use model.set_river_tau(tau) to change tau")
    model_type = getattr(model.config.get_text_config(decoder=True), "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES and not allow_untested:
        raise RiverError(
            f"model type {model_type!r} is not supported by River (supported: {', '.join(SUPPORTED_MODEL_TYPES)}); "
            "pass allow_untested=True to try the generic per-layer routing anyway"
        )


def _settings(model, config: RiverConfig | None, *, rules, exit_head, **fields) -> RiverConfig:
    """The per-model default (or ``config``) with the given fields overriding it."""
    if config is None:
        model_type = getattr(model.config.get_text_config(decoder=True), "model_type", None)
        config = default_config(getattr(model.config, "_name_or_path", None), model_type)
    overrides = {k: v for k, v in fields.items() if v is not None}
    if exit_head is not _KEEP:
        overrides["exit_head"] = exit_head
    if rules is not None:
        overrides["rules"] = rules.to_list() if isinstance(rules, ExitRuleList) else list(rules)
    return dataclasses.replace(config, **overrides)


def _wrap_layers(layers: nn.ModuleList, router: RiverRouter, config: RiverConfig, tuner, report: list,
                 progress: bool) -> tuple[list[int], list[int]]:
    """Build each layer's exit copy and put a RiverLayer in its place; returns the weight bytes of
    each backbone layer and of each exit layer."""
    from tqdm.auto import tqdm

    choice = get_backend(config.backend)
    backbone_bytes, exit_bytes = [], []

    def build(layer, i):
        return choice.build_layer(layer, tuner, report=report, prefix=f"layers.{i}.")

    with torch.no_grad():
        for i in tqdm(range(len(layers)), desc=f"building exit layers ({choice.name}, {choice.bits}-bit)",
                      disable=not progress, unit="layer"):
            backbone = layers[i]
            exit_layer = build_exit_layer(lambda layer: build(layer, i), backbone)  # reads an offloaded backbone in
            exit_layer.eval()
            backbone_bytes.append(linear_weight_bytes(backbone))
            exit_bytes.append(linear_weight_bytes(exit_layer))
            layers[i] = RiverLayer(backbone, exit_layer, router, i)
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


def _register_router_hooks(stack: nn.Module, router: RiverRouter) -> None:
    """Tell the router where each forward pass of the decoder stack begins and ends."""

    def new_tokens(args, kwargs) -> tuple[int, int]:
        x = kwargs.get("input_ids")
        if x is None:
            x = kwargs.get("inputs_embeds")
        if x is None and args:
            x = args[0]
        return (x.shape[0], x.shape[1]) if isinstance(x, torch.Tensor) and x.dim() >= 2 else (1, 1)

    def begin(module, args, kwargs):
        router.begin(kwargs.get("attention_mask"), new_tokens(args, kwargs)[1])

    def end(module, args, kwargs, output):
        batch, tokens = new_tokens(args, kwargs)
        router.end(batch, tokens, kwargs.get("cache", kwargs.get("past_key_values")))

    stack.register_forward_pre_hook(begin, with_kwargs=True)
    stack.register_forward_hook(end, with_kwargs=True)


class RiverForCausalLM:
    """Factory, in the manner of ``AutoModelForCausalLM``: loads a causal LM and enables River.

    The returned object is the architecture's own class with River's mixin in front (e.g.
    ``RiverQwen2ForCausalLM``), so it is a ``PreTrainedModel`` with the standard ``generate``.
    """

    @classmethod
    def from_pretrained(
        cls,
        name_or_key: str,
        *,
        tau: float | None = None,
        min_layer: int | None = None,
        backend: str | None = None,
        exit_head=_KEEP,
        prefill: str | None = None,
        river_config: RiverConfig | None = None,
        offload_from: int | None = None,
        progress: bool = True,
        **from_pretrained_kwargs,
    ):
        """Load ``name_or_key`` (model key, Hub id or folder) and enable River on it.

        Args:
            name_or_key: see :func:`river_hf.models.resolve`.
            tau, min_layer, backend, exit_head, prefill, river_config: as for :func:`enable_river`; defaults come
                from the folder's saved River settings (config.json ``"river"``), else from
                ``configs/<key>.json``.
            offload_from: keep backbone layers ``offload_from``.. off the compute device
                (:mod:`.offload`); they are never resident, not even during the load.
            **from_pretrained_kwargs: passed to ``AutoModelForCausalLM.from_pretrained``
                (``dtype``, ``device_map``, ...).

        Raises:
            RiverError: unknown model key, unsupported architecture, invalid settings, a River
                folder without its base weights.
        """
        from transformers import AutoConfig, AutoModelForCausalLM

        from ..models import resolve

        path = resolve(name_or_key, progress=progress)
        check_base_weights(path)
        if river_config is None:
            river_config = saved_river_config(path)
        if river_config is None:
            try:
                model_type = AutoConfig.from_pretrained(path).get_text_config(decoder=True).model_type
            except Exception:
                model_type = None
            river_config = default_config(name_or_key, model_type)
        if offload_from is not None:
            river_config = dataclasses.replace(river_config, offload_from=offload_from)
        from_pretrained_kwargs = loading_kwargs(path, river_config, from_pretrained_kwargs)
        model = AutoModelForCausalLM.from_pretrained(path, **from_pretrained_kwargs)
        model.eval()
        return enable_river(model, tau, min_layer=min_layer, backend=backend, exit_head=exit_head, prefill=prefill,
                            config=river_config, progress=progress)
