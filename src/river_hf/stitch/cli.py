"""``river-hf stitch``: answer one prompt with R-Stitch and show which model wrote which token.

    river-hf stitch "Write is_prime in Python" --slm qwen2.5-coder-0.5b --llm qwen2.5-coder-1.5b \
        --tau 0.02 [--compare] [--max-new-tokens N] [--json]

The prompt goes through the tokenizer's chat template when it has one (raw text otherwise). The
answer is printed with the SLM's tokens marked: green on a terminal, ``[[...]]`` otherwise; then
the stats (tokens per model, hand-overs, forwards and seconds per model). ``--compare`` also runs
LLM-only greedy ``generate`` and HF assisted generation (``assistant_model=`` the SLM) on the same
input and prints their latency next to R-Stitch's. Assisted generation runs inside
:class:`~river_hf.quant.dense.SmallBatchLinear`, as R-Stitch's catch-up forwards do (its verify
forwards process several tokens too), so the comparison is kernel for kernel; LLM-only runs plain
(its one-token steps are untouched by the mode and would only pay its dispatch cost).
"""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import RiverError
from ..models import encode_prompt

GREEN, RESET = "\033[32m", "\033[0m"


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "stitch",
        help="R-Stitch: SLM and LLM write one answer together (entropy-guided switching)",
        description="Decode one prompt with R-Stitch (arXiv 2507.17307): the SLM writes the tokens it is "
        "sure of (normalized entropy <= tau), the LLM the rest.",
    )
    p.add_argument("prompt", help="the user prompt (the chat template is applied when the tokenizer has one)")
    p.add_argument("--slm", default="qwen2.5-coder-0.5b", help="small model: key, Hub id or folder")
    p.add_argument("--llm", default="qwen2.5-coder-1.5b", help="large model: key, Hub id or folder")
    p.add_argument("--tau", type=float, default=0.02, help="normalized-entropy threshold (paper: 0.001-0.03)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--compare", action="store_true",
                   help="also time LLM-only and HF assisted generation against R-Stitch, side by side on the answer's "
                        "number of new tokens (warm-up, --repeats alternating rounds, median and min-max)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds for --compare (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=handler)


def marked_text(tokenizer, token_ids: list[int], sources: list[int], colour: bool) -> str:
    """Decode ``token_ids`` run by run, marking runs written by the SLM (source 0)."""
    out, i = [], 0
    while i < len(token_ids):
        j = i
        while j < len(token_ids) and sources[j] == sources[i]:
            j += 1
        text = tokenizer.decode(token_ids[i:j], skip_special_tokens=True)
        if sources[i] == 0 and text:
            text = f"{GREEN}{text}{RESET}" if colour else f"[[{text}]]"
        out.append(text)
        i = j
    return "".join(out)


def handler(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 1:
        raise RiverError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.repeats < 1:
        raise RiverError(f"--repeats must be >= 1, got {args.repeats}")
    if not args.prompt.strip():
        raise RiverError("the prompt is empty: pass the question as the first argument")
    if args.tau != args.tau:
        raise RiverError("--tau must be a number such as 0.02 (< 0 = LLM only, >= 1 = SLM only), got nan")
    from ..models import load
    from .generation import check_pair, generate

    slm, slm_tok = load(args.slm, progress=not args.json)
    llm, tok = load(args.llm, progress=not args.json)
    check_pair(slm, llm, slm_tok, tok)
    ids = encode_prompt(tok, args.prompt)["input_ids"]
    plen = ids.shape[1]
    eos = tok.eos_token_id

    out = generate(
        slm, llm, ids, tau=args.tau, max_new_tokens=args.max_new_tokens, eos_token_id=eos, do_sample=False,
        return_dict_in_generate=True, tokenizer=tok, assistant_tokenizer=slm_tok,
    )
    new = out.sequences[0, plen:].tolist()
    sources = out.sources[0].tolist()
    st = out.stats
    result = {
        "answer": tok.decode(new, skip_special_tokens=True),
        "tau": args.tau,
        "sources": sources,
        "stats": st.to_dict(),
    }

    if args.compare:
        result["compare"], table = _compare(slm, llm, ids, tok, slm_tok, args, max(len(new), 2))
    else:
        table = None

    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    colour = sys.stdout.isatty()
    legend = "green" if colour else "[[...]]"
    print(marked_text(tok, new, sources, colour))
    print()
    print(
        f"R-Stitch tau={args.tau:g}: {st.new_tokens} tokens, SLM {st.slm_tokens} ({st.slm_fraction:.0%}, marked {legend}), "
        f"LLM {st.llm_tokens}; hand-overs {st.handovers}; forwards SLM {st.slm_forwards} / LLM {st.llm_forwards}; "
        f"seconds SLM {st.slm_seconds:.2f} / LLM {st.llm_seconds:.2f} / total {st.seconds:.2f} "
        f"({st.new_tokens / st.seconds if st.seconds else 0:.2f} tokens/s)"
    )
    if args.compare:
        print(table)
        for name, v in result["compare"].items():
            sp = v["speedup_vs_llm_only"]
            print(f"{name:9s} decode {v['decode_tokens_per_s']:7.2f} tokens/s  speedup vs LLM-only {sp['median']:.2f}x "
                  f"(min-max {sp['min']:.2f}-{sp['max']:.2f}, {v['verdict']})")
    return 0


def _compare(slm, llm, ids, tok, slm_tok, args, n: int):
    """LLM-only, HF assisted generation and R-Stitch timed side by side with the shared timer
    (river_hf.timing.compare) on ``n`` new tokens each (greedy, min_new_tokens = max_new_tokens)."""
    import contextlib

    import torch

    from ..quant.dense import SmallBatchLinear
    from ..quant import linear_weight_bytes
    from ..timing import TokenTimer, compare, measure_generate
    from .generation import generate

    common = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    small_batch = all(next(m.parameters()).device.type == "cpu" and next(m.parameters()).dtype == torch.float32
                      for m in (slm, llm))

    def llm_only():
        return measure_generate(llm, inputs, **common, weight_bytes_per_step=linear_weight_bytes(llm))

    def assisted():
        with SmallBatchLinear() if small_batch else contextlib.nullcontext():
            return measure_generate(llm, inputs, **common, assistant_model=slm)

    def rstitch():
        timer = TokenTimer()
        generate(slm, llm, ids, tau=args.tau, **common, tokenizer=tok, assistant_tokenizer=slm_tok, streamer=timer)
        return timer.measurement()

    comparison = compare({"llm_only": llm_only, "assisted": assisted, "rstitch": rstitch}, reference="llm_only",
                         repeats=args.repeats,
                         reference_kind="the LLM alone: the plain transformers model's own generate, F.linear")
    out = {}
    for row in comparison.rows:
        out[row["label"]] = {"decode_tokens_per_s": row["decode_tokens_per_s"]["median"],
                             "decode_tokens_per_s_spread": row["decode_tokens_per_s"], "ttft_s": row["ttft_s"],
                             "new_tokens": row["new_tokens"], "speedup_vs_llm_only": row["speedup"],
                             "verdict": row["verdict"], "bandwidth_gb_s": row["bandwidth_gb_s"]}
    return out, comparison.table()
