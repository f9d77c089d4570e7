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
from .layer import BACKBONE_ONLY, EXIT_ONLY, ROUTE, RiverLayer, RiverRouter
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
        backend: quantization backend of the exit layers (see :mod:`river_hf.quant`).
        rules: explicit exit-rule list (``ExitRuleList.to_list()``); when set it replaces the
            rules built from ``tau`` and ``min_layer``.
        offload_from: first backbone layer kept off the compute device (None: no offload).
        offload_dir: folder for disk offload on CPU-only machines (None: a temporary folder).
    """

    tau: float = 0.95
    min_layer: int = 1
    backend: str = "quanto"
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
        return d

    @classmethod
    def from_dict(cls, d: dict) -> RiverConfig:
        """Raises RiverError for unknown keys or invalid values."""
        if not isinstance(d, dict):
            raise RiverError(f"River settings must be a JSON object, got {type(d).__name__}")
        d = {k: v for k, v in d.items() if k != "quantization"}
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
        start = time.perf_counter()
        out = super().generate(*args, **kwargs)
        self.river_stats = self.river_summary(time.perf_counter() - start)
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
            seconds, tokens_per_s: wall time of the call and new tokens per second.
            weight_bytes_per_token: mean weight bytes read per decode step (bytes).
            bandwidth_gb_s: weight_bytes_per_token x decode steps per second / 1e9 (GB/s).
        """
        log = self.river.log
        L = self.river.num_layers
        decode = [e for (_, _, e) in log[1:]]
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
            if decode and seconds > 0:
                stats["bandwidth_gb_s"] = stats["weight_bytes_per_token"] * len(log) / seconds / 1e9
        return stats


_CLASS_CACHE: dict[type, type] = {}


def _river_class(cls: type) -> type:
    if issubclass(cls, RiverMixin):
        return cls
    if cls not in _CLASS_CACHE:
        _CLASS_CACHE[cls] = type(f"River{cls.__name__}", (RiverMixin, cls), {"__module__": cls.__module__})
    return _CLASS_CACHE[cls]


def enable_river(
    model: nn.Module,
    tau: float | None = None,
    *,
    min_layer: int | None = None,
    backend: str | None = None,
    rules: ExitRuleList | list | None = None,
    config: RiverConfig | None = None,
    allow_untested: bool = False,
    progress: bool = True,
) -> nn.Module:
    """Turn a loaded transformers causal LM into a River model, in place, and return it.

    Args:
        model: a ``*ForCausalLM`` of a supported family (:data:`SUPPORTED_MODEL_TYPES`).
        tau: threshold τ; None takes the per-model default from ``configs/``.
        min_layer, backend: override the defaults (see :class:`RiverConfig`).
        rules: an explicit :class:`ExitRuleList` (or its ``to_list()`` form) instead of tau/min_layer.
        config: a whole :class:`RiverConfig`; the other keyword arguments override its fields.
        allow_untested: try model types outside :data:`SUPPORTED_MODEL_TYPES`.
        progress: show a progress bar while building the exit layers.

    Returns:
        The same model object, whose class now has River's mixin in front.

    Raises:
        RiverError: River already enabled, unsupported architecture, invalid settings.
    """
    from tqdm.auto import tqdm

    if isinstance(model, RiverMixin):
        raise RiverError("River is already enabled on this model; use model.set_river_tau(tau) to change tau")
    model_type = getattr(model.config.get_text_config(decoder=True), "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES and not allow_untested:
        raise RiverError(
            f"model type {model_type!r} is not supported by River (supported: {', '.join(SUPPORTED_MODEL_TYPES)}); "
            "pass allow_untested=True to try the generic per-layer routing anyway"
        )
    if config is None:
        config = default_config(getattr(model.config, "_name_or_path", None), model_type)
    overrides = {"tau": tau, "min_layer": min_layer, "backend": backend}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if rules is not None:
        overrides["rules"] = rules.to_list() if isinstance(rules, ExitRuleList) else list(rules)
    config = dataclasses.replace(config, **overrides)

    stack, layers = _decoder_stack(model)
    router = RiverRouter(config.build_rules(), len(layers))
    quant = get_backend(config.backend)
    start = time.perf_counter()
    backbone_bytes, exit_bytes = [], []
    with torch.no_grad():
        for i in tqdm(range(len(layers)), desc=f"building exit layers ({quant.name}, {quant.bits}-bit)",
                      disable=not progress, unit="layer"):
            backbone = layers[i]
            exit_layer = build_exit_layer(quant, backbone)  # also reads an offloaded backbone in
            exit_layer.eval()
            backbone_bytes.append(linear_weight_bytes(backbone))
            exit_bytes.append(linear_weight_bytes(exit_layer))
            layers[i] = RiverLayer(backbone, exit_layer, router, i)
    build_seconds = time.perf_counter() - start
    if config.offload_from is not None:  # backbones not already offloaded at load (see offload.py)
        offload_backbone(layers, config.offload_from, config.offload_dir)

    def _begin(module, args, kwargs):
        router.begin(kwargs.get("attention_mask"))

    def _end(module, args, kwargs, output):
        x = kwargs.get("input_ids")
        if x is None:
            x = kwargs.get("inputs_embeds")
        if x is None and args:
            x = args[0]
        batch, tokens = (x.shape[0], x.shape[1]) if isinstance(x, torch.Tensor) and x.dim() >= 2 else (1, 1)
        router.end(batch, tokens, kwargs.get("cache", kwargs.get("past_key_values")))

    stack.register_forward_pre_hook(_begin, with_kwargs=True)
    stack.register_forward_hook(_end, with_kwargs=True)

    head_bytes = linear_weight_bytes(model.get_output_embeddings()) if model.get_output_embeddings() else 0
    # Weight bytes one decode step reads when its exit layer is k: backbone 0..k-1, exit k..L-1, head.
    step_bytes = [sum(backbone_bytes[:k]) + sum(exit_bytes[k:]) + head_bytes for k in range(len(layers) + 1)]

    model.__class__ = _river_class(type(model))
    model.river = router
    model.river_config = config
    model.river_build_seconds = build_seconds
    model._river_step_bytes = step_bytes
    model.river_stats = {}
    return model


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
        river_config: RiverConfig | None = None,
        offload_from: int | None = None,
        progress: bool = True,
        **from_pretrained_kwargs,
    ):
        """Load ``name_or_key`` (model key, Hub id or folder) and enable River on it.

        Args:
            name_or_key: see :func:`river_hf.models.resolve`.
            tau, min_layer, backend, river_config: as for :func:`enable_river`; defaults come
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
        return enable_river(model, tau, min_layer=min_layer, backend=backend, config=river_config, progress=progress)
