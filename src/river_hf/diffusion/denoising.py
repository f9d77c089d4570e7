"""Masked-diffusion generation loop (LLaDA style), uncached or through dLLM-Cache.

The rules follow LLaDA (Nie et al., 2025, "Large Language Diffusion Models", arXiv:2502.09992,
Sec. 2.4 "Inference" with its appendix on sampling; public ``generate.py`` of ML-GSAI/LLaDA):

* The answer starts as ``gen_length`` [MASK] tokens after the prompt and is denoised block by block
  (semi-autoregressive remasking, ``block_length`` tokens per block), each block over
  ``steps * block_length / gen_length`` denoising steps.
* Each step predicts every masked position (argmax of the logits, after Gumbel noise when
  ``temperature > 0``: ``exp(logits) / (-log u) ** temperature`` in float64, as in LLaDA) and
  commits an equal share of the block's masked tokens per step (``get_num_transfer_tokens``: the
  remainder goes to the first steps).
* Which predictions are committed: the most confident ones (``remasking="low_confidence"``,
  softmax probability of the predicted token) or random ones (``remasking="random"``); the rest
  stay masked.
* Dream (Ye et al., 2025, "Dream 7B") was initialised from an autoregressive model, so its logits are
  shifted right by one position: the prediction for position i is read at position i - 1
  (``shift_logits=True``; auto-detected from ``config.shift_logits`` or ``model_type == "dream"``).

Differences from LLaDA's script, all without effect on the committed tokens of a real model:
logits are only computed at the current block's still-masked positions (masked in any row) when the
model accepts ``logits_to_keep`` (a committed token is never changed, tokens before the block are all
committed and later ones cannot be chosen; on the 1B test model's 126k-token vocabulary the LM head over
a 32-token block is about a quarter of a V-verify step (docs/diffusion.md), and the masked share of a block averages about half); the [MASK] id
itself is never predicted; [MASK] tokens inside the prompt stay as they are (the prompt is
conditioning only). Random draws (Gumbel noise, random remasking) are taken over those positions only.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from dataclasses import dataclass

import torch
from transformers.utils import ModelOutput

from ..errors import RiverError
from .cache import DLLMCacheConfig, attach_cache, uncached_layer_flops, verify_rows

__all__ = ["DiffusionGenerationOutput", "generate", "mask_token_id", "num_transfer_tokens"]


@dataclass
class DiffusionGenerationOutput(ModelOutput):
    """What :func:`generate` returns (a transformers ``ModelOutput``: attribute, key and index access).

    Attributes:
        sequences: ``[B, P + G]`` int64, each prompt followed by its answer (with ``max_blocks``, the
            answer positions of blocks not run stay [MASK]).
        stats: with ``return_stats=True``, a dict: ``steps`` (model forwards), ``seconds`` (wall time
            of the denoising loop), ``tokens_per_s`` (generated tokens of all rows per second),
            ``layer_flops`` (decoder-layer FLOPs spent, None when the layout is unknown),
            ``layer_flops_full`` (what uncached would spend), ``flops_ratio`` (full / spent; decoder
            layers only: their projections and attention's QK^T and AV), ``head_rows`` (rows the LM head
            ran on, all steps and sequences: the kept positions, or every position without
            ``logits_to_keep``), ``head_flops`` (2 x the head's weight elements per row; None when the
            model has no ``get_output_embeddings``), ``model_flops`` / ``model_flops_full`` (layers +
            head; the head runs at the same positions cached or not) and ``model_flops_ratio``
            (whole-model full / spent: what wall time can at best gain; the embedding gather and the
            final norm are not counted),
            ``step_seconds`` (wall seconds per step kind, forward and commit: ``"full"``, and with a cache
            ``"prompt"``, ``"response"``, ``"verify"`` as in ``FeatureCache.kind``), and with a
            cache ``refresh_counts``, ``selected_tokens`` (V-verify rows, summed over layers and rows),
            ``cache`` (its settings), ``small_batch_linear_used`` (whether the decomposed steps ran
            under :class:`~river_hf.quant.dense.SmallBatchLinear`), with ``"auto"`` the deciding
            ``small_batch_linear_timing`` (shape, rows, µs per call of each orientation), and when used
            ``small_batch_linear_calls`` (Linear calls it rerouted). None otherwise.
    """

    sequences: torch.LongTensor | None = None
    stats: dict | None = None


def num_transfer_tokens(block_mask: torch.Tensor, steps: int) -> torch.Tensor:
    """How many tokens each step commits (LLaDA ``get_num_transfer_tokens``).

    Args:
        block_mask: ``[B, block_length]`` bool, True at masked positions.
        steps: denoising steps for the block.

    Returns:
        ``[B, steps]`` int64; row sums equal the masked counts, the remainder on the first steps.
    """
    n = block_mask.sum(dim=1, keepdim=True)
    base, rem = n // steps, n % steps
    out = base.expand(-1, steps).clone()
    out += (torch.arange(steps, device=n.device)[None, :] < rem).long()
    return out


def mask_token_id(model) -> int | None:
    """The model's [MASK] token id: ``model.config.mask_token_id``, else
    ``model.generation_config.mask_token_id`` (where Dream's remote code keeps it); None when neither has one."""
    for cfg in (getattr(model, "config", None), getattr(model, "generation_config", None)):
        value = getattr(cfg, "mask_token_id", None)
        if value is not None:
            return int(value)
    return None


def _resolve_mask_id(model, mask_id: int | None) -> int:
    """``mask_id`` or the model's own (:func:`mask_token_id`), checked against the vocabulary.

    Raises:
        RiverError: none given and none in the model's configs, or an id outside ``[0, vocab_size)``.
    """
    if mask_id is None:
        mask_id = mask_token_id(model)
        if mask_id is None:
            raise RiverError(f"{type(model).__name__} has no mask_token_id in its config or generation_config; "
                             "pass mask_id= (LLaDA-8B 126336, Dream-7B 151666)")  # fmt: skip
    if isinstance(mask_id, bool) or not isinstance(mask_id, int):
        raise RiverError(f"mask_id must be an int token id, got {mask_id!r}")
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if mask_id < 0 or (isinstance(vocab, int) and mask_id >= vocab):
        raise RiverError(f"mask_id {mask_id} is outside the vocabulary [0, {vocab}); use the model's [MASK] id")
    return mask_id


def _accepts(model, name: str) -> bool:
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return name in params


def _check(model, input_ids, attention_mask, steps, gen_length, block_length, temperature, remasking, cache):
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise RiverError("input_ids must be an int64 tensor of shape [batch, prompt_length]")
    if input_ids.shape[1] < 1:
        raise RiverError("the prompt is empty; give at least one prompt token")
    if gen_length < 1 or block_length < 1 or steps < 1:
        raise RiverError("steps, gen_length and block_length must be >= 1")
    if gen_length % block_length:
        raise RiverError(f"gen_length ({gen_length}) must be a multiple of block_length ({block_length})")
    blocks = gen_length // block_length
    if steps % blocks:
        raise RiverError(f"steps ({steps}) must be a multiple of the number of blocks ({blocks} = gen_length / block_length)")
    if steps // blocks > block_length:
        raise RiverError(f"{steps // blocks} steps per block but only {block_length} tokens per block; use fewer steps")
    if not temperature >= 0 or temperature == float("inf"):  # also refuses NaN
        raise RiverError(f"temperature must be a finite number >= 0, got {temperature}")
    if remasking not in ("low_confidence", "random"):
        raise RiverError(f"remasking must be 'low_confidence' or 'random', got {remasking!r}")
    if cache is not None and not isinstance(cache, DLLMCacheConfig):
        raise RiverError("cache must be a DLLMCacheConfig or None")
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise RiverError(
                f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(input_ids.shape)}"
            )
        if not bool((attention_mask.sum(dim=1) > 0).all()):
            raise RiverError("a row of attention_mask is all zeros; every prompt needs at least one real token")
        am = attention_mask.long()
        if bool((am[:, 1:] < am[:, :-1]).any()):  # a 0 after a 1: padding after a token
            row = int((am[:, 1:] < am[:, :-1]).any(1).nonzero()[0])
            raise RiverError(f"row {row} of attention_mask has padding after a real token; pad prompts on the left "
                             "(tokenizer.padding_side = 'left'): the answer follows the prompt directly")  # fmt: skip
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(vocab, int) and input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab):
        raise RiverError(f"input_ids must be token ids in [0, {vocab}); got values in "
                         f"[{int(input_ids.min())}, {int(input_ids.max())}]")  # fmt: skip


@torch.inference_mode()
def generate(
    model,
    input_ids: torch.Tensor,
    *,
    steps: int,
    gen_length: int,
    block_length: int,
    temperature: float = 0.0,
    remasking: str = "low_confidence",
    mask_id: int | None = None,
    cache: DLLMCacheConfig | None = None,
    attention_mask: torch.Tensor | None = None,
    shift_logits: bool | None = None,
    generator: torch.Generator | None = None,
    progress: bool = False,
    return_stats: bool = False,
    max_blocks: int | None = None,
):
    """Denoise ``gen_length`` masked tokens after each prompt (LLaDA-style masked diffusion).

    Args:
        model: a bidirectional masked-diffusion LM whose forward takes ``input_ids`` and
            ``attention_mask`` and returns ``.logits`` (``[B, T, vocab]``) for all positions. With
            ``cache`` its layers must be Llama/Qwen2-style decoder layers or LLaDA blocks.
        input_ids: ``[B, P]`` int64 prompts; padded prompts must be left-padded, their padding marked
            in ``attention_mask`` (padding keys are masked everywhere).
        steps: total denoising steps (one model forward each), a multiple of the number of blocks.
        gen_length: number of tokens to generate (``G``), a multiple of ``block_length``.
        block_length: tokens per semi-autoregressive block.
        temperature: Gumbel-noise temperature; 0 = greedy (deterministic).
        remasking: ``"low_confidence"`` or ``"random"``.
        mask_id: the [MASK] token id (LLaDA 126336, Dream 151666); None = the model's own
            (:func:`mask_token_id`: ``config.mask_token_id``, else ``generation_config.mask_token_id``).
        cache: a :class:`DLLMCacheConfig` to serve the layers through dLLM-Cache; None = uncached.
        attention_mask: ``[B, P]`` (1 = token, 0 = padding) or None.
        shift_logits: Dream convention (see module doc); None = auto from the config.
        generator: torch generator for Gumbel noise and random remasking (None: global RNG).
        progress: show a tqdm bar over denoising steps.
        return_stats: also fill ``stats`` (see :class:`DiffusionGenerationOutput`).
        max_blocks: stop after this many blocks (later answer positions stay [MASK]); for timing a
            long schedule on a slow machine. None = all blocks.

    Returns:
        a :class:`DiffusionGenerationOutput`: ``.sequences`` ``[B, P + G]`` int64 (prompt followed by
        the answer) and, with ``return_stats``, ``.stats``.

    Raises:
        RiverError: inconsistent lengths, bad mask (wrong shape, an all-padding row, padding after a
            real token), prompt ids outside the vocabulary, unknown remasking, unsupported layer
            layout, no [MASK] id given or found in the model's configs, or one outside the vocabulary,
            or a model that returns no logits.
    """
    _check(model, input_ids, attention_mask, steps, gen_length, block_length, temperature, remasking, cache)
    mask_id = _resolve_mask_id(model, mask_id)
    device = next(model.parameters()).device
    b, p = input_ids.shape
    if shift_logits is None:
        cfg = getattr(model, "config", None)
        shift_logits = bool(getattr(cfg, "shift_logits", False)) or getattr(cfg, "model_type", "") == "dream"
    x, full_mask = _initial_sequence(input_ids.to(device), attention_mask, gen_length, mask_id)
    num_blocks = gen_length // block_length
    steps_per_block = steps // num_blocks
    run_blocks = num_blocks if max_blocks is None else max(0, min(num_blocks, int(max_blocks)))
    use_keep = _accepts(model, "logits_to_keep")

    with contextlib.ExitStack() as stack:
        fc = None
        if cache is not None:
            key_mask = None if full_mask is None else full_mask.bool()
            rows = verify_rows(b, gen_length, cache.ratio)
            fc = stack.enter_context(attach_cache(model, cache, p, key_mask, partial_rows=rows))
        bar = None
        if progress:
            from tqdm.auto import tqdm

            desc = "denoising" + (" (dLLM-Cache)" if cache else "")
            bar = stack.enter_context(tqdm(total=run_blocks * steps_per_block, desc=desc, unit="step"))
        step_seconds: dict[str, float] = {}
        head_rows = 0
        t0 = time.perf_counter()
        for blk in range(run_blocks):
            lo = p + blk * block_length
            n_transfer = num_transfer_tokens(x[:, lo : lo + block_length] == mask_id, steps_per_block)
            for i in range(steps_per_block):
                cols = _masked_positions(x, lo, lo + block_length, mask_id)
                if fc is not None:
                    fc.next_step()
                ts = time.perf_counter()
                logits = _position_logits(model, x, cols, full_mask, shift_logits, use_keep, mask_id)
                head_rows += b * (cols.numel() if use_keep else x.shape[1])
                _denoise_step(x, logits, cols, n_transfer[:, i], temperature, remasking, mask_id, generator)
                kind = "full" if fc is None else fc.kind
                step_seconds[kind] = step_seconds.get(kind, 0.0) + time.perf_counter() - ts
                if bar is not None:
                    bar.update(1)
        seconds = time.perf_counter() - t0

    if not return_stats:
        return DiffusionGenerationOutput(sequences=x)
    stats = _stats(model, fc, b, p + gen_length, run_blocks * steps_per_block, b * run_blocks * block_length, seconds)
    stats["step_seconds"] = step_seconds
    _add_model_flops(stats, model, head_rows)
    return DiffusionGenerationOutput(sequences=x, stats=stats)


def _initial_sequence(input_ids, attention_mask, gen_length, mask_id):
    """The prompt followed by ``gen_length`` [MASK] ids, and the key padding mask over all positions.

    Returns:
        ``x`` ``[B, P + G]`` int64 and ``full_mask`` ``[B, P + G]`` int64 (1 = token, 0 = padding), or
        None when nothing is padded.
    """
    b, p = input_ids.shape
    x = torch.full((b, p + gen_length), mask_id, dtype=torch.long, device=input_ids.device)
    x[:, :p] = input_ids
    if attention_mask is None or bool(attention_mask.all()):
        return x, None
    answer = torch.ones(b, gen_length, dtype=torch.long, device=x.device)
    return x, torch.cat([attention_mask.to(x.device).long(), answer], 1)


def _masked_positions(x, lo, hi, mask_id) -> torch.Tensor:
    """Absolute positions in block ``[lo, hi)`` that are [MASK] in at least one row, ``[m]`` int64
    (m >= 1: every step of a block commits at most what is still masked, see :func:`num_transfer_tokens`)."""
    return torch.nonzero((x[:, lo:hi] == mask_id).any(0)).squeeze(1) + lo


def _position_logits(model, x, cols, full_mask, shift_logits, use_keep, mask_id):
    """One model forward; the logits predicting positions ``cols`` (Dream: read one position to the left),
    ``[B, m, vocab]``, with the [MASK] id set to -inf so it is never predicted."""
    keep = cols - int(shift_logits)
    kwargs = {"attention_mask": full_mask}
    if use_keep:
        kwargs["logits_to_keep"] = keep
    out = model(input_ids=x, **kwargs)
    logits = getattr(out, "logits", None)
    if logits is None:
        raise RiverError(f"{type(model).__name__} returned no logits ({type(out).__name__}): it has no LM head; "
                         "load a masked-diffusion LM with its head (AutoModelForMaskedLM, or the model's own "
                         "class with trust_remote_code=True)")  # fmt: skip
    if not use_keep:
        logits = logits[:, keep]  # an index tensor: a copy, so the in-place write below is safe
    logits[..., mask_id] = float("-inf")
    return logits


def _stats(model, fc, batch, tokens, steps_run, generated, seconds) -> dict:
    """The stats dict of :func:`generate` (see its Returns)."""
    if fc is None:
        per_forward = uncached_layer_flops(model, tokens)
        spent = full = None if per_forward is None else per_forward * batch * steps_run
    else:
        spent, full = fc.layer_flops, fc.layer_flops_full
    stats = {
        "steps": steps_run,
        "seconds": seconds,
        "tokens_per_s": generated / seconds if seconds > 0 else float("inf"),
        "layer_flops": spent,
        "layer_flops_full": full,
        "flops_ratio": (full / spent) if spent else None,
    }
    if fc is not None:
        cfg = fc.config
        stats["refresh_counts"] = dict(fc.refresh_counts)
        stats["selected_tokens"] = fc.selected
        stats["cache"] = {"prompt_interval": cfg.prompt_interval, "response_interval": cfg.response_interval,
                          "ratio": cfg.ratio, "small_batch_linear": cfg.small_batch_linear}  # fmt: skip
        stats["small_batch_linear_used"] = fc.linear_mode is not None
        if fc.linear_timing is not None:
            stats["small_batch_linear_timing"] = fc.linear_timing
        if fc.linear_mode is not None:
            stats["small_batch_linear_calls"] = fc.linear_mode.calls_rerouted
    return stats


def head_flops_per_row(model) -> int | None:
    """FLOPs of the LM head for one position (2 x its weight elements), or None when the model has
    no ``get_output_embeddings``."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    weight = getattr(head, "weight", None)
    return None if weight is None else 2 * weight.numel()


def _add_model_flops(stats: dict, model, head_rows: int) -> None:
    """``head_rows``, ``head_flops``, ``model_flops``, ``model_flops_full``, ``model_flops_ratio``
    into ``stats`` (see :class:`DiffusionGenerationOutput`)."""
    per_row = head_flops_per_row(model)
    head = None if per_row is None else per_row * head_rows
    spent, full = stats["layer_flops"], stats["layer_flops_full"]
    known = head is not None and spent is not None and full is not None
    stats.update(head_rows=head_rows, head_flops=head, model_flops=spent + head if known else None,
                 model_flops_full=full + head if known else None,
                 model_flops_ratio=(full + head) / (spent + head) if known and spent + head else None)


def _denoise_step(x, logits, cols, n_transfer, temperature, remasking, mask_id, generator) -> None:
    """Commit ``n_transfer[b]`` predictions of row b among positions ``cols`` (LLaDA Sec. 2.4), in place.

    ``logits``: ``[B, m, vocab]`` predictions for the ``[m]`` int64 absolute positions ``cols``; only
    positions still [MASK] in a row can be committed there.
    """
    if temperature > 0:
        lg = logits.double()
        u = torch.rand(lg.shape, dtype=torch.float64, device=lg.device, generator=generator)
        x0 = torch.argmax(lg.exp() / (-torch.log(u)) ** temperature, dim=-1)
    else:
        x0 = torch.argmax(logits, dim=-1)
    if remasking == "low_confidence":
        probs = torch.softmax(logits.double(), dim=-1)
        conf = torch.gather(probs, -1, x0.unsqueeze(-1)).squeeze(-1)
    else:
        conf = torch.rand(x0.shape, dtype=torch.float64, device=x0.device, generator=generator)
    masked = x[:, cols] == mask_id
    conf = torch.where(masked, conf, torch.tensor(float("-inf"), dtype=conf.dtype, device=conf.device))
    for row in range(x.shape[0]):
        k = int(n_transfer[row])
        if k:
            idx = torch.topk(conf[row], k).indices
            x[row, cols[idx]] = x0[row, idx]
