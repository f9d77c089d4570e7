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

Source: River-LLM (exit layers built by quantizing each decoder layer; KV share; state transition
similarity compared with one threshold tau, sequence-level at prefill and token-level at decode).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
import warnings

import torch
import transformers
from torch import nn
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from ..errors import RiverError
from ..models import is_key, resolve
from ..quant import KernelPlan, default_tuner, get_backend, linear_weight_bytes
from .arch import SUPPORTED_MODEL_TYPES, base_class, decoder_stack, is_river_class, mix_in
from .cache import RiverCache
from .config import CONFIG_DIR, RiverConfig, check_tau, default_config, warn_if_negative_tau
from .controllers import ExitRule, ExitRuleList, MinLayerRule, StateTransitionSimilarityRule
from .layer import BACKBONE_ONLY, EXIT_ONLY, LOSSLESS, MODES, ROUTE, RiverHead, RiverLayer, RiverRouter
from .strategies import STRATEGIES, cache_of, get_strategy
from .lossless import ExitPathDrafter, FirstStop, cut_at_stop, lossless_call
from .offload import build_exit_layer, is_offloaded, loading_kwargs, offload_backbone
from .serialization import check_base_weights, save_river, saved_river_config

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

_REBUILD_LOCK = threading.Lock()  # one rebuild of exit copies at a time
_KEEP = object()  # "not given" for settings where None is a value (exit_head=None: no exit head)

#: ``from_pretrained`` arguments that also apply to reading the config (``AutoConfig``).
_HUB_KWARGS = ("revision", "token", "trust_remote_code", "cache_dir", "local_files_only", "force_download",
               "proxies", "subfolder", "code_revision")

#: Attributes ``enable_river`` puts on the model (``disable_river`` removes them).
_RIVER_ATTRIBUTES = ("river", "river_config", "river_build_seconds", "river_kernel_report",
                     "_river_step_bytes", "_river_hooks", "_river_verify_linear", "_river_warned_lossless_batch",
                     "_river_prints")

#: ``generate`` arguments that bring their own drafter or decoding loop (refused in lossless mode).
_OTHER_DRAFTERS = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit", "custom_generate", "use_mtp",
                   "assistant_tokenizer")


class RiverForCausalLM:
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
        tau: float | None = None,
        min_layer: int | None = None,
        backend: str | None = None,
        exit_head=_KEEP,
        prefill: str | None = None,
        lossless: bool | None = None,
        strategy: str | None = None,
        river_config: RiverConfig | None = None,
        offload_from: int | None = None,
        offload_dir: str | None = None,
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
            tau, min_layer, backend, exit_head, prefill, lossless, strategy, offload_from, offload_dir:
                override single settings of the stored ones (see :class:`RiverConfig`);
                ``lossless=True`` makes lossless mode the model's own; ``strategy`` picks what the
                layers after an exit do (:data:`river_hf.river.strategies.STRATEGIES`).
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
        overrides = _overrides(tau=tau, min_layer=min_layer, backend=backend, exit_head=exit_head, prefill=prefill,
                               lossless=lossless, strategy=strategy, offload_from=offload_from,
                               offload_dir=offload_dir)
        keep_hub_id = "revision" in kwargs and not is_key(name) and not os.path.isdir(name)
        path = name if keep_hub_id else resolve(name, progress=progress)  # resolve ignores revisions
        check_base_weights(path)
        config = kwargs.pop("config", None)
        if config is None or isinstance(config, (str, os.PathLike)):
            config = _read_config(config or path, kwargs, name)
        if river_config is None:
            river_config = saved_river_config(config, where=name)
        if river_config is None:
            river_config = default_config(name, config.get_text_config(decoder=True).model_type)
        river_config = dataclasses.replace(river_config, **overrides)
        kwargs = loading_kwargs(path, river_config, kwargs, config)
        model = _architecture(cls, config).from_pretrained(path, *model_args, config=config, **kwargs)
        model.eval()
        model = enable_river(model, config=river_config, progress=progress)
        return _as_class(model, cls)

    @classmethod
    def from_config(
        cls,
        config,
        *,
        tau: float | None = None,
        min_layer: int | None = None,
        backend: str | None = None,
        exit_head=_KEEP,
        prefill: str | None = None,
        lossless: bool | None = None,
        strategy: str | None = None,
        river_config: RiverConfig | None = None,
        progress: bool = True,
        **kwargs,
    ):
        """A freshly initialised model of ``config``'s architecture (random weights, as
        ``AutoModelForCausalLM.from_config``), in eval mode, with River enabled.

        Args:
            config: a ``PretrainedConfig`` of a causal LM (e.g. a tiny ``LlamaConfig``); its
                ``river`` attribute, when present, gives the River settings.
            tau, min_layer, backend, exit_head, prefill, lossless, strategy, river_config, progress: as for
                :meth:`from_pretrained`.
            **kwargs: passed to ``from_config`` (``dtype``, ``attn_implementation``, ...).

        Raises:
            RiverError: as for :func:`enable_river`.
        """
        arch = _architecture(cls, config)
        build = arch.from_config if arch is AutoModelForCausalLM else arch._from_config
        model = build(config, **kwargs)
        model.eval()
        if river_config is None:
            river_config = saved_river_config(config)
        model = enable_river(model, tau, min_layer=min_layer, backend=backend, exit_head=exit_head, prefill=prefill,
                             lossless=lossless, strategy=strategy, config=river_config, progress=progress)
        return _as_class(model, cls)

    @classmethod
    def _from_config(cls, config, **kwargs):
        """What ``AutoModelForCausalLM.from_config(config, trust_remote_code=True)`` calls through a
        River folder's ``auto_map``: :meth:`from_config`."""
        return cls.from_config(config, **kwargs)

    def save_pretrained(self, save_directory, *, card: str | None = None, tokenizer=None, **kwargs):
        """Write a River folder (base weights under their own names, config with ``river`` and
        ``auto_map``, ``modeling_river.py``, README.md, and ``tokenizer`` when given); see
        :func:`river_hf.river.serialization.save_river`. Returns the folder."""
        return save_river(self, save_directory, card=card, tokenizer=tokenizer, **kwargs)

    # -- settings --------------------------------------------------------------------------------

    def set_river_tau(self, tau: float) -> None:
        """Change τ from now on, without rebuilding exit layers.

        Every :class:`StateTransitionSimilarityRule` of the rules in force gets threshold ``tau``;
        every other rule (a :class:`MinLayerRule`, custom rules) is kept as it is.
        ``river_config.tau`` (and ``river_config.rules``, when set) follow. For one call only,
        pass ``generate(..., river_tau=tau)`` instead.

        Raises:
            RiverError: ``tau`` is not a number; the rules in force hold no
                :class:`StateTransitionSimilarityRule` (τ would mean nothing).
        """
        tau = check_tau(tau)
        rules = self.river.rules.with_tau(tau)
        _warn_negative_taus(rules, stacklevel=2)
        self.river.rules = rules
        rc = self.river_config
        self.river_config = dataclasses.replace(rc, tau=tau, rules=None if rc.rules is None else rules.to_list())

    @contextlib.contextmanager
    def river_mode(self, mode: str):
        """Within the block, this thread's calls run in ``mode``:

        - ``"route"``: River (lossy: the exit rule decides per step);
        - ``"lossless"``: the exit path drafts and the backbone verifies in one shared KV cache
          (:mod:`river_hf.river.lossless`): the unmodified model's tokens, faster; ``generate``
          with one sequence (a batch, beam search or ``num_return_sequences`` > 1 runs on the
          backbone alone: exact, not faster); a plain forward runs the backbone;
        - ``"backbone"``: the unmodified model;
        - ``"exit"``: the fully quantized model (every layer its exit copy), for comparisons.

        Other threads keep their mode (per-call state). ``RiverConfig.lossless`` makes
        ``"lossless"`` the model's own mode.

        Raises:
            ValueError: an unknown mode.
        """
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
        with self.river.override(mode=mode):
            yield self

    def set_river_strategy(self, strategy: str) -> None:
        """From now on, the layers after an exit do what ``strategy`` says (River's exit layers, or
        one of the baselines of :mod:`river_hf.river.strategies`); ``river_config.strategy``
        follows. For a block of calls in this thread only, use :meth:`river_strategy`.

        Raises:
            RiverError: an unknown strategy; a baseline while lossless mode is the model's own
                (lossless drafting needs River's exit layers).
        """
        name = get_strategy(strategy).name
        self.river_config = dataclasses.replace(self.river_config, strategy=name)  # validates
        self.river.strategy = name

    @contextlib.contextmanager
    def river_strategy(self, strategy: str):
        """Within the block, this thread's calls use ``strategy`` for the layers after an exit
        (``"river"``: the exit layers; ``"recompute"``, ``"skipdecode"``, ``"state-propagation"``,
        ``"kv-mask"``: the baselines of :mod:`river_hf.river.strategies`); the exit rule, τ and the
        head stay the same. Other threads keep theirs.

        Raises:
            RiverError: an unknown strategy.
        """
        with self.river.override(strategy=get_strategy(strategy)):
            yield self

    @contextlib.contextmanager
    def river_tau_override(self, tau: float | None, stacklevel: int = 1):
        """Within the block the rules in force use threshold ``tau`` (as :meth:`set_river_tau`
        does); afterwards the model's own rules and ``river_config`` are as before. ``None``: no
        change. ``stacklevel``: where a negative-τ warning points (1: the ``with`` line).
        Raises as :meth:`set_river_tau`."""
        if tau is None:
            yield self
            return
        rules = self.river.rules.with_tau(check_tau(tau))
        _warn_negative_taus(rules, stacklevel=2 + stacklevel)  # past this generator and contextlib's __enter__
        with self.river.override(rules=rules):
            yield self

    # -- generation ------------------------------------------------------------------------------

    def generate(self, *args, river_tau: float | None = None, **kwargs):
        """transformers' ``generate``, plus River's bookkeeping (``river_stats``), a per-call τ and
        the lossless mode.

        In lossless mode (:meth:`river_mode` ``("lossless")`` or ``RiverConfig.lossless``) a call
        with one sequence runs transformers' assisted decoding with River's exit path as the
        drafter (:mod:`river_hf.river.lossless`); its tokens are the unmodified model's. A batch,
        beam search or ``num_return_sequences`` > 1 runs on the backbone (exact, not faster;
        warns once).

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
        record: dict = {}
        local = self.river._local
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.river_tau_override(river_tau, stacklevel=3))
            if lossless and not self._can_draft(kwargs, gen_config, prompt):
                lossless = False
                stack.enter_context(self.river.override(mode=BACKBONE_ONLY))
            mode = self.river.mode
            log = stack.enter_context(self.river.recording())
            if lossless:
                stack.enter_context(lossless_call(self, record))
                kwargs["assistant_model"] = self  # transformers' assisted decoding; the drafter is River's
            start = time.perf_counter()
            out = super().generate(*args, **kwargs)
            seconds = time.perf_counter() - start
            stop = local.first_stop if lossless else None
            local.first_stop = None
        if stop is not None:  # a criterion fired inside the last round: cut there (see FirstStop)
            out = cut_at_stop(out, stop.stop_at, prompt.shape[1] if prompt is not None else 0)
        sequences = out if isinstance(out, torch.Tensor) else getattr(out, "sequences", None)
        new_tokens = None
        if isinstance(sequences, torch.Tensor) and sequences.dim() == 2:
            new_tokens = sequences.shape[0] * (sequences.shape[1] - (prompt.shape[1] if prompt is not None else 0))
        stats = self.river_summary(seconds, log=log, start=start, new_tokens=new_tokens,
                                   lossless=record if lossless else None)
        stats["mode"] = mode
        stats["strategy"] = self.river.strategy.name
        if rebuilt:
            stats["exit_copies_rebuilt"] = rebuilt  # the backbone's weights had changed since they were built
        self.river.remember(stats)
        return out

    def river_refresh_exit_layers(self) -> list[str]:
        """Rebuild the exit copy of every backbone layer, and the exit head, whose weights changed
        since the copy was made (``load_state_dict``, ``param.data = ...``, an in-place change such
        as a PEFT merge; see :class:`~river_hf.kernels.WeightFingerprint`), so the exit path always
        quantizes the model's current weights. ``generate`` calls it first in every mode but
        ``backbone``; it costs one gather of 256 values per backbone Linear when nothing changed.
        Rebuilt copies use the kernels of ``river_config.kernel_choice`` (nothing is measured).

        Returns:
            The names rebuilt (``"layers.3"``, ``"lm_head"``), empty when nothing changed.
        """
        prints = self.__dict__.get("_river_prints")
        if not prints:
            return []
        from ..kernels import WeightFingerprint

        changed = [i for i, pairs in prints["layers"].items() if any(not fp.matches(m.weight) for m, fp in pairs)]
        head = prints["head"]
        head_changed = head is not None and not head[1].matches(head[0].weight)
        if not changed and not head_changed:
            return []
        config = self.river_config
        plan = KernelPlan(None, config.kernel_choice)
        _, layers = decoder_stack(self)
        rebuilt = []
        with _REBUILD_LOCK, torch.no_grad():
            for i in changed:
                layer = layers[i]
                exit_layer = get_backend(config.backend).build_layer(layer.backbone, plan, report=[], prefix=f"layers.{i}.")
                layer.exit_layer = exit_layer.eval()
                prints["layers"][i] = [(m, WeightFingerprint(m.weight)) for m in layer.backbone.modules()
                                       if isinstance(m, nn.Linear)]
                rebuilt.append(f"layers.{i}")
            if head_changed:
                river_head = self.get_output_embeddings()
                river_head.exit_head, _ = get_backend(config.exit_head).build_linear(river_head.backbone, plan)
                prints["head"] = (river_head.backbone, WeightFingerprint(river_head.backbone.weight))
                rebuilt.append("lm_head")
        return rebuilt

    def _can_draft(self, kwargs: dict, gen_config, prompt) -> bool:
        """Whether this lossless-mode call can draft and verify: one sequence, no beams, one
        return sequence, a cache. When it cannot, the call runs on the backbone alone (warned
        once per model and reason). Refuses arguments, or generation-config settings, that bring
        another drafter."""
        # the config transformers' generate will use: the call's config (or a fresh one) with the
        # model's generation_config filling what it leaves unset, then the call's keyword arguments
        base, _ = self._prepare_generation_config(
            gen_config, **{k: v for k, v in kwargs.items() if k != "generation_config"})
        given = [k for k in _OTHER_DRAFTERS if kwargs.get(k) is not None or getattr(base, k, None) not in (None, False)]
        if given:
            raise RiverError(
                f"River's lossless mode drafts with the model's own exit path; {', '.join(given)} would replace that "
                "drafter: drop it (from the call or the generation config), or leave lossless mode "
                "(model.river_mode('backbone') or 'route'); for prompt lookup inside lossless mode set "
                "RiverConfig.prompt_lookup_tokens"
            )
        beams = getattr(base, "num_beams", None) or 1
        returns = getattr(base, "num_return_sequences", None) or 1
        use_cache = getattr(base, "use_cache", True)
        batch = prompt.shape[0] if prompt is not None else 1
        reasons = [why for why, bad in (("a batch of %d sequences" % batch, batch > 1), ("num_beams=%d" % beams, beams > 1),
                                        ("num_return_sequences=%d" % returns, returns > 1),
                                        ("use_cache=False", use_cache is False)) if bad]
        if not reasons:
            return True
        warned = self.__dict__.setdefault("_river_warned_lossless_batch", set())
        key = tuple(r.split("=")[0].split(" of ")[0] for r in reasons)
        if key not in warned:
            warned.add(key)
            warnings.warn(
                f"River's lossless mode drafts for one sequence at a time (transformers' assisted decoding: batch 1, "
                f"num_beams=1, num_return_sequences=1, with a cache); this call has {', '.join(reasons)}, so it runs on "
                "the backbone alone: the same tokens, not faster (river_stats['mode'] says 'backbone')",
                UserWarning, stacklevel=3)
        return False

    def _get_candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                                 assistant_model=None, target_tokenizer=None, assistant_tokenizer=None):
        """In a lossless call, River's :class:`~river_hf.river.lossless.ExitPathDrafter`; else
        transformers' own choice (an ``assistant_model``, prompt lookup, ...)."""
        record = self.river._local.lossless_record
        if record is not None and self.river.mode == LOSSLESS:
            config = self.river_config
            return ExitPathDrafter(self, generation_config, logits_processor, draft_tokens=config.draft_tokens,
                                   schedule=config.draft_schedule, record=record,
                                   prompt_lookup_tokens=config.prompt_lookup_tokens,
                                   max_draft_tokens=config.max_draft_tokens)
        return super()._get_candidate_generator(
            generation_config=generation_config, input_ids=input_ids, inputs_tensor=inputs_tensor,
            logits_processor=logits_processor, model_kwargs=model_kwargs, assistant_model=assistant_model,
            target_tokenizer=target_tokenizer, assistant_tokenizer=assistant_tokenizer)

    def _get_stopping_criteria(self, generation_config, stopping_criteria, tokenizer=None):
        """transformers' own; in a lossless call wrapped in :class:`~river_hf.river.lossless.FirstStop`
        (asked token by token over each round, so a stop string inside a round stops there)."""
        criteria = super()._get_stopping_criteria(generation_config, stopping_criteria, tokenizer)
        local = self.river._local
        if local.lossless_record is not None and self.river.mode == LOSSLESS:
            criteria = FirstStop(criteria)
            local.first_stop = criteria
        return criteria

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

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """transformers' own, except that where it would build a ``DynamicCache`` (no cache
        given, ``cache_implementation`` None or ``"dynamic"``) River builds a :class:`RiverCache`
        (the same layers, sliding-window ones included, from the config) and, as transformers does
        for an assistant model's cache, activates its past recording when this model assists
        another (``generation_config.is_assistant``: the other model will crop it)."""
        user_cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
        if (
            user_cache is None
            and generation_config.use_cache is not False
            and generation_config.cache_implementation in (None, "dynamic")
            and self._supports_default_dynamic_cache()
        ):
            model_kwargs["cache"] = RiverCache(config=self.config.get_text_config(decoder=True))
            if generation_config.is_assistant:
                model_kwargs["cache"].activate_past_recording()
            return
        return super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)

    def _valid_auto_compile_criteria(self, model_kwargs, generation_config) -> bool:
        """Never auto-compile (a static cache would otherwise compile the forward on a GPU)."""
        if generation_config.compile_config is not None and not generation_config.disable_compile:
            raise RiverError(
                "River models cannot be compiled (the exit decision is data-dependent control flow between "
                "layers): drop compile_config from generate / the generation config"
            )
        return False

    def river_summary(self, seconds: float | None = None, *, log: list | None = None, start: float | None = None,
                      new_tokens: int | None = None, lossless: dict | None = None) -> dict:
        """Statistics of one ``generate`` call from its pass log (:meth:`RiverRouter.recording`).

        Args:
            seconds: wall time of the call (s).
            log: the call's ``(batch, tokens, exit_layer, end_time)`` per forward pass.
            start: ``time.perf_counter()`` at the call's start.
            new_tokens: tokens the call generated (batch x new positions of the output); None:
                one per row and forward pass (true for plain decoding, not for drafting).
            lossless: the lossless drafter's record (:meth:`ExitPathDrafter.stats`), or None.

        Returns a dict with:
            num_layers: L.
            mode: ``"lossless"`` when the call drafted and verified, else ``"route"`` (River, or
                the mode in force: ``backbone`` / ``exit`` calls run every pass that way).
            prefill_exit_layer: exit layer of the first pass (prefill).
            forward_passes: passes after the prefill (decode steps; in lossless mode drafts + verifies).
            decode_steps: passes that could exit: every pass after the prefill, or in lossless
                mode the draft passes.
            mean_exit_layer: mean exit layer over those passes (= backbone layers run; L: no exit).
            exit_fraction: fraction of them that left the backbone early.
            exit_layer_counts: list of L+1 counts; entry k = passes whose exit layer is k.
            new_tokens: generated tokens (all rows).
            seconds, tokens_per_s: wall time of the call (s) and new tokens per second over it.
            prefill_seconds: from the call's start to the end of the first forward pass (TTFT, s).
            decode_seconds, decode_tokens_per_s: time after the prefill (s; to the end of the last
                pass, in lossless mode of the last round) and the tokens generated in it per second
                (new tokens minus the prefill's one per row).
            weight_bytes_per_token: weight bytes the passes after the prefill read, per token
                generated after the prefill (a pass reads each weight it uses once, whatever its
                token count).
            bandwidth_gb_s: those bytes / decode_seconds / 1e9 (GB/s).
            lossless: (lossless calls) acceptance rate, mean accepted draft length, drafts per
                verify, tokens per verify, draft and verify seconds (:meth:`ExitPathDrafter.stats`),
                plus ``overhead_seconds`` = decode_seconds - draft - verify.
        """
        log = log or []
        L = self.river.num_layers
        after = log[1:]
        if lossless is not None:
            exits = list(lossless.get("draft_exit_layers", []))
        else:
            exits = [entry[2] for entry in after]
        counts = [0] * (L + 1)
        for e in exits:
            counts[e] += 1
        batch = log[0][0] if log else 0
        if new_tokens is None:
            new_tokens = batch * len(log)
        stats = {
            "num_layers": L,
            "mode": LOSSLESS if lossless is not None else self.river.mode,
            "prefill_exit_layer": log[0][2] if log else None,
            "forward_passes": len(after),
            "decode_steps": len(exits),
            "mean_exit_layer": (sum(exits) / len(exits)) if exits else None,
            "exit_fraction": (sum(e < L for e in exits) / len(exits)) if exits else None,
            "exit_layer_counts": counts,
            "new_tokens": new_tokens,
        }
        decode_tokens = new_tokens - batch
        # lossless drafts and exit mode run River's exit layers whatever strategy is set for route mode
        runs_exit_layers = lossless is not None or self.river.mode == EXIT_ONLY
        step_bytes = self._river_step_bytes["river" if runs_exit_layers else self.river.strategy.name]
        pass_bytes = sum(step_bytes[entry[2]] for entry in after)
        if after and decode_tokens > 0:
            stats["weight_bytes_per_token"] = pass_bytes / decode_tokens
        if seconds is not None:
            stats["seconds"] = seconds
            stats["tokens_per_s"] = new_tokens / seconds if seconds > 0 else None
            if log and start is not None:
                stats["prefill_seconds"] = log[0][3] - start
            if after:
                end = lossless.get("last_round_end", log[-1][3]) if lossless is not None else log[-1][3]
                decode_seconds = end - log[0][3]
                stats["decode_seconds"] = decode_seconds
                if decode_seconds > 0:
                    stats["decode_tokens_per_s"] = decode_tokens / decode_seconds
                    stats["bandwidth_gb_s"] = pass_bytes / decode_seconds / 1e9
        if lossless is not None:
            stats["lossless"] = ExitPathDrafter.stats(lossless)
            if "decode_seconds" in stats:
                s = stats["lossless"]
                s["overhead_seconds"] = stats["decode_seconds"] - s["draft_seconds"] - s["verify_seconds"]
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


#: Old name of :class:`RiverForCausalLM` as the mixin.
RiverMixin = RiverForCausalLM


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
    min_layer: int | None = None,
    backend: str | None = None,
    exit_head=_KEEP,
    prefill: str | None = None,
    lossless: bool | None = None,
    strategy: str | None = None,
    rules: ExitRuleList | list | None = None,
    config: RiverConfig | None = None,
    allow_untested: bool = False,
    progress: bool = True,
    tuner=None,
) -> nn.Module:
    """Turn a loaded transformers causal LM into a River model, in place, and return it.

    Args:
        model: a ``*ForCausalLM`` of a supported family (:data:`SUPPORTED_MODEL_TYPES`).
        tau: threshold τ of the state transition similarity (River-LLM Sec. 3.2); None takes the
            per-model default from ``configs/``. A negative τ is legal and warns (nearly every
            step then leaves the backbone after ``min_layer`` layers).
        min_layer, backend, exit_head, prefill, lossless, strategy: override the defaults (see
            :class:`RiverConfig`).
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
        RiverError: River already enabled, unsupported architecture, invalid settings,
            ``min_layer`` not below the model's number of decoder layers.
    """
    _check_supported(model, allow_untested)
    config = _settings(model, config, tau=tau, min_layer=min_layer, backend=backend, exit_head=exit_head,
                       prefill=prefill, lossless=lossless, strategy=strategy, rules=rules)
    stack, layers = decoder_stack(model)
    rule_list = config.build_rules()
    _check_min_layer(rule_list, len(layers), model)
    _warn_negative_taus(rule_list, stacklevel=2)  # the caller of enable_river
    if tuner is None:
        tuner = default_tuner()
    router = RiverRouter(rule_list, len(layers), prefill=config.prefill, strategy=config.strategy)
    if config.lossless:
        router.mode = LOSSLESS
    report: list[dict] = []
    start = time.perf_counter()
    plan = KernelPlan(tuner or None, config.kernel_choice)  # a saved folder's kernels first, then measured
    backbone_bytes, exit_bytes = _wrap_layers(layers, router, config, plan, report, progress)
    head_bytes, exit_head_bytes = _wrap_head(model, router, config, plan, report)
    build_seconds = time.perf_counter() - start
    plan.warn_if_differs(stacklevel=2)  # the caller of enable_river
    config = dataclasses.replace(config, kernel_choice=plan.chosen or None)  # saved with the folder
    if config.offload_from is not None:  # backbones not already offloaded at load (see offload.py)
        offload_backbone(layers, config.offload_from, config.offload_dir)
    hooks = _register_router_hooks(stack, router) + _register_verify_hooks(model, router)

    # Weight bytes one decode step reads when its exit layer is k, per strategy: backbone 0..k-1;
    # then River's exit layers k..L-1 (state propagation: their K/V projections; the other
    # baselines: nothing); and the exit head when the step left the backbone (k < L), else the
    # original head.
    L = len(layers)
    after_exit = {"river": exit_bytes, "state-propagation": [_kv_weight_bytes(layer.backbone) for layer in layers]}
    step_bytes = {name: [sum(backbone_bytes[:k]) + sum(after_exit.get(name, [0] * L)[k:])
                         + (exit_head_bytes if k < L else head_bytes) for k in range(L + 1)]
                  for name in STRATEGIES}
    model.__class__ = mix_in(RiverForCausalLM, type(model))
    model.river = router
    model.river_config = config
    model.river_build_seconds = build_seconds
    model.river_kernel_report = report
    model._river_step_bytes = step_bytes
    model._river_hooks = hooks
    model._river_prints = _fingerprints(model, layers)
    return model


def _fingerprints(model: nn.Module, layers) -> dict:
    """:class:`~river_hf.kernels.WeightFingerprint` of every Linear weight the exit copies were built
    from: ``{"layers": {i: [(linear, print), ...]}, "head": (linear, print) or None}`` (offloaded
    backbones are left out: their weights are not in memory to change)."""
    from ..kernels import WeightFingerprint

    prints: dict = {"layers": {}, "head": None}
    for i, layer in enumerate(layers):
        if isinstance(layer, RiverLayer) and not is_offloaded(layer.backbone):
            prints["layers"][i] = [(m, WeightFingerprint(m.weight)) for m in layer.backbone.modules()
                                   if isinstance(m, nn.Linear)]
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
    if not isinstance(model, RiverForCausalLM):
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
    for name in _RIVER_ATTRIBUTES:
        model.__dict__.pop(name, None)
    return model


def _kv_weight_bytes(layer: nn.Module) -> int:
    """Weight bytes of a decoder layer's K and V projections (what state propagation reads)."""
    attn = getattr(layer, "self_attn", None)
    return sum(linear_weight_bytes(getattr(attn, name)) for name in ("k_proj", "v_proj") if hasattr(attn, name))


def _prompt_ids(args: tuple, kwargs: dict):
    """The prompt token ids a ``generate`` call got (``inputs``/``input_ids``, positional or
    not), or None (``inputs_embeds`` only: the output then holds the new tokens only)."""
    x = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
    return x if isinstance(x, torch.Tensor) and x.dim() == 2 and not x.is_floating_point() else None


def _overrides(*, exit_head, **fields) -> dict:
    """The River settings a caller gave (None and an absent ``exit_head`` mean "not given")."""
    out = {k: v for k, v in fields.items() if v is not None}
    if exit_head is not _KEEP:
        out["exit_head"] = exit_head
    return out


def _read_config(source, kwargs: dict, name: str):
    """``AutoConfig.from_pretrained(source)`` with the caller's hub arguments; any failure is one
    RiverError."""
    hub = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
    try:
        return AutoConfig.from_pretrained(source, **hub)
    except (OSError, ValueError, KeyError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if len(first) > 300:
            first = first[:300] + " ..."
        raise RiverError(
            f"cannot read the model config of {name!r} ({first}); pass a transformers model folder with a valid "
            "config.json (it needs a model_type), a model key, or a Hub id (with revision=/token= when it needs them)"
        ) from None


def _architecture(cls: type, config) -> type:
    """The class that loads ``config``'s weights: the River class's own architecture, the
    architecture named by a River folder's config (so its ``auto_map`` is not followed back into
    River), or ``AutoModelForCausalLM``."""
    if is_river_class(cls):
        return cls.river_base_class
    if getattr(config, "river", None) is not None and getattr(config, "architectures", None):
        arch = getattr(transformers, config.architectures[0], None)
        if isinstance(arch, type):
            return arch
    return AutoModelForCausalLM


def _as_class(model: nn.Module, cls: type) -> nn.Module:
    """Give ``model`` the class it was asked for when that is a subclass of its River class (the
    Auto classes hand back such a subclass of a folder's River class)."""
    if isinstance(cls, type) and cls is not type(model) and issubclass(cls, type(model)):
        model.__class__ = cls
    return model


def _check_supported(model: nn.Module, allow_untested: bool) -> None:
    if isinstance(model, RiverForCausalLM):
        raise RiverError("River is already enabled on this model; use model.set_river_tau(tau) to change tau")
    model_type = getattr(model.config.get_text_config(decoder=True), "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES and not allow_untested:
        raise RiverError(
            f"model type {model_type!r} is not supported by River (supported: {', '.join(SUPPORTED_MODEL_TYPES)}); "
            "pass allow_untested=True to try the generic per-layer routing anyway"
        )


def _check_min_layer(rules: ExitRuleList, num_layers: int, model: nn.Module) -> None:
    """Refuse a MinLayerRule that would never let a pass leave the backbone."""
    for rule in rules:
        if isinstance(rule, MinLayerRule) and rule.min_layer >= num_layers:
            raise RiverError(
                f"min_layer={rule.min_layer} but this {type(model).__name__} has {num_layers} decoder layers: an exit "
                f"can only follow a backbone layer before the last one; choose min_layer from 1 to {num_layers - 1}"
            )


def _warn_negative_taus(rules: ExitRuleList, stacklevel: int) -> None:
    """One warning per negative τ among ``rules``, pointing ``stacklevel`` frames above the caller."""
    min_layer = next((r.min_layer for r in rules if isinstance(r, MinLayerRule)), None)
    for tau in sorted({r.tau for r in rules if isinstance(r, StateTransitionSimilarityRule)}):
        warn_if_negative_tau(tau, min_layer, stacklevel=stacklevel + 1)


def _settings(model, config: RiverConfig | None, *, rules, exit_head, **fields) -> RiverConfig:
    """The per-model default (or ``config``) with the given fields overriding it."""
    if config is None:
        model_type = getattr(model.config.get_text_config(decoder=True), "model_type", None)
        config = default_config(getattr(model.config, "_name_or_path", None), model_type)
    overrides = {k: v for k, v in fields.items() if v is not None}
    if exit_head is not _KEEP:
        overrides["exit_head"] = exit_head
    if rules is not None:
        overrides["rules"] = [r.to_dict() if isinstance(r, ExitRule) else r for r in rules]
    return dataclasses.replace(config, **overrides)


def _wrap_layers(layers: nn.ModuleList, router: RiverRouter, config: RiverConfig, tuner, report: list,
                 progress: bool) -> tuple[list[int], list[int]]:
    """Build each layer's exit copy and put a RiverLayer in its place; returns the weight bytes of
    each backbone layer and of each exit layer."""
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


@torch.compiler.disable
def _refuse_compile() -> None:
    """Raises RiverError; called while torch.compile traces a River forward pass. Excluded from
    tracing, so it runs (and raises) for real instead of being folded into a graph break."""
    raise RiverError(
        "River models cannot be compiled with torch.compile: the exit decision after each backbone layer is "
        "data-dependent Python control flow; run the model uncompiled (a static cache works uncompiled)"
    )


def _register_verify_hooks(model: nn.Module, router: RiverRouter) -> list:
    """Around each forward of the whole model: a lossless call's backbone passes (prefill,
    verify; not the drafts, which run in ``route`` mode) run inside its verify kernel mode
    (:func:`river_hf.river.lossless.verify_mode`), the LM head included. The exit hook runs even
    when the forward raises, so no mode is left entered."""

    def enter(module, args, kwargs):
        local = router._local
        mode = local.verify_linear if router.mode == LOSSLESS else None
        if mode is not None:
            mode.__enter__()
        local.entered.append(mode)

    def leave(module, args, kwargs, output=None):
        local = router._local
        mode = local.entered.pop() if local.entered else None
        if mode is not None:
            mode.__exit__(None, None, None)

    return [model.register_forward_pre_hook(enter, with_kwargs=True),
            model.register_forward_hook(leave, with_kwargs=True, always_call=True)]


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
        router.begin(kwargs.get("attention_mask"), new_tokens(args, kwargs)[1], cache_of(kwargs))

    def end(module, args, kwargs, output):
        batch, tokens = new_tokens(args, kwargs)
        router.end(batch, tokens, cache_of(kwargs))

    return [stack.register_forward_pre_hook(begin, with_kwargs=True),
            stack.register_forward_hook(end, with_kwargs=True)]
