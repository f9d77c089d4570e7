"""How every benchmark method generates: exactly N new tokens, EOS suppressed by index, and the
method names that carry River settings (``lossless[KEY=VALUE;...]``, ``--set KEY=VALUE``).

EOS suppression: one ``LogitsProcessor`` that sets the EOS logits to -inf by index
(:class:`SuppressIds`; llama.cpp gets the same through its ``logits_processor``). transformers' own
``min_new_tokens`` processor builds a vocabulary-sized ``arange`` and an ``isin`` at every step
(about 0.7 ms per step on a 2-core machine), a fixed cost that would shrink every faster method's
ratio; neither changes any token other than EOS (``tests/test_heldout_speed.py`` checks the tokens
equal on River's route and lossless modes).
"""

from __future__ import annotations

import dataclasses
import json

import torch

__all__ = ["SuppressIds", "eos_ids", "exact_generation", "EOS_SUPPRESSED", "LOSSLESS_SETTINGS", "split_methods",
           "lossless_settings", "config_overrides", "json_or_text"]

#: What a report says about EOS.
EOS_SUPPRESSED = "one index fill of the EOS logits per step (SuppressIds / llama.cpp logits_processor)"
#: The RiverConfig fields each named lossless method replaces (``lossless[...]`` gives its own).
LOSSLESS_SETTINGS = {"lossless": {}, "lossless-exit": {"prompt_lookup_tokens": 0},
                     "lossless+lookup": {"prompt_lookup_tokens": 10, "prompt_lookup_rule": "always"}}


class SuppressIds:
    """A transformers ``LogitsProcessor``: ``scores[:, ids] = -inf`` (one indexed fill per step).

    ``__call__(input_ids [batch, seq] int64, scores [batch, vocab] float) -> scores`` (modified in place).
    It reads no token history (``history_free``), so batched lossless mode keeps drafting with it."""

    history_free = True

    def __init__(self, ids):
        self.ids = torch.tensor(sorted(set(ids)), dtype=torch.long)

    def __call__(self, input_ids, scores):
        return scores.index_fill_(1, self.ids, float("-inf"))


def eos_ids(tokenizer, model) -> list[int]:
    """Every EOS id the tokenizer or the model's generation config names, sorted."""
    ids = set()
    for value in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if value is not None:
            ids.update([value] if isinstance(value, int) else value)
    return sorted(ids)


def exact_generation(tokenizer, model, new_tokens: int) -> tuple[dict, list[int]]:
    """``generate`` keyword arguments for greedy decoding of exactly ``new_tokens`` tokens (EOS
    suppressed by :class:`SuppressIds`; padding with the tokenizer's pad id, else the first EOS id),
    and the EOS ids (for llama.cpp's suppressor)."""
    from transformers import LogitsProcessorList

    eos = eos_ids(tokenizer, model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    return dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=pad,
                logits_processor=LogitsProcessorList([SuppressIds(eos)])), eos


def json_or_text(value: str):
    """``value`` read as JSON (``"0.5"`` -> 0.5, ``"true"`` -> True), else the string itself, stripped."""
    try:
        return json.loads(value)
    except ValueError:
        return value.strip()


def split_methods(text: str) -> list[str]:
    """``"unmodified,lossless[a=1;b=2],x"`` -> the method names (commas inside brackets kept)."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def lossless_settings(method: str) -> dict | None:
    """The RiverConfig fields ``method`` replaces (a lossless method: :data:`LOSSLESS_SETTINGS` or
    ``lossless[KEY=VALUE;...]``, values JSON or strings), or None (not a lossless method).

    Raises:
        ValueError: a malformed ``lossless[...]`` item."""
    if method in LOSSLESS_SETTINGS:
        return dict(LOSSLESS_SETTINGS[method])
    if not (method.startswith("lossless[") and method.endswith("]")):
        return None
    out = {}
    for item in filter(None, method[len("lossless["):-1].split(";")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"{method}: {item!r} is not KEY=VALUE")
        out[key.strip()] = json_or_text(value)
    return out


def config_overrides(items: list[str]) -> dict:
    """``--set KEY=VALUE`` items -> RiverConfig fields (values JSON or strings).

    Raises:
        ValueError: an item without ``=``, or a key that is not a ``RiverConfig`` field."""
    from ..river.config import RiverConfig

    fields = {f.name for f in dataclasses.fields(RiverConfig)}
    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        if key not in fields:
            raise ValueError(f"--set {item!r}: {key!r} is not a RiverConfig field ({', '.join(sorted(fields))})")
        out[key] = json_or_text(value)
    return out
