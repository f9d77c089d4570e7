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
- Catch-up forwards (a few tokens on top of a non-empty cache) run under
  :class:`~river_hf.kernels.SmallBatchLinear` by default: on CPU in fp32, torch's stock ``F.linear``
  makes a 2-4-token forward cost as much as 2-2.9 one-token steps, which taxes every hand-over; the
  mode computes those products in the faster orientation (same result up to fp32 summation
  order). The first prefill of each model and every one-token step use the stock path, so the
  exactness switches still match ``generate`` token for token. ``small_batch_linear=False`` turns
  it off.
- Batch size 1 only (each sequence switches models at its own positions); a larger batch raises
  :class:`~river_hf.errors.RiverError`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from typing import Any

import torch
from transformers import DynamicCache, GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.utils import ModelOutput

from ..errors import RiverError
from ..kernels import SmallBatchLinear

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


class _Runner:
    """One model with its own KV cache; ``step(seq)`` catches up on ``seq`` and returns the logits
    of the next position."""

    def __init__(self, name: str, model, stats: StitchStats, small_batch_linear: bool = True):
        self.name, self.model, self.stats = name, model, stats
        self.small_batch_linear = small_batch_linear
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


def _as_id_set(eos) -> set:
    if eos is None:
        return set()
    if isinstance(eos, torch.Tensor):
        return set(eos.flatten().tolist())
    if isinstance(eos, int):
        return {eos}
    return set(eos)


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
    return_dict_in_generate: bool | None = None,
    tokenizer=None,
    assistant_tokenizer=None,
    vocab_size: int | None = None,
    small_batch_linear: bool = True,
    **generation_kwargs: Any,
) -> torch.LongTensor | StitchOutput:
    """Decode with R-Stitch: the SLM writes the tokens it is sure of, the LLM the others.

    Args:
        slm: small causal LM (``PreTrainedModel`` with ``generate``), leads at the first position.
        llm: large causal LM sharing the SLM's tokenizer.
        input_ids: ``LongTensor [1, prompt_len]`` on the models' device.
        tau: normalized-entropy threshold τ. SLM token kept iff its H ≤ τ; the LLM keeps leading
            while its H > τ. ``tau < 0``: LLM only; ``tau >= 1``: SLM only (exactness switches).
        attention_mask: ``[1, prompt_len]`` of 0/1; padded (0) positions are dropped from the
            prompt the models see (batch 1 needs no padding), the returned ``sequences`` keep them.
        max_new_tokens: new-token budget (default: the LLM generation config's).
        eos_token_id: id or ids that end generation (default: the LLM generation config's).
        generation_config: a ``GenerationConfig``; together with ``generation_kwargs`` (``do_sample``,
            ``temperature``, ``top_k``, ``top_p``, ``repetition_penalty``, ...) it builds the same
            ``LogitsProcessorList`` as ``llm.generate`` (transformers' own ``_get_logits_processor``).
        logits_processor: extra processors appended to those, as in ``generate``.
        stopping_criteria: extra ``StoppingCriteriaList`` checked after every token.
        return_dict_in_generate: return a :class:`StitchOutput` instead of the sequences tensor.
        tokenizer / assistant_tokenizer: the LLM's / SLM's tokenizer; when both are given the pair is
            checked (:func:`check_pair`), and ``len(tokenizer)`` sets the shared vocabulary size.
        vocab_size: shared vocabulary size V (overrides the rule in :func:`shared_vocab_size`).
        small_batch_linear: run catch-up forwards under :class:`~river_hf.kernels.SmallBatchLinear`
            (fp32 CPU only has an effect; see the module notes).

    Returns:
        ``LongTensor [1, prompt_len + new_tokens]``, or a :class:`StitchOutput`. Either way the call's
        :class:`StitchStats` is also left in ``llm.stitch_stats``.

    Raises:
        RiverError: batch size > 1, an empty prompt, τ = NaN, a negative budget, beam search, an argument that
            is neither listed here nor a ``GenerationConfig`` field, or a pair that does not share a
            tokenizer.
    """
    t_start = time.perf_counter()
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise RiverError(
            f"R-Stitch decodes one sequence at a time (got input_ids of shape {tuple(input_ids.shape)}); "
            "call it once per prompt"
        )
    if input_ids.shape[1] == 0:
        raise RiverError("the prompt is empty: pass at least one token")
    if tau != tau:
        raise RiverError("tau must be a number (e.g. 0.02; < 0 = LLM only, >= 1 = SLM only), got NaN")
    check_pair(slm, llm, assistant_tokenizer, tokenizer)
    V = int(vocab_size) if vocab_size is not None else shared_vocab_size(slm, llm, tokenizer)

    gen_cfg, unused = llm._prepare_generation_config(generation_config, **generation_kwargs)
    if unused:
        raise RiverError(
            f"R-Stitch does not take {', '.join(sorted(unused))}: pass generation settings "
            "(do_sample, temperature, top_k, top_p, ...) or a GenerationConfig"
        )
    if max_new_tokens is None:
        max_new_tokens = gen_cfg.max_new_tokens if gen_cfg.max_new_tokens is not None else 20
    if max_new_tokens < 0:
        raise RiverError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    eos = _as_id_set(eos_token_id if eos_token_id is not None else gen_cfg.eos_token_id)
    if return_dict_in_generate is None:
        return_dict_in_generate = bool(gen_cfg.return_dict_in_generate)
    if gen_cfg.num_beams not in (None, 1):
        raise RiverError("R-Stitch does not do beam search: use num_beams=1 (greedy or sampling)")

    prompt = input_ids
    if attention_mask is not None:
        keep = attention_mask[0].bool()
        if not bool(keep.all()):
            prompt = input_ids[:, keep]
    processors = llm._get_logits_processor(
        generation_config=gen_cfg,
        input_ids_seq_length=prompt.shape[1],
        encoder_input_ids=prompt,
        logits_processor=logits_processor if logits_processor is not None else LogitsProcessorList(),
        device=prompt.device,
        model_kwargs={},
    )
    do_sample = bool(gen_cfg.do_sample)
    criteria = stopping_criteria if stopping_criteria is not None else StoppingCriteriaList()

    stats = StitchStats()
    runners = {SLM: _Runner("slm", slm, stats, small_batch_linear), LLM: _Runner("llm", llm, stats, small_batch_linear)}
    seq = prompt
    sources: list[int] = []
    entropies: list[float] = []
    active = LLM if tau < 0 else SLM  # τ < 0 would discard every SLM token: do not run the SLM

    def choose(logits: torch.Tensor) -> torch.LongTensor:
        scores = processors(seq, logits[:, :V])
        if do_sample:
            return torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1)
        return scores.argmax(dim=-1, keepdim=True)

    while len(sources) < max_new_tokens:
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
        seq = torch.cat([seq, token.to(seq.dtype)], dim=1)
        sources.append(src)
        entropies.append(h)
        if int(token) in eos:
            break
        if len(criteria) and bool(criteria(seq, None).any()):
            break

    sequences = torch.cat([input_ids, seq[:, prompt.shape[1] :]], dim=1)
    stats.seconds = time.perf_counter() - t_start
    llm.stitch_stats = stats
    if not return_dict_in_generate:
        return sequences
    return StitchOutput(
        sequences=sequences,
        sources=torch.tensor([sources], dtype=torch.long, device=input_ids.device),
        entropies=torch.tensor([entropies], dtype=torch.float32, device=input_ids.device),
        stats=stats,
    )
