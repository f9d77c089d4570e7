"""River-LLM on a transformers causal LM: ``RiverForCausalLM``, ``enable_river`` and ``disable_river``.

``enable_river(model, tau=...)`` builds a quantized exit copy of every decoder layer, wraps each
layer in a :class:`~river_hf.river.layer.RiverLayer`, and gives the model River's class in front
of its own (``LlamaForCausalLM`` becomes ``RiverLlamaForCausalLM``, a subclass of both
:class:`RiverForCausalLM` and ``LlamaForCausalLM``), so ``generate``, ``pipeline`` and every
generation option work as before. After each ``generate`` the model's ``river_stats`` dict holds
the exit statistics and speed of that call. ``disable_river(model)`` undoes it.

Entry points, in the manner of ``AutoModelForCausalLM``: ``RiverForCausalLM.from_pretrained``
(model key, Hub id or folder; also what a saved River folder's ``auto_map`` calls) and
``RiverForCausalLM.from_config`` (a fresh model from a config). ``isinstance(m, RiverForCausalLM)``
tells a River model.

This module holds the class, ``generate`` and the entry points; the work is done in its
neighbours: :mod:`.loading` (the checkpoint side of ``from_pretrained``), :mod:`.build` (the exit
copies, hooks, step bytes and fingerprints; ``disable_river`` lives there and is re-exported),
:mod:`.settings` (τ, mode and strategy methods), :mod:`.stats` (``river_stats``) and
:mod:`.lossless_generate` (lossless mode's entry into transformers' assisted decoding).

Source: River-LLM (exit layers built by quantizing each decoder layer; KV share; state transition
similarity compared with one threshold tau, sequence-level at prefill and token-level at decode).
"""

from __future__ import annotations

import contextlib
import functools
import time

import torch
import transformers
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig  # noqa: F401  (AutoConfig: read by .loading)

from ..compat import GenerationHooks, build_from_config
from ..errors import RiverError
from .arch import SUPPORTED_MODEL_TYPES, decoder_stack, mix_in
from .build import KEEP as _KEEP
from .build import (build_exit_path, check_min_layer, check_supported, disable_river, refresh_exit_layers,  # noqa: F401
                    settings_for, warn_negative_taus)
from .cache import RiverCache
from .call import GenerateCall
from .config import CONFIG_DIR, RIVER_SETTINGS, RiverConfig, default_config, river_settings
from .controllers import ExitRuleList
from .decode_loop import exit_decode, serves_call
from .layer import BACKBONE_ONLY, EXIT_ONLY, LOSSLESS, ROUTE, RiverHead, RiverLayer
from .loading import architecture, as_class, load_checkpoint
from .loading import read_config as _read_config  # noqa: F401  (the old name)
from .lossless import backbone_mode, cut_at_stop, lossless_call
from .lossless_batch import BatchPlan
from .lossless_generate import can_draft, drafter, first_stop
from .serialization import save_river, saved_river_config
from .settings import RiverSettingsMixin
from .stats import kernel_groups, summarize
from .strategies import get_strategy

__all__ = [
    "RiverConfig",
    "RiverForCausalLM",
    "enable_river",
    "disable_river",
    "river_class",
    "default_config",
    "SUPPORTED_MODEL_TYPES",
    "CONFIG_DIR",
]


class RiverForCausalLM(RiverSettingsMixin, GenerationHooks):
    """River's class: in front of the architecture's own class on every River model, and the
    entry point that builds one (like ``AutoModelForCausalLM``).

    ``isinstance(model, RiverForCausalLM)`` holds for every River model; ``type(model)`` is e.g.
    ``RiverQwen2ForCausalLM`` (this class, then ``Qwen2ForCausalLM``), so the model is a
    ``PreTrainedModel`` with the standard ``generate``. Build one with :meth:`from_pretrained`,
    :meth:`from_config` or :func:`enable_river`; not by calling the class.

    Attributes set by ``enable_river``:
        river: the :class:`RiverRouter` (rules, mode, per-pass log).
        river_config: the :class:`RiverConfig` in force.
        river_build_seconds: wall time spent building the exit layers (seconds).
        river_stats: dict describing the last ``generate`` call (see :meth:`river_summary`).

    The settings methods (``set_river_tau``, ``river_mode``, ``set_river_strategy``,
    ``river_strategy``, ``river_tau_override``) come from
    :class:`~river_hf.river.settings.RiverSettingsMixin`.

    ``state_dict``, ``named_parameters``, ``named_modules``: the architecture's names, without the
    exit copies (derived state, rebuilt when weights change; ``river.exit_modules``, docs/checkpoints.md).

    What River does not support: ``torch.compile`` of the forward (River's exit decision is
    data-dependent Python control flow between layers): compiling raises :class:`RiverError` at
    the first call, and ``generate`` never auto-compiles a River model (a ``compile_config``
    raises). A static cache (``cache_implementation="static"``) works, uncompiled.
    """

    #: the architecture's own class; set on each River class by :func:`river_hf.river.arch.mix_in`.
    river_base_class: type | None = None

    def __init__(self, *args, **kwargs):
        raise RiverError(
            "River models are built by RiverForCausalLM.from_pretrained(...), RiverForCausalLM.from_config(config) "
            "or enable_river(model), not by calling the class"
        )

    # -- building ------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path,
        *model_args,
        river_config: RiverConfig | None = None,
        progress: bool = True,
        **kwargs,
    ):
        """Load a checkpoint and enable River on it; one path for every way in.

        ``RiverForCausalLM.from_pretrained(name)`` picks the architecture from the config (like
        ``AutoModelForCausalLM``); ``AutoModelForCausalLM.from_pretrained(river_folder,
        trust_remote_code=True)`` and ``pipeline(..., trust_remote_code=True)`` come here through
        the folder's ``auto_map`` with the folder's own River class.

        Args:
            pretrained_model_name_or_path: a model key, a local folder or a Hub id
                (:func:`river_hf.models.resolve`; a Hub id with ``revision=`` is passed on as is).
            **kwargs (River's settings): any of :data:`~river_hf.river.config.RIVER_SETTINGS`
                (``tau``, ``min_layer``, ``backend``, ``exit_head``, ``prefill``, ``lossless``,
                ``strategy``, ``prompt_kernel``, ``offload_from``, ``offload_dir``) overrides that
                field of the stored settings (see :class:`RiverConfig`); ``lossless=True`` makes
                lossless mode the model's own; ``strategy`` picks what the layers after an exit do
                (:data:`river_hf.river.strategies.STRATEGIES`).
            river_config: a whole :class:`RiverConfig` replacing the stored settings. Without it,
                the settings come from the folder's config.json ``"river"``, else from
                ``configs/<key>.json`` (:func:`default_config`).
            progress: progress bar while the exit layers are built (and the model key converted).
            *model_args, **kwargs: the usual ``from_pretrained`` arguments (``dtype``,
                ``device_map``, ``config``, ...); ``revision``, ``token``, ``trust_remote_code``,
                ``cache_dir``, ``local_files_only`` and ``subfolder`` also apply to reading the config.
                With ``offload_from`` set, backbone layers ``offload_from``.. are never resident,
                not even during the load (:mod:`.offload`).

        Returns:
            The model (eval mode), an instance of this class and of the architecture's class.

        Raises:
            RiverError: unknown model key, unreadable config (missing, no ``model_type``, not
                JSON, not reachable), invalid River settings, a River folder without its base
                weights, an unsupported architecture, ``min_layer`` or ``offload_from`` beyond the
                model's layers.
        """
        name = str(pretrained_model_name_or_path)
        given = river_settings(kwargs, where="from_pretrained")
        model, river_config = load_checkpoint(cls, name, model_args, kwargs, river_config, given, progress)
        model = enable_river(model, config=river_config, progress=progress)
        return as_class(model, cls)

    @classmethod
    def from_config(
        cls,
        config,
        *,
        river_config: RiverConfig | None = None,
        progress: bool = True,
        **kwargs,
    ):
        """A freshly initialised model of ``config``'s architecture (random weights, as
        ``AutoModelForCausalLM.from_config``), in eval mode, with River enabled.

        Args:
            config: a ``PretrainedConfig`` of a causal LM (e.g. a tiny ``LlamaConfig``); its
                ``river`` attribute, when present, gives the River settings.
            river_config, progress: as for :meth:`from_pretrained`.
            **kwargs: River's settings as for :meth:`from_pretrained` (but ``offload_*``); the rest
                is passed to ``from_config`` (``dtype``, ``attn_implementation``, ...).

        Raises:
            RiverError: as for :func:`enable_river`.
        """
        settings = river_settings(kwargs, allowed=FROM_CONFIG_SETTINGS, where="from_config")
        arch = architecture(cls, config)
        model = build_from_config(arch, config, **kwargs)
        model.eval()
        if river_config is None:
            river_config = saved_river_config(config)
        model = enable_river(model, config=river_config, progress=progress, **settings)
        return as_class(model, cls)

    def save_pretrained(self, save_directory, *, card: str | None = None, tokenizer=None, **kwargs):
        """Write a River folder (base weights under their own names, config with ``river`` and
        ``auto_map``, ``modeling_river.py``, README.md, and ``tokenizer`` when given); see
        :func:`river_hf.river.serialization.save_river`. Returns the folder."""
        return save_river(self, save_directory, card=card, tokenizer=tokenizer, **kwargs)

    # -- generation ------------------------------------------------------------------------------

    def generate(self, *args, river_tau: float | None = None, **kwargs):
        """transformers' ``generate``, plus River's bookkeeping (``river_stats``), a per-call τ and
        the lossless mode.

        In lossless mode (:meth:`river_mode` ``("lossless")`` or ``RiverConfig.lossless``) a call
        with one sequence runs transformers' assisted decoding with River's exit path as the
        drafter (:mod:`river_hf.river.lossless`), a batch River's own loop
        (:mod:`river_hf.river.lossless_batch`); its tokens are the unmodified model's. Beam search,
        ``num_return_sequences`` > 1, or a batch with a setting that reads the token history, runs
        on the backbone (exact, not faster; warns once).

        Args:
            river_tau: threshold τ for this call only (the model's τ is unchanged afterwards); in
                lossless mode it shapes the drafts only. When not given, the ``river_tau``
                attribute of the ``generation_config`` passed in, else of
                ``model.generation_config``, is used when set (``GenerationConfig(river_tau=0.9)``),
                else the model's τ.
            *args, **kwargs: as for ``GenerationMixin.generate``.

        Raises:
            RiverError: ``river_tau`` not a number, or no StateTransitionSimilarityRule in force;
                a ``compile_config`` (River models are not compiled); in lossless mode, an
                ``assistant_model``, ``prompt_lookup_num_tokens``, ``assistant_early_exit`` or
                ``custom_generate`` (they would replace River's drafter).
        """
        rebuilt = self.river_refresh_exit_layers() if self.river.mode != BACKBONE_ONLY else []
        gen_config = kwargs.get("generation_config")
        if gen_config is None and len(args) > 1 and isinstance(args[1], GenerationConfig):
            gen_config = args[1]
        if river_tau is None:
            river_tau = getattr(gen_config if gen_config is not None else self.generation_config, "river_tau", None)
        lossless = self.river.mode == LOSSLESS
        if lossless and not self.river.strategy.runs_exit_layers:
            raise RiverError(
                f"lossless mode drafts with River's exit layers, but strategy {self.river.strategy.name!r} is in force; "
                "use strategy 'river' for lossless mode, or route mode (river_mode('route')) for the baseline")
        prompt = _prompt_ids(args, kwargs)
        call = GenerateCall()  # this call's state; the hooks find it through router.current_call
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.river_tau_override(river_tau, stacklevel=3))
            plan = can_draft(self, kwargs, gen_config, prompt, args=args) if lossless else None
            if lossless and not plan:
                lossless = False
                stack.enter_context(self.river.override(mode=BACKBONE_ONLY))
            mode = self.river.mode
            if mode == ROUTE:  # the backbone layers' kernel (None at τ > 1: the plain model's own)
                call.backbone_linear, call.backbone_kernel = backbone_mode(self, self.river_config.backbone_kernel)
            elif mode == EXIT_ONLY and serves_call(self, args, kwargs, gen_config):
                # River's decoding loop (river/decode_loop.py); transformers hands a custom loop no streamer
                kwargs["custom_generate"] = functools.partial(exit_decode, streamer=kwargs.pop("streamer", None))
            stack.enter_context(self.river.calling(call))
            log = stack.enter_context(self.river.recording())
            if lossless:
                stack.enter_context(lossless_call(self, call))
                if plan is True:  # one sequence: transformers' assisted decoding, the drafter is River's
                    kwargs["assistant_model"] = self
            start = time.perf_counter()
            out = plan.generate(self, call) if isinstance(plan, BatchPlan) else super().generate(*args, **kwargs)
            seconds = time.perf_counter() - start
        stop = call.first_stop
        if stop is not None:  # a criterion fired inside the last round: cut there (see FirstStop)
            out = cut_at_stop(out, stop.stop_at, prompt.shape[1] if prompt is not None else 0)
        sequences = out if isinstance(out, torch.Tensor) else getattr(out, "sequences", None)
        new_tokens = None
        if isinstance(sequences, torch.Tensor) and sequences.dim() == 2:
            new_tokens = sequences.shape[0] * (sequences.shape[1] - (prompt.shape[1] if prompt is not None else 0))
        stats = self.river_summary(seconds, log=log, start=start, new_tokens=new_tokens,
                                   lossless=call.record if lossless else None)
        stats["mode"] = mode
        stats["strategy"] = self.river.strategy.name
        if call.backbone_kernel is not None:
            stats["backbone_kernel"] = call.backbone_kernel
        if rebuilt:
            stats["exit_copies_rebuilt"] = rebuilt  # the backbone's weights had changed since they were built
        self.river.remember(stats)
        return out

    def river_refresh_exit_layers(self) -> list[str]:
        """Rebuild the exit copy of every backbone layer, and the exit head, whose weights changed
        since the copy was made (``load_state_dict``, ``param.data = ...``, an in-place change such
        as a PEFT merge; see :class:`~river_hf.quant.dense.WeightFingerprint`), so the exit path always
        quantizes the model's current weights. ``generate`` calls it first in every mode but
        ``backbone``; it costs one gather of 256 values per backbone Linear when nothing changed.
        Rebuilt copies use the kernels of ``river_config.kernel_choice`` (nothing is measured).

        Returns:
            The names rebuilt (``"layers.3"``, ``"lm_head"``), empty when nothing changed.
        """
        return refresh_exit_layers(self)

    # -- what transformers' generation hooks ask (through river_hf.compat.GenerationHooks) ----------

    def river_candidate_generator(self, generation_config, logits_processor):
        """In a lossless call, River's :class:`~river_hf.river.lossless.ExitPathDrafter`
        (:func:`~river_hf.river.lossless_generate.drafter`); else None (transformers' own choice:
        an ``assistant_model``, prompt lookup, ...)."""
        return drafter(self, generation_config, logits_processor)

    def river_stopping_criteria(self, criteria):
        """The call's criteria; in a lossless call wrapped in :class:`~river_hf.river.lossless.FirstStop`
        (asked token by token over each round, so a stop string inside a round stops there)."""
        return first_stop(self, criteria)

    @property
    def river_stats(self) -> dict:
        """Statistics of this thread's last ``generate`` call (another thread's last call when this
        one has made none); see :meth:`river_summary`."""
        return self.river.last_stats()

    def river_step_bytes(self, exit_layer: int, strategy: str | None = None) -> int:
        """Weight bytes one decode step reads when its exit layer is ``exit_layer`` (0..L; L: it
        stayed on the backbone): backbone layers 0..exit_layer-1, then what ``strategy`` runs after
        the exit (River: the exit layers; state propagation: the K/V projections; the other
        baselines: nothing), then the exit head when it left the backbone, else the original head.
        ``strategy`` None: the one in force.

        Raises:
            RiverError: an unknown strategy. IndexError: ``exit_layer`` outside 0..L.
        """
        name = get_strategy(strategy).name if strategy is not None else self.river.strategy.name
        return self._river_step_bytes[name][exit_layer]

    def river_backbone_modules(self) -> list[nn.Module]:
        """The modules that run on the backbone path: every backbone layer's modules and the
        original LM head (what a lossless verify pass computes with)."""
        _, layers = decoder_stack(self)
        modules = [m for layer in layers for m in (layer.backbone if isinstance(layer, RiverLayer) else layer).modules()]
        head = self.get_output_embeddings()
        if head is not None:
            modules.append(head.backbone if isinstance(head, RiverHead) else head)
        return modules

    def prepare_inputs_for_generation(self, *args, **kwargs):
        """transformers' own; first hands the 2-D ``attention_mask`` to the router, which needs the
        padding positions for the exit decision even when a static cache makes ``generate`` pass
        the decoder a 4-D mask."""
        self.river.expect_padding_mask(kwargs.get("attention_mask"))
        if self.river.mode == ROUTE and args and kwargs.get("next_sequence_length") is not None:
            feed = self.river.strategy.prepare_inputs(self, args[0], kwargs)
            if feed is not None:
                kwargs["next_sequence_length"] = feed
        return super().prepare_inputs_for_generation(*args, **kwargs)

    def river_default_cache(self, generation_config) -> RiverCache:
        """The cache of a call that brings none (where transformers would build a ``DynamicCache``):
        a :class:`RiverCache` (the same layers, sliding-window ones included, from the config),
        with its past recording on when this model assists another
        (``generation_config.is_assistant``: the other model will crop it), as transformers does
        for an assistant's cache."""
        cache = RiverCache(config=self.config.get_text_config(decoder=True))
        if generation_config.is_assistant:
            cache.activate_past_recording()
        return cache

    def init_continuous_batching(self, *args, **kwargs):
        """Refused, and so ``generate_batch``: its passes pack every request in flight into one row and River
        takes one exit decision per pass, so answers would depend on the other requests (SmolLM2: 2 of 4
        differed from their answers alone). Raises :class:`RiverError`."""
        raise RiverError("River models do not run transformers' continuous batching (generate_batch): its passes mix "
                         "the tokens of every request in flight and River takes one exit decision per pass, so answers "
                         "would depend on the other requests; call generate per request (river-hf serve queues them)")

    def river_check_compile(self, generation_config) -> None:
        """River models are never compiled (``generate`` asks before auto-compiling a static cache
        on a GPU). Raises :class:`RiverError` for a ``compile_config`` that is not disabled."""
        if generation_config.compile_config is not None and not generation_config.disable_compile:
            raise RiverError(
                "River models cannot be compiled (the exit decision is data-dependent control flow between "
                "layers): drop compile_config from generate / the generation config"
            )

    def river_summary(self, seconds: float | None = None, *, log: list | None = None, start: float | None = None,
                      new_tokens: int | None = None, lossless: dict | None = None) -> dict:
        """Statistics of one ``generate`` call from its pass log (:meth:`RiverRouter.recording`):
        :func:`river_hf.river.stats.summarize` (which lists the keys: exit layers, exit fraction,
        prefill seconds, decode tokens/s, GB/s, and for lossless calls the drafter's figures) with
        this model's layers, mode, strategy and weight bytes per decode step.

        Args:
            seconds: wall time of the call (s).
            log: the call's ``(batch, tokens, exit_layer, end_time)`` per forward pass.
            start: ``time.perf_counter()`` at the call's start.
            new_tokens: tokens the call generated (batch x new positions of the output); None:
                one per row and forward pass (true for plain decoding, not for drafting).
            lossless: the lossless drafter's record (:meth:`ExitPathDrafter.stats`), or None.
        """
        return summarize(log, num_layers=self.river.num_layers, mode=self.river.mode,
                         strategy=self.river.strategy.name, step_bytes=self._river_step_bytes, seconds=seconds,
                         start=start, new_tokens=new_tokens, lossless=lossless)

    def river_kernels(self) -> list[dict]:
        """Which kernel each group of exit Linears got: one dict per (shape, kernel) with ``shape``
        (``"in x out"``), ``kernel``, ``count`` (Linears), ``names`` (the first few), ``us_per_call``
        (the tuner's cold-cache one-token timings of every candidate, µs; absent when only one
        kernel was allowed) and ``relative_error`` (mean over the group of ||copy(x) - W x|| /
        ||W x|| on the real weights); with ``RiverConfig.prompt_kernel``, a group whose Linears got
        a prompt kernel also has ``prompt_kernel`` (its name; calls of 16+ rows run on it),
        ``prompt_us_per_call_128_rows`` (the candidates' timings at 128 rows) and
        ``prompt_relative_error``."""
        return kernel_groups(self.river_kernel_report)


#: Old name of :class:`RiverForCausalLM` as the mixin.
RiverMixin = RiverForCausalLM


#: River's settings ``from_config`` and ``enable_river`` take (offloading happens while loading: ``from_pretrained`` only).
FROM_CONFIG_SETTINGS = tuple(n for n in RIVER_SETTINGS if not n.startswith("offload_"))


def river_class(arch_name: str) -> type:
    """The River class of a transformers architecture class name, e.g. ``"Qwen2ForCausalLM"``
    gives ``RiverQwen2ForCausalLM`` (what a saved folder's ``modeling_river.py`` exports).

    Raises:
        RiverError: this transformers has no class of that name.
    """
    base = getattr(transformers, arch_name, None)
    if not isinstance(base, type):
        raise RiverError(f"transformers {transformers.__version__} has no model class {arch_name!r}; upgrade transformers")
    return mix_in(RiverForCausalLM, base)


def enable_river(
    model: nn.Module,
    tau: float | None = None,
    *,
    rules: ExitRuleList | list | None = None,
    config: RiverConfig | None = None,
    allow_untested: bool = False,
    progress: bool = True,
    tuner=None,
    **settings,
) -> nn.Module:
    """Turn a loaded transformers causal LM into a River model, in place, and return it.

    Args:
        model: a ``*ForCausalLM`` of a supported family (:data:`SUPPORTED_MODEL_TYPES`).
        tau: threshold τ of the state transition similarity (River-LLM Sec. 3.2); None takes the
            per-model default from ``configs/``. A negative τ is legal and warns (nearly every
            step then leaves the backbone after ``min_layer`` layers).
        **settings: River's settings as for ``RiverForCausalLM.from_pretrained`` (``min_layer``,
            ``backend``, ``exit_head``, ``prefill``, ``lossless``, ``strategy``, ``prompt_kernel``;
            :data:`~river_hf.river.config.RIVER_SETTINGS` but ``offload_*``): override the defaults
            (see :class:`RiverConfig`).
        rules: explicit exit rules instead of tau/min_layer: an :class:`ExitRuleList`, a list of
            rules (``[MinLayerRule(2), StateTransitionSimilarityRule(0.9)]``) or ``to_list()`` dicts.
        config: a whole :class:`RiverConfig`; the other keyword arguments override its fields.
        allow_untested: try model types outside :data:`SUPPORTED_MODEL_TYPES`.
        progress: show a progress bar while building the exit layers.
        tuner: a :class:`river_hf.quant.KernelTuner` for the ``int8``/``int4`` choices (None: the
            default one, cached under the cache dir; ``False``: no measurement, first candidate).

    Returns:
        The same model object, whose class now has :class:`RiverForCausalLM` in front.
        ``model.river_kernels()`` tells which kernel each exit Linear (and the exit head) got;
        ``model.river_config.kernel_choice`` records the measured choices' kernels per shape (a
        ``config.kernel_choice`` given, e.g. by a saved folder, is reused instead of measuring).
        :func:`disable_river` undoes it.

    Warns:
        UserWarning: once, naming the shapes, when a given ``kernel_choice`` kernel is not
            available here (another kernel of the same width is used).

    Raises:
        RiverError: River already enabled, unsupported architecture, an unknown keyword argument,
            invalid settings, ``min_layer`` not below the model's number of decoder layers.
    """
    given = river_settings(dict(settings, tau=tau), allowed=FROM_CONFIG_SETTINGS)
    unknown = sorted(set(settings) - set(RIVER_SETTINGS))
    if unknown:
        raise RiverError(f"enable_river got unknown keyword argument(s) {', '.join(unknown)}; River's settings are "
                         f"{', '.join(RIVER_SETTINGS[:-2])} (see RiverConfig)")
    check_supported(model, allow_untested)
    config = settings_for(model, config, rules=rules, exit_head=given.pop("exit_head", _KEEP), **given)
    _, layers = decoder_stack(model)
    rule_list = config.build_rules()
    check_min_layer(rule_list, len(layers), model)
    warn_negative_taus(rule_list, stacklevel=2)  # the caller of enable_river
    attributes = build_exit_path(model, config, rule_list, tuner, progress, stacklevel=2)  # warns at our caller
    model.__class__ = mix_in(RiverForCausalLM, type(model))
    for name, value in attributes.items():
        setattr(model, name, value)
    return model


def _prompt_ids(args: tuple, kwargs: dict):
    """The prompt token ids a ``generate`` call got (``inputs``/``input_ids``, positional or
    not), or None (``inputs_embeds`` only: the output then holds the new tokens only)."""
    x = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
    return x if isinstance(x, torch.Tensor) and x.dim() == 2 and not x.is_floating_point() else None
