"""River's decoding loop for fully quantized calls (exit mode), handed to transformers' ``generate`` as
its ``custom_generate`` callable: transformers' public way to replace the decoding loop. ``generate``
still prepares the call (generation config, logits processors and warpers, stopping criteria, the
cache, expanded inputs, the prompt's ``position_ids``) and calls the loop with ``_sample``'s arguments.

Why: a fully quantized decode step of Qwen2.5-Coder-0.5B is about 5 ms of weight products, and
transformers' ``_sample`` spends about 0.5 ms a step around the forward pass on what serves every
model it supports (``prepare_inputs_for_generation``'s general input preparation,
``_update_model_kwargs_for_generation``'s growing position history, the logits copy, the stop
check's wrappers). :func:`exit_decode` does what ``_sample`` does for greedy search and multinomial
sampling, with the step's inputs kept as it goes:

- the prefill: transformers' own (``_prefill``: the model's ``prepare_inputs_for_generation`` and
  forward, :func:`~river_hf.compat.prefill`);
- each decode step: the model's forward on the last tokens ``[batch, 1]``, the call's cache, the
  2-D attention mask with a column of ones appended per step (none when the call has none),
  ``position_ids`` ``[batch, 1]`` one past the last (``_update_model_kwargs_for_generation`` appends
  ``last + 1``, ``prepare_inputs_for_generation`` hands the last column on), and the call's
  ``use_cache`` and ``logits_to_keep``, as ``prepare_inputs_for_generation`` passes them on; where
  nothing needs the forward's glue (no hooks on the modules it skips, the fused exit stack, River's
  growing cache), :class:`~river_hf.river.exit_step.ExitStep` does that forward's work itself;
- the scores: the last position's logits in fp32 through the call's logits processors (each called in
  turn, as ``LogitsProcessorList`` calls them, without its per-step reading of their signatures); the token:
  their argmax (``river_int4.argmax``: torch's answer in one vectorized pass), or a multinomial draw
  from their softmax (``do_sample``); finished rows get the pad token
  when a criterion stops at EOS; then the call's stopping criteria; a streamer gets the prompt, each
  step's tokens and ``end``, as from ``generate`` and ``_sample``;
- returns ``input_ids`` ``[batch, prompt + new]`` (long), or with ``return_dict_in_generate`` a
  ``GenerateDecoderOnlyOutput`` (``sequences``, ``scores`` / ``logits`` when asked, ``cache``).

So the same forward calls on the same tensors as ``_sample``, and the same tokens and scores
(``tests/test_decode_loop.py`` compares them bit for bit). :func:`serves_call` says which calls River
hands it (exit mode, greedy or sampling); inside, a call whose model inputs hold anything else than a 2-D mask, the cache,
``position_ids``, ``use_cache`` and ``logits_to_keep`` runs transformers' ``_sample``.
"""

from __future__ import annotations

import inspect

import torch
from transformers.generation import GenerateDecoderOnlyOutput, GenerationMode, LogitsProcessorList

from ..compat import pad_token_tensor, prefill, prepare_generation_config, sample_loop
from ..quant.river_int4 import argmax
from .exit_step import ExitStep

__all__ = ["exit_decode", "serves_call"]

#: keyword arguments of ``generate`` that bring their own decoding loop or drafter, or need transformers' loop
_OWN_LOOP = ("custom_generate", "assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit", "synced_gpus",
             "negative_prompt_ids")
#: the model inputs this loop carries from step to step (anything else: transformers' loop)
_CARRIED = frozenset({"attention_mask", "cache", "position_ids", "use_cache", "inputs_embeds", "logits_to_keep"})


def _direct(processors):
    """``processors`` as one callable ``(input_ids, scores) -> scores``: each processor called in turn, as
    ``LogitsProcessorList.__call__`` calls one whose ``__call__`` takes two arguments (it reads each one's
    signature at every step); the list itself when it is another class or holds a processor that takes
    more (the list then says what it lacks)."""
    if type(processors) is not LogitsProcessorList or any(
            len(inspect.signature(p.__call__).parameters) > 2 for p in processors):
        return processors
    processors = tuple(processors)

    def process(input_ids, scores):
        for processor in processors:
            scores = processor(input_ids, scores)
        return scores

    return process


def serves_call(model, args: tuple, kwargs: dict, generation_config) -> bool:
    """Whether River hands ``model.generate(*args, **kwargs)`` to :func:`exit_decode`: nothing in
    :data:`_OWN_LOOP`, and the config ``generate`` will use (``compat.prepare_generation_config``) asks
    greedy search or sampling, no ``output_attentions`` / ``output_hidden_states``, no chunked prefill,
    no stop strings or token healing (they need the call's ``tokenizer``, which transformers passes on to
    its own loops' preparation and drops for a custom loop). The caller checks the mode (exit). A config that does not validate is left to ``generate`` to say so."""
    if any(kwargs.get(name) is not None for name in _OWN_LOOP) or len(args) > 2:
        return False
    try:
        config, _ = prepare_generation_config(model, generation_config, **kwargs)
    except ValueError:
        return False
    return (config.get_generation_mode() in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)
            and not config.output_attentions and not config.output_hidden_states
            and getattr(config, "prefill_chunk_size", None) is None and config.use_cache is not False
            and not getattr(config, "stop_strings", None) and not getattr(config, "token_healing", False)
            and (kwargs.get("streamer") is None or config.num_return_sequences == 1))


def exit_decode(model, input_ids: torch.LongTensor, logits_processor, stopping_criteria, generation_config,
                synced_gpus: bool = False, streamer=None, **model_kwargs):
    """The decoding loop (module docstring), called by ``generate`` with ``_sample``'s arguments:
    ``input_ids`` ``[batch, prompt]`` long, the call's ``LogitsProcessorList`` and
    ``StoppingCriteriaList``, its prepared ``GenerationConfig`` and the model keyword arguments
    (``cache``, ``attention_mask`` ``[batch, prompt]``, ``position_ids``, ``use_cache``). transformers
    hands a custom loop no streamer, and puts no prompt into one it does not hand on: River binds the
    call's ``streamer`` here (``functools.partial``), which gets the prompt, each step's tokens and
    ``end`` as ``generate`` and ``_sample`` give them. Returns what ``_sample`` returns. Raises what the
    model's forward raises."""
    if streamer is not None:
        streamer.put(input_ids.cpu())
    cache = model_kwargs.get("cache")
    mask = model_kwargs.get("attention_mask")
    positions = model_kwargs.get("position_ids")
    if (synced_gpus or cache is None or positions is None or positions.dim() != 2
            or getattr(cache, "is_compileable", False) or not model_kwargs.keys() <= _CARRIED
            or model_kwargs.get("inputs_embeds") is not None or (mask is not None and mask.dim() != 2)):
        return sample_loop(model, input_ids, logits_processor, stopping_criteria, generation_config,
                           synced_gpus=synced_gpus, streamer=streamer, **model_kwargs)
    want_dict = generation_config.return_dict_in_generate
    scores = () if want_dict and generation_config.output_scores else None
    raw_logits = () if want_dict and generation_config.output_logits else None
    do_sample = generation_config.do_sample
    pad = pad_token_tensor(generation_config)
    eos_stops = any(hasattr(criteria, "eos_token_id") for criteria in stopping_criteria)
    batch = input_ids.shape[0]
    unfinished = torch.ones(batch, dtype=torch.long, device=input_ids.device)
    # what prepare_inputs_for_generation hands on to each step besides the inputs it makes
    passed = {k: model_kwargs[k] for k in ("use_cache", "logits_to_keep") if k in model_kwargs}
    process = _direct(logits_processor)

    logits = prefill(model, input_ids, generation_config, model_kwargs).logits
    position = positions[:, -1:]
    # the steps without the forward's glue where nothing needs it (river.exit_step), else the model's forward
    step = ExitStep.prepare(model, cache, mask, passed.get("logits_to_keep", 0))
    try:
        while True:
            logits = logits[:, -1].to(copy=raw_logits is not None, dtype=torch.float32)
            next_scores = process(input_ids, logits)
            if scores is not None:
                scores += (next_scores,)
            if raw_logits is not None:
                raw_logits += (logits,)
            if do_sample:
                tokens = torch.multinomial(torch.softmax(next_scores, dim=-1), num_samples=1).squeeze(1)
            else:
                tokens = argmax(next_scores)  # torch.argmax's answer, one vectorized pass where river-int4 is loaded
            if eos_stops:
                tokens = tokens * unfinished + pad * (1 - unfinished)
            input_ids = torch.cat([input_ids, tokens[:, None]], dim=-1)
            unfinished = unfinished & ~stopping_criteria(input_ids, scores)
            if streamer is not None:
                streamer.put(tokens.cpu())
            if unfinished.max() == 0:
                break
            if mask is not None:
                mask = torch.cat([mask, mask.new_ones((batch, 1))], dim=-1)
            position = position + 1
            if step is not None:
                logits = step(tokens[:, None], position, mask)
                continue
            inputs = {"input_ids": tokens[:, None], "cache": cache, "position_ids": position, **passed}
            if mask is not None:
                inputs["attention_mask"] = mask
            logits = model(**inputs, return_dict=True).logits
    finally:
        if step is not None:
            step.close()
    if streamer is not None:
        streamer.end()
    if not want_dict:
        return input_ids
    return GenerateDecoderOnlyOutput(sequences=input_ids, scores=scores, logits=raw_logits, cache=cache)
