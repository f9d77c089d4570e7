"""R-Stitch decoding: one answer written by a small (SLM) and a large (LLM) causal LM together.

Source: R-Stitch (arXiv 2507.17307), Sec. 3 (method): a token's uncertainty is the normalized
entropy of the active model's next-token distribution; the SLM leads, a token whose entropy
exceeds the threshold τ is handed to the LLM, and the LLM hands back as soon as its own entropy is
at most τ. Each model keeps its own KV cache and, on becoming active, catches up on the tokens the
other model wrote by one partial-prefill forward. Sec. 3 (latency estimator) is in
:mod:`river_hf.stitch.latency`.

Implementation notes (what this module does where the paper leaves a choice):

- Entropy is taken on the model's **raw** next-token distribution (softmax of the unprocessed
  logits, float32), before any temperature / top-k / top-p / repetition-penalty processor, so the
  switching rule does not depend on the sampling settings. Tokens are then chosen from the
  processed scores exactly as ``generate`` does (greedy argmax or multinomial sampling).
- Vocabulary: Qwen checkpoints pad their embedding matrix (config ``vocab_size`` 151936, tokenizer
  151665 tokens). Logits are cut to the shared vocabulary size ``V`` (``len(tokenizer)`` when a
  tokenizer is given, otherwise the smaller of the two configs' ``vocab_size``) before the
  softmax, the entropy (normalised by ``log V``) and the argmax, so both models choose from, and
  are compared on, the same token set.
- Roll-back: a model's KV cache only ever holds accepted tokens. The SLM's token at position t is
  produced by the forward over position t-1 and is written into the cache only by the *next*
  forward; when it is discarded it was never cached, so the paper's "roll the SLM's KV cache back
  one position" is already true. ``DynamicCache.crop`` is still called to enforce the invariant
  ``cache length == tokens the model has seen`` after every forward.
- Exactness switches: τ < 0 never accepts an SLM token (H ≥ 0 > τ), so the SLM is not run at all
  and the result is the LLM's own decoding; τ ≥ 1 always accepts (H ≤ 1), so it is the SLM's.
- Catch-up forwards (a few tokens on top of a non-empty cache) of a model whose weights are float32
  on the CPU run under :class:`~river_hf.quant.dense.SmallBatchLinear` by default: there, torch's stock
  ``F.linear`` makes a 2-4-token forward cost as much as 2-2.9 one-token steps, which taxes every
  hand-over; the mode computes those products in the faster orientation (same result up to fp32
  summation order). bf16/fp16 weights and GPUs show no such gap, so the mode is not entered there
  (it would reroute nothing and only add its Python dispatch). The first prefill of each model and
  every one-token step use the stock path, so the exactness switches still match ``generate``
  token for token. ``small_batch_linear=False`` turns it off.
- Generation settings: prepared by transformers' own ``GenerationMixin`` steps with the LLM's
  generation config as the base (see :func:`generate`), so a field ``llm.generate`` honours is
  honoured here, or refused by name. The processors act on the first ``V`` logit columns (the
  cut above).
- Batch size 1 only, by design: each sequence switches models at its own positions, so in a batch
  some rows would need the SLM and others the LLM at the same step, with per-row cache lengths that
  ``DynamicCache.crop`` (whole-batch) cannot keep; running both models on every row would give up
  the saving R-Stitch is for. A larger batch raises :class:`~river_hf.errors.RiverError`.
- The call's :class:`StitchStats` are returned (``StitchOutput.stats``); the models are not modified.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from typing import Any

import torch
from transformers import DynamicCache, GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation import GenerationMode
from transformers.utils import ModelOutput

from ..compat import logits_processors, prepare_generation_config, prepare_lengths
from ..compat import stopping_criteria as generate_criteria
from ..errors import RiverError
from ..quant.dense import SmallBatchLinear

__all__ = ["generate", "normalized_entropy", "check_pair", "shared_vocab_size", "StitchOutput", "StitchStats", "SLM", "LLM"]

#: values of ``StitchOutput.sources``
SLM, LLM = 0, 1


@dataclasses.dataclass
class StitchStats:
    """What one :func:`generate` call did.

    Attributes:
        slm_tokens / llm_tokens: new tokens kept from each model.
        handovers: times the active model changed (SLM→LLM and LLM→SLM both count).
        slm_forwards / llm_forwards: forward passes per model (prefill and catch-up included).
        slm_seconds / llm_seconds: wall time spent in each model's forwards, seconds.
        seconds: wall time of the whole call, seconds.
        forward_log: one ``(model, tokens_processed, cache_length_before, seconds)`` tuple per
            forward, ``model`` being ``"slm"`` or ``"llm"``; input of the latency estimator.
    """

    slm_tokens: int = 0
    llm_tokens: int = 0
    handovers: int = 0
    slm_forwards: int = 0
    llm_forwards: int = 0
    slm_seconds: float = 0.0
    llm_seconds: float = 0.0
    seconds: float = 0.0
    forward_log: list = dataclasses.field(default_factory=list)

    @property
    def new_tokens(self) -> int:
        return self.slm_tokens + self.llm_tokens

    @property
    def slm_fraction(self) -> float:
        """Fraction of the new tokens written by the SLM (0 when nothing was generated)."""
        return self.slm_tokens / self.new_tokens if self.new_tokens else 0.0

    def to_dict(self, with_log: bool = False) -> dict:
        d = dataclasses.asdict(self)
        if not with_log:
            d.pop("forward_log")
        d["new_tokens"] = self.new_tokens
        d["slm_fraction"] = self.slm_fraction
        return d


@dataclasses.dataclass
class StitchOutput(ModelOutput):
    """Output of :func:`generate` with ``return_dict_in_generate=True``.

    Attributes:
        sequences: ``LongTensor [1, prompt_len + new_tokens]``, prompt followed by the new tokens
            (as ``generate``'s ``sequences``).
        sources: ``LongTensor [1, new_tokens]``, 0 (:data:`SLM`) or 1 (:data:`LLM`) per new token.
        entropies: ``FloatTensor [1, new_tokens]``, normalized entropy in [0, 1] of the distribution
            the kept token came from (the source model's).
        stats: :class:`StitchStats` of the call.
    """

    sequences: torch.LongTensor | None = None
    sources: torch.LongTensor | None = None
    entropies: torch.FloatTensor | None = None
    stats: StitchStats | None = None


def normalized_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Normalized entropy H = -Σ p log p / log V of ``softmax(logits)`` over the last dimension.

    Args:
        logits: ``[..., V]`` any float dtype (computed in float32), already cut to the shared
            vocabulary.

    Returns:
        ``float32 [...]`` in [0, 1]: 0 for a one-hot distribution, 1 for the uniform one.

    Source: R-Stitch (arXiv 2507.17307) Sec. 3, uncertainty of a decoding step.
    """
    p = torch.softmax(logits.float(), dim=-1)
    return torch.special.entr(p).sum(-1) / math.log(logits.shape[-1])


def shared_vocab_size(slm, llm, tokenizer=None) -> int:
    """The vocabulary size both models choose from: ``len(tokenizer)`` if given, else the smaller
    config ``vocab_size`` (the larger one is padding). Raises RiverError if the tokenizer is
    larger than a model's output layer."""
    sizes = [m.config.get_text_config().vocab_size for m in (slm, llm)]
    v = min(sizes)
    if tokenizer is not None:
        if len(tokenizer) > v:
            raise RiverError(
                f"the tokenizer has {len(tokenizer)} tokens but a model's output layer only {v}; "
                "use a tokenizer that belongs to both models"
            )
        v = len(tokenizer)
    return v


def _vocab_signature(tok) -> tuple:
    return (tok.get_vocab(), tok.eos_token_id, tok.bos_token_id, tok.pad_token_id)


def check_pair(slm, llm, slm_tokenizer=None, llm_tokenizer=None) -> None:
    """Refuse an SLM/LLM pair that cannot share token ids.

    Checks the models' special-token ids (bos/eos in their generation configs) always, and the two
    tokenizers' full vocabularies when both are given.

    Raises:
        RiverError: the tokenizers (or the special tokens) differ.
    """
    if slm_tokenizer is not None and llm_tokenizer is not None and slm_tokenizer is not llm_tokenizer:
        if _vocab_signature(slm_tokenizer) != _vocab_signature(llm_tokenizer):
            raise RiverError(
                "the SLM and the LLM use different tokenizers (vocabularies or special tokens differ); "
                "R-Stitch needs a pair that shares one tokenizer, e.g. qwen2.5-coder-0.5b with qwen2.5-coder-1.5b"
            )
    for attr in ("eos_token_id", "bos_token_id"):
        a = getattr(slm.generation_config, attr, None)
        b = getattr(llm.generation_config, attr, None)
        if a is not None and b is not None and a != b:
            raise RiverError(
                f"the SLM and the LLM disagree on {attr} ({a} vs {b}): they do not share a tokenizer; "
                "pick two models of one family"
            )


def _small_batch_linear_helps(model) -> bool:
    """True where :class:`~river_hf.quant.dense.SmallBatchLinear` can change anything: a model whose
    weights are float32 on the CPU. Elsewhere (bf16/fp16, a GPU) the mode reroutes nothing and would
    only add its Python dispatch to every torch call of the forward."""
    return model.device.type == "cpu" and model.dtype == torch.float32


class _Runner:
    """One model with its own KV cache; ``step(seq)`` catches up on ``seq`` and returns the logits
    of the next position."""

    def __init__(self, name: str, model, stats: StitchStats, small_batch_linear: bool = True):
        self.name, self.model, self.stats = name, model, stats
        self.small_batch_linear = small_batch_linear and _small_batch_linear_helps(model)
        self.cache = DynamicCache(config=model.config)
        self.seen = 0  # tokens of the running sequence in the cache

    @torch.no_grad()
    def step(self, seq: torch.LongTensor) -> torch.Tensor:
        chunk = seq[:, self.seen :]
        if chunk.shape[1] == 0:  # cannot happen in the loop below; guards the invariant
            raise AssertionError(f"{self.name}: nothing new to process")
        cache_len = self.seen
        t0 = time.perf_counter()
        catch_up = self.small_batch_linear and cache_len > 0 and chunk.shape[1] > 1
        with SmallBatchLinear() if catch_up else contextlib.nullcontext():
            out = self.model(input_ids=chunk, cache=self.cache, use_cache=True, logits_to_keep=1)
        dt = time.perf_counter() - t0
        self.seen = seq.shape[1]
        extra = self.cache.get_seq_length() - self.seen
        if extra:  # keep "cache = accepted tokens" exact (crop takes minus the tokens to drop)
            self.cache.crop(-extra)
        s = self.stats
        if self.name == "slm":
            s.slm_forwards += 1
            s.slm_seconds += dt
        else:
            s.llm_forwards += 1
            s.llm_seconds += dt
        s.forward_log.append((self.name, int(chunk.shape[1]), cache_len, dt))
        return out.logits[:, -1, :].to(dtype=torch.float32)


# GenerationConfig fields that make llm.generate leave greedy search / sampling
_MODE_FIELDS = ("num_beams", "num_beam_groups", "constraints", "force_words_ids", "penalty_alpha", "dola_layers",
                "prompt_lookup_num_tokens", "assistant_early_exit", "use_mtp")


def _refuse_unsupported(cfg: GenerationConfig) -> None:
    """Raise RiverError naming the first GenerationConfig setting that ``llm.generate`` would act on
    but R-Stitch cannot. Every other field is honoured through transformers' own processors and
    stopping criteria, or (``use_cache``, ``compile_config``, beam-only fields) changes nothing for
    greedy search / sampling with a dynamic cache in ``generate`` either."""
    mode = cfg.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        default = GenerationConfig()
        culprits = [f for f in _MODE_FIELDS if getattr(cfg, f, None) != getattr(default, f, None)
                    and not (f in ("num_beams", "num_beam_groups") and getattr(cfg, f) in (None, 1))]
        one = len(culprits) == 1
        raise RiverError(
            f"R-Stitch decodes by greedy search or sampling (num_beams=1); {', '.join(culprits) or 'these settings'} "
            f"select{'s' if one else ''} {mode.value} instead: drop {'it' if one else 'them'}"
        )
    refused = [
        ("num_return_sequences", cfg.num_return_sequences not in (None, 1),
         "it returns one sequence per call: call it once per sample (with sampling, each call draws anew)"),
        ("guidance_scale", cfg.guidance_scale not in (None, 1), "it has no classifier-free guidance: drop it"),
        ("watermarking_config", cfg.watermarking_config is not None, "it has no watermarking: drop it"),
        ("token_healing", bool(cfg.token_healing), "it does not heal the prompt's last token: drop it"),
        ("cache_implementation", cfg.cache_implementation is not None,
         "each model keeps its own DynamicCache (cropped at every hand-over): drop it"),
        ("prefill_chunk_size", cfg.prefill_chunk_size is not None, "it prefills the prompt in one forward: drop it"),
    ]
    if cfg.return_dict_in_generate:
        for name in ("output_scores", "output_logits", "output_attentions", "output_hidden_states"):
            refused.append((name, bool(getattr(cfg, name)),
                            "its output carries sources, entropies and stats, not per-step tensors: drop it"))
    for name, is_set, why in refused:
        if is_set:
            raise RiverError(f"R-Stitch does not support {name}={getattr(cfg, name)!r}: {why}")


@torch.no_grad()
def generate(
    slm,
    llm,
    input_ids: torch.LongTensor,
    *,
    tau: float,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int | None = None,
    eos_token_id: int | list[int] | None = None,
    generation_config: GenerationConfig | None = None,
    logits_processor: LogitsProcessorList | None = None,
    stopping_criteria: StoppingCriteriaList | None = None,
    prefix_allowed_tokens_fn=None,
    streamer=None,
    return_dict_in_generate: bool | None = None,
    tokenizer=None,
    assistant_tokenizer=None,
    vocab_size: int | None = None,
    small_batch_linear: bool = True,
    **generation_kwargs: Any,
) -> torch.LongTensor | StitchOutput:
    """Decode with R-Stitch: the SLM writes the tokens it is sure of, the LLM the others.

    Generation settings are prepared exactly as ``llm.generate`` prepares them (transformers 5.24
    ``GenerationMixin``: ``_prepare_generation_config``, ``_prepare_special_tokens``,
    ``_prepare_generated_length``, ``_get_logits_processor``, ``_get_stopping_criteria``), with the
    LLM's generation config as the base. So ``max_length`` / ``max_new_tokens``, ``min_length`` /
    ``min_new_tokens``, ``max_time``, ``stop_strings``, EOS ids, ``bad_words_ids``,
    ``exponential_decay_length_penalty``, repetition penalties, forced BOS/EOS, suppressed tokens,
    ``do_sample`` with its warpers (temperature, top-k/p, min-p, typical, ...) act on both models'
    tokens as in ``generate``; a setting R-Stitch cannot honour raises :class:`RiverError` naming it.

    Args:
        slm: small causal LM (``PreTrainedModel`` with ``generate``), leads at the first position.
        llm: large causal LM sharing the SLM's tokenizer.
        input_ids: ``LongTensor [1, prompt_len]`` on the models' device.
        tau: normalized-entropy threshold τ. SLM token kept iff its H ≤ τ; the LLM keeps leading
            while its H > τ. ``tau < 0``: LLM only; ``tau >= 1``: SLM only (exactness switches).
        attention_mask: ``[1, prompt_len]`` of 0/1; padded (0) positions are dropped from the
            prompt the models see (batch 1 needs no padding). Processors, stopping criteria, the
            streamer and the returned ``sequences`` see ``input_ids`` with its padding, as in
            ``generate`` (so ``max_length`` / ``min_length`` count the padding there too).
        max_new_tokens / eos_token_id / return_dict_in_generate: as in ``generate`` (shorthands for
            the ``GenerationConfig`` fields; defaults from the LLM's generation config).
        generation_config: a ``GenerationConfig``; together with ``generation_kwargs`` (any of its
            fields: ``do_sample``, ``temperature``, ``min_new_tokens``, ``stop_strings``, ...).
        logits_processor / stopping_criteria: extra processors / criteria merged with the prepared
            ones as in ``generate`` (a user object of a prepared type replaces it).
        prefix_allowed_tokens_fn: as in ``generate`` (``fn(batch_id, input_ids) -> list[int]``).
        streamer: a transformers ``BaseStreamer`` (``TextStreamer``, ``TextIteratorStreamer``):
            ``put(input_ids)`` once, then ``put`` of each kept token (``LongTensor [1]``) as soon as
            it is accepted, then ``end()``, the calls ``generate`` makes.
        tokenizer / assistant_tokenizer: the LLM's / SLM's tokenizer; when both are given the pair is
            checked (:func:`check_pair`), ``len(tokenizer)`` sets the shared vocabulary size, and
            ``tokenizer`` is the one ``stop_strings`` need (as in ``generate``).
        vocab_size: shared vocabulary size V (overrides the rule in :func:`shared_vocab_size`).
        small_batch_linear: run catch-up forwards under :class:`~river_hf.quant.dense.SmallBatchLinear`;
            entered only for a model whose weights are float32 on the CPU (the only case the mode
            changes; see the module notes).

    Returns:
        ``LongTensor [1, prompt_len + new_tokens]`` (``input_ids`` followed by the new tokens), or
        with ``return_dict_in_generate`` a :class:`StitchOutput` whose ``stats`` is the call's
        :class:`StitchStats` (the models are not modified).

    Raises:
        RiverError: batch size > 1 (see the module notes), an attention mask of another shape, an
            empty prompt, τ = NaN, invalid or unsupported generation settings (beam search,
            ``num_return_sequences`` > 1, guidance, watermarking, a static cache, per-step output
            tensors, ...), ``stop_strings`` without ``tokenizer``, a prompt already at
            ``max_length``, an argument that is neither listed here nor a ``GenerationConfig``
            field, or a pair that does not share a tokenizer.
    """
    t_start = time.perf_counter()
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise RiverError(
            "input_ids must be a LongTensor of shape [1, prompt_len] (as tokenizer(..., return_tensors='pt') gives)"
        )
    if input_ids.shape[0] != 1:
        raise RiverError(
            f"R-Stitch decodes one sequence at a time, batches are not supported (got input_ids of shape "
            f"{tuple(input_ids.shape)}): each sequence hands over between the SLM and the LLM at its own "
            "positions, so the rows of a batch would need different models, and caches of different lengths, "
            "at the same step; call it once per prompt"
        )
    if input_ids.shape[1] == 0:
        raise RiverError("the prompt is empty: pass at least one token")
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise RiverError(
            f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids {tuple(input_ids.shape)}: "
            "pass the mask the tokenizer returned with these ids"
        )
    if tau != tau:
        raise RiverError("tau must be a number (e.g. 0.02; < 0 = LLM only, >= 1 = SLM only), got NaN")
    check_pair(slm, llm, assistant_tokenizer, tokenizer)
    V = int(vocab_size) if vocab_size is not None else shared_vocab_size(slm, llm, tokenizer)

    # -- generation settings, prepared by transformers' own GenerationMixin steps (generate, steps 1-8)
    for name, value in (("max_new_tokens", max_new_tokens), ("eos_token_id", eos_token_id),
                        ("return_dict_in_generate", return_dict_in_generate)):
        if value is not None:
            generation_kwargs[name] = value
    has_default = {
        f: generation_kwargs.get(f) is None
        and (generation_config is None or getattr(generation_config, f) is None)
        and getattr(llm.generation_config, f) is None
        for f in ("max_length", "min_length")
    }
    try:
        gen_cfg, unused = prepare_generation_config(llm, generation_config, **generation_kwargs)
    except ValueError as e:  # GenerationConfig.validate: e.g. max_new_tokens <= 0
        raise RiverError(f"invalid generation settings: {e}") from e
    for name in ("output_attentions", "output_hidden_states"):  # refused by name below where they would act
        unused.pop(name, None)
    if unused:
        raise RiverError(
            f"R-Stitch does not take {', '.join(sorted(unused))}: pass generation settings "
            "(do_sample, temperature, top_k, top_p, ...) or a GenerationConfig"
        )
    _refuse_unsupported(gen_cfg)

    prompt = input_ids  # what the models see: the prompt without its padding
    model_kwargs = {}
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        prompt = input_ids[:, attention_mask[0].bool()]
        if prompt.shape[1] == 0:
            raise RiverError("the attention mask masks every prompt token: pass at least one unmasked token")
        model_kwargs["attention_mask"] = attention_mask  # RepetitionPenalty skips the padding, as in generate
    try:
        gen_cfg = prepare_lengths(llm, gen_cfg, input_ids, has_mask=attention_mask is not None,
                                  has_default=has_default)
    except ValueError as e:  # the prompt is already max_length long
        raise RiverError(str(e)) from e
    processors = logits_processors(llm, gen_cfg, input_ids, logits_processor=logits_processor,
                                   prefix_allowed_tokens_fn=prefix_allowed_tokens_fn, model_kwargs=model_kwargs)
    if gen_cfg.stop_strings is not None and tokenizer is None:
        raise RiverError(
            "stop_strings need the tokenizer to match strings: pass tokenizer= (the LLM's), as generate asks"
        )
    criteria = generate_criteria(llm, gen_cfg, stopping_criteria, tokenizer)
    do_sample = bool(gen_cfg.do_sample)

    # -- decoding (R-Stitch Sec. 3)
    stats = StitchStats()
    runners = {SLM: _Runner("slm", slm, stats, small_batch_linear), LLM: _Runner("llm", llm, stats, small_batch_linear)}
    seq, full = prompt, input_ids  # the models' sequence; generate's input_ids (with the padding)
    sources: list[int] = []
    entropies: list[float] = []
    active = LLM if tau < 0 else SLM  # τ < 0 would discard every SLM token: do not run the SLM
    if streamer is not None:
        streamer.put(input_ids.cpu())

    def choose(logits: torch.Tensor) -> torch.LongTensor:
        scores = processors(full, logits[:, :V])
        if do_sample:
            return torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1)
        return scores.argmax(dim=-1, keepdim=True)

    while True:
        if active == SLM:
            logits = runners[SLM].step(seq)
            h = float(normalized_entropy(logits[:, :V])[0])
            if h > tau:  # uncertain: discard the SLM's token, the LLM writes this position
                active = LLM
                stats.handovers += 1
                continue
            token, src = choose(logits), SLM
            stats.slm_tokens += 1
        else:
            logits = runners[LLM].step(seq)
            h = float(normalized_entropy(logits[:, :V])[0])
            token, src = choose(logits), LLM
            stats.llm_tokens += 1
            if h <= tau:  # confident again: the SLM takes the next position
                active = SLM
                stats.handovers += 1
        token = token.to(seq.dtype)
        seq = torch.cat([seq, token], dim=1)
        full = torch.cat([full, token], dim=1)
        sources.append(src)
        entropies.append(h)
        if streamer is not None:
            streamer.put(token[:, 0].cpu())
        if bool(criteria(full, None).any()):  # max_length, max_time, stop_strings, EOS, the user's
            break
    if streamer is not None:
        streamer.end()

    stats.seconds = time.perf_counter() - t_start
    if not gen_cfg.return_dict_in_generate:
        return full
    return StitchOutput(
        sequences=full,
        sources=torch.tensor([sources], dtype=torch.long, device=input_ids.device),
        entropies=torch.tensor([entropies], dtype=torch.float32, device=input_ids.device),
        stats=stats,
    )
