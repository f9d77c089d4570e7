"""The one seam between river-hf and transformers' internals.

Every private transformers name river-hf uses (a name that starts with ``_``: a method of
``GenerationMixin`` or ``PreTrainedModel``, an attribute of a config) and every switch on the
transformers version lives in this module; ``tests/test_compat.py`` fails when one is used
anywhere else in the package. Each entry says what it is for, why no public extension point does
the job, and on which transformers versions it was checked (the range ``pyproject.toml`` allows:
5.24.0 and 5.25.0 today; CI runs the exactness, lossless, save/load and serve tests on the oldest
and the whole suite on the newest).

What river-hf uses instead of private names, where transformers has a public way:
``generate``'s own loop, logits processors, stopping criteria and streamers; the public
``CandidateGenerator`` interface for lossless mode's drafter (``get_candidates``,
``update_candidate_strategy``, ``num_drafting_tokens``); the ``Cache`` API (``crop``,
``get_seq_length``, ``activate_past_recording``); ``config.name_or_path``; the Auto classes and
their public ``MODEL_FOR_*_MAPPING_NAMES``; ``generate(custom_generate=...)`` for R-Stitch's
recipe. ``river-hf serve`` is river-hf's own FastAPI app over ``model.generate`` and uses no
serving internals.
"""

from __future__ import annotations

import transformers
from packaging.version import Version
from transformers.integrations.sdpa_attention import pack_gqa, repeat_kv, use_gqa_in_sdpa

__all__ = ["TRANSFORMERS_VERSION", "CHECKED_VERSIONS", "PRIVATE_NAMES", "GenerationHooks", "prepare_generation_config",
           "eos_token_ids", "attn_implementation", "auto_class_supports", "build_from_config",
           "prepare_lengths", "logits_processors", "stopping_criteria",
           "architecture_forwards", "sdpa_gqa", "dynamic_slots"]

#: The installed transformers version.
TRANSFORMERS_VERSION = Version(transformers.__version__)

#: The transformers versions every entry below was checked on (by the test suite).
CHECKED_VERSIONS = ("5.24.0", "5.25.0")

#: Every private transformers name used here, with what it is for. ``tests/test_compat.py`` reads
#: this table: a private name of transformers used outside this module fails it, and so does a
#: name used here but missing from the table.
PRIVATE_NAMES = {
    # -- generation hooks River overrides (GenerationHooks): generate has no public hook for them
    "_get_candidate_generator": "lossless mode hands transformers' assisted-decoding loop River's drafter; "
                                "generate(custom_generate=...) would replace the whole loop, and "
                                "assistant_model= only takes a model, not a CandidateGenerator",
    "_get_stopping_criteria": "lossless mode wraps the call's criteria so a stop inside a round stops there "
                              "(FirstStop); R-Stitch builds generate's criteria for its own loop",
    "_prepare_cache_for_generation": "River builds a RiverCache where transformers would build a DynamicCache "
                                     "(the per-step exit record); a cache passed by the user is left alone",
    "_valid_auto_compile_criteria": "River models are never auto-compiled (the exit decision is data-dependent "
                                    "control flow); generation_config.disable_compile would need every caller "
                                    "to set it",
    "_supports_default_dynamic_cache": "the same test transformers applies before building its default cache",
    "_from_config": "what AutoModelForCausalLM.from_config calls through a River folder's auto_map; the "
                    "architecture's class builds a fresh model through it (its public from_config exists only "
                    "on the Auto classes)",
    # -- generate's preparation steps, for code that must see the config generate will use
    "_prepare_generation_config": "the call's GenerationConfig merged with the model's and the keyword "
                                  "arguments, exactly as generate merges them (lossless mode's checks, R-Stitch)",
    "_prepare_special_tokens": "R-Stitch's loop: EOS/pad tensors as generate prepares them",
    "_prepare_generated_length": "R-Stitch's loop: max_length/min_length as generate computes them",
    "_validate_generated_length": "R-Stitch's loop: generate's own length checks and messages",
    "_get_logits_processor": "R-Stitch's loop: generate's processors and warpers, in generate's order",
    "_eos_token_tensor": "the EOS ids generate prepared (after _prepare_special_tokens); drafts stop at them",
    "_pad_token_tensor": "the pad id generate prepared: River's decoding loop gives it to finished rows, as "
                         "_sample does",
    "_prefill": "River's decoding loop (generate's custom_generate callable) reads the prompt exactly as "
                "_sample does (input slicing after a cache, chunked prefill, the first iteration's inputs)",
    "_sample": "what River's decoding loop hands a call back to when its model inputs are ones the loop does not "
               "carry: transformers' own loop for greedy search and sampling",
    "_model_mapping": "whether an Auto class maps a config's class, classes registered with "
                      "AutoModelForMaskedLM.register included (the public MODEL_FOR_*_MAPPING_NAMES lists only "
                      "transformers' own model types)",
    # -- configs
    "_attn_implementation": "the attention kernel in force (eager needs an additive mask); transformers has "
                            "no public reader for it",
    "_attn_implementation_internal": "what the _attn_implementation property returns, read from the config's "
                                     "instance dict: ~0.6 µs instead of ~10 µs through PreTrainedConfig's "
                                     "__getattribute__ overrides (the fused exit layers read it each pass)",
}


class GenerationHooks:
    """transformers' private generation hooks, overridden once, here, for ``RiverForCausalLM``.

    Each hook asks a public-named River method first and falls back to transformers' own:

    - ``_get_candidate_generator`` → ``self.river_candidate_generator(generation_config,
      logits_processor)`` (None: transformers' own choice);
    - ``_get_stopping_criteria`` → ``self.river_stopping_criteria(criteria)``;
    - ``_prepare_cache_for_generation`` → ``self.river_default_cache(generation_config)`` where
      transformers would build its default ``DynamicCache`` (no cache given,
      ``cache_implementation`` None or ``"dynamic"``, the model supports it);
    - ``_valid_auto_compile_criteria`` → ``self.river_check_compile(generation_config)``, then
      never compile;
    - ``_from_config`` (classmethod) → ``cls.from_config``.

    Checked on transformers 5.24.0 and 5.25.0 (same signatures).
    """

    def _get_candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                                 assistant_model=None, target_tokenizer=None, assistant_tokenizer=None):
        candidates = self.river_candidate_generator(generation_config, logits_processor)
        if candidates is not None:
            return candidates
        return super()._get_candidate_generator(
            generation_config=generation_config, input_ids=input_ids, inputs_tensor=inputs_tensor,
            logits_processor=logits_processor, model_kwargs=model_kwargs, assistant_model=assistant_model,
            target_tokenizer=target_tokenizer, assistant_tokenizer=assistant_tokenizer)

    def _get_stopping_criteria(self, generation_config, stopping_criteria, tokenizer=None):
        return self.river_stopping_criteria(super()._get_stopping_criteria(generation_config, stopping_criteria,
                                                                           tokenizer))

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        user_cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
        if (user_cache is None and generation_config.use_cache is not False
                and generation_config.cache_implementation in (None, "dynamic")
                and self._supports_default_dynamic_cache()):
            model_kwargs["cache"] = self.river_default_cache(generation_config)
            return None
        return super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)

    def _valid_auto_compile_criteria(self, model_kwargs, generation_config) -> bool:
        self.river_check_compile(generation_config)
        return False

    @classmethod
    def _from_config(cls, config, **kwargs):
        return cls.from_config(config, **kwargs)


def prefill(model, input_ids, generation_config, model_kwargs: dict):
    """The prompt's forward pass as ``_sample`` runs it (``model._prefill``; transformers 5.24-5.25):
    the model's ``prepare_inputs_for_generation`` and forward; returns the model's output."""
    return model._prefill(input_ids, generation_config, model_kwargs,
                          is_first_iteration=not generation_config.is_assistant)


def sample_loop(model, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs):
    """transformers' own decoding loop for greedy search and sampling (``_sample``), with its
    arguments."""
    return model._sample(input_ids, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                         generation_config=generation_config, **kwargs)


def pad_token_tensor(generation_config):
    """The pad id tensor ``generate`` prepared (``_pad_token_tensor``), or None."""
    return generation_config._pad_token_tensor


def prepare_generation_config(model, generation_config, **kwargs):
    """``(config, unused_kwargs)``: the ``GenerationConfig`` ``model.generate(generation_config,
    **kwargs)`` would use (the call's config, else a fresh one, with the model's
    ``generation_config`` filling what it leaves unset, then the keyword arguments) and the
    keyword arguments that are not generation settings. Raises ``ValueError`` as
    ``GenerationConfig.validate`` does. transformers 5.24-5.25: ``_prepare_generation_config``."""
    return model._prepare_generation_config(generation_config, **kwargs)


def eos_token_ids(generation_config) -> set[int] | None:
    """The EOS token ids of a ``GenerationConfig`` that ``generate`` has prepared (inside a
    ``generate`` call), as a set, or None. transformers 5.24-5.25: ``_eos_token_tensor``."""
    import torch

    eos = getattr(generation_config, "_eos_token_tensor", None)
    return None if eos is None else set(torch.atleast_1d(eos).tolist())


def attn_implementation(config, default: str = "sdpa") -> str:
    """The attention implementation a config selects (``"eager"``, ``"sdpa"``, ...), ``default``
    when unset. transformers 5.24-5.25: ``PretrainedConfig._attn_implementation``, a property that
    returns ``_attn_implementation_internal``; that one is read from the instance's ``__dict__``
    directly where it is set (the property's value, without the config's ``__getattribute__``
    overrides: ~0.6 µs instead of ~10), the property otherwise."""
    try:
        impl = object.__getattribute__(config, "__dict__")["_attn_implementation_internal"]
    except (AttributeError, KeyError, TypeError):
        impl = getattr(config, "_attn_implementation", None)
    return impl or default


def auto_class_supports(auto_class, config) -> bool:
    """Whether ``auto_class`` (e.g. ``AutoModelForMaskedLM``) has a model class for ``config``'s
    class, including classes registered with ``auto_class.register``."""
    return type(config) in auto_class._model_mapping


def build_from_config(model_class, config, **kwargs):
    """A freshly initialised ``model_class`` (an architecture's class, e.g. ``LlamaForCausalLM``)
    of ``config``, as ``AutoModelForCausalLM.from_config`` builds one (``dtype``,
    ``attn_implementation``, ... in ``kwargs``); ``model_class`` may also be an Auto class."""
    if issubclass(model_class, transformers.PreTrainedModel):
        return model_class._from_config(config, **kwargs)
    return model_class.from_config(config, **kwargs)


def prepare_lengths(model, config, input_ids, *, has_mask: bool, has_default: dict):
    """generate's preparation of a merged ``config`` for a loop that is not ``generate``'s
    (R-Stitch), in generate's order: the special-token tensors, then ``max_length`` /
    ``min_length``, then generate's own length checks. ``input_ids``: ``LongTensor [1, n]``, the
    prompt with its padding; ``has_mask``: an attention mask was given; ``has_default``:
    ``{"max_length": bool, "min_length": bool}``, whether the user left them unset.
    Returns the config. Raises ``ValueError`` with generate's message (the prompt is already
    ``max_length`` long)."""
    n_in = input_ids.shape[1]
    model._prepare_special_tokens(config, has_mask, device=input_ids.device, batch_size=1)
    config = model._prepare_generated_length(
        generation_config=config, has_default_max_length=has_default["max_length"],
        has_default_min_length=has_default["min_length"], model_input_name="input_ids", input_ids_length=n_in,
        inputs_tensor=input_ids)
    model._validate_generated_length(config, n_in, has_default["max_length"])
    return config


def logits_processors(model, config, input_ids, *, logits_processor, prefix_allowed_tokens_fn, model_kwargs: dict):
    """generate's ``LogitsProcessorList`` (processors and warpers, in generate's order) for a
    prepared ``config``, the user's ``logits_processor`` list merged in as generate merges it."""
    from transformers import LogitsProcessorList

    return model._get_logits_processor(
        generation_config=config, input_ids_seq_length=input_ids.shape[1], encoder_input_ids=input_ids,
        prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
        logits_processor=logits_processor if logits_processor is not None else LogitsProcessorList(),
        device=input_ids.device, model_kwargs=model_kwargs)


def stopping_criteria(model, config, criteria, tokenizer):
    """generate's ``StoppingCriteriaList`` for a prepared ``config`` (max length, EOS, stop
    strings with ``tokenizer``), the user's ``criteria`` merged in as generate merges them."""
    from transformers import StoppingCriteriaList

    return model._get_stopping_criteria(
        generation_config=config, stopping_criteria=criteria if criteria is not None else StoppingCriteriaList(),
        tokenizer=tokenizer)


def architecture_forwards(module) -> int:
    """Give every submodule of ``module`` its class's own ``forward`` back: drop the per-instance
    ``forward`` that transformers >= 5.25's ``kernelize`` (``from_pretrained(use_kernels=True)``,
    the default there; the ``kernels`` library) sets on layers it swaps for a Hub kernel. River's
    exit copies run on River's own quantized Linears, which a Hub kernel written for ``nn.Linear``
    weights cannot read, so exit copies always run the architecture's torch code; the backbone keeps
    whatever ``from_pretrained`` chose (so τ > 1 stays the plain model's path). Returns how many
    modules had one. Checked on 5.25.0 (kernels 0.19: ``module.forward = MethodType(...)``)."""
    dropped = 0
    for sub in module.modules():
        if "forward" in sub.__dict__ and "_kernel_repo" in sub.__dict__:
            del sub.__dict__["forward"]
            sub.__dict__.pop("_kernel_repo", None)
            dropped += 1
    return dropped


def sdpa_gqa(query, keys, values, mask, rep: int):
    """``(query, keys, values, mask, enable_gqa)`` as transformers' ``sdpa`` attention hands grouped
    heads to ``scaled_dot_product_attention`` (``rep`` query heads per K/V head), by its own helpers
    in ``transformers.integrations.sdpa_attention``: ``enable_gqa`` where ``use_gqa_in_sdpa`` says
    so, else for one query token ``pack_gqa`` of the query and the mask, else ``repeat_kv`` of K/V.
    River's fused exit layers call it so that they hand SDPA what the architecture's layer does
    (bit for bit on a padded batch). Checked on 5.24.0 and 5.25.0 (the same logic in both)."""
    if rep <= 1:
        return query, keys, values, mask, False
    if use_gqa_in_sdpa(mask, keys, values):
        return query, keys, values, mask, True
    if query.shape[2] == 1:
        return pack_gqa(query, rep), keys, values, pack_gqa(mask, rep), False
    return query, repeat_kv(keys, rep), repeat_kv(values, rep), mask, False


def dynamic_slots(cache, indices, growing: tuple = ()) -> list | None:
    """The cache layers (slots) ``indices`` of ``cache`` when updating each through ``cache.update``
    comes down to ``DynamicLayer.update`` on an initialized layer: ``keys = cat([keys, new], -2)``,
    ``values`` likewise, both returned. Then River's exit stack (:mod:`river_hf.river.fused_llama`)
    does that update itself and assigns the layer's ``keys`` / ``values``, with the same tensors as
    a result. None for anything else: another cache class, a subclass that overrides ``update``, an
    offloading cache, a slot that is not exactly a ``DynamicLayer`` (sliding window, quantized,
    static) or is not initialized yet. ``growing``: slot classes accepted too, whose update the
    caller does its own way (River's ``GrowingLayer``: :mod:`river_hf.river.cache`). Checked on
    5.24.0 and 5.25.0 (``Cache.update``: ``layers[i].update`` plus offloading;
    ``DynamicLayer.update``: the lazy initialization and the two ``cat``)."""
    from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

    if not isinstance(cache, DynamicCache) or type(cache).update is not Cache.update or cache.offloading:
        return None
    layers = cache.layers
    slots = []
    for i in indices:
        layer = layers[i] if i < len(layers) else None
        if (type(layer) is not DynamicLayer and type(layer) not in growing) or not layer.is_initialized:
            return None
        slots.append(layer)
    return slots
