"""Pick τ: next-token match, KL and mean exit layer on the first HumanEval prompts, for several τ.

    python benchmarks/calibrate_tau.py MODEL_KEY 0.97,0.95,0.93,0.9 [N_PROMPTS] [--new-tokens 64] [--out FILE.json]

Writes one JSON object (per τ: match rate, mean KL in nats, mean exit layer, exit fraction) and
prints one line per τ. The measure is the River-LLM paper's next-token match
(river_hf.eval.agreement.next_token_agreement).
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("taus", help="comma-separated τ values")
    ap.add_argument("n_prompts", type=int, nargs="?", default=10)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    from river_hf import RiverForCausalLM, resolve
    from river_hf.eval.agreement import next_token_agreement, reference_continuation
    from river_hf.eval.common import humaneval_problems
    from river_hf.models import encode_prompt

    tok = AutoTokenizer.from_pretrained(resolve(args.model))
    model = RiverForCausalLM.from_pretrained(args.model, tau=2.0, dtype=torch.float32)
    prompts = [f"Complete this Python function.\n```python\n{p}```" for p in (q["prompt"] for q in humaneval_problems(args.n_prompts))]
    encoded = [encode_prompt(tok, p)["input_ids"] for p in prompts]
    references = [reference_continuation(model, ids, args.new_tokens) for ids in tqdm(encoded, desc="unmodified")]
    rows = []
    for tau in [float(t) for t in args.taus.split(",")]:
        model.set_river_tau(tau)
        start = time.perf_counter()
        per = [next_token_agreement(model, ids, reference=ref)
               for ids, ref in tqdm(list(zip(encoded, references)), desc=f"τ={tau}")]
        pos = sum(a["positions"] for a in per)
        row = {
            "tau": tau,
            "positions": pos,
            "next_token_match": sum(a["matches"] for a in per) / pos,
            "mean_kl": sum(a["mean_kl"] * a["positions"] for a in per) / pos,
            "mean_exit_layer": sum(a["mean_exit_layer"] for a in per) / len(per),
            "exit_fraction": sum(a["exit_fraction"] for a in per) / len(per),
            "num_layers": per[0]["num_layers"],
            "seconds": time.perf_counter() - start,
        }
        rows.append(row)
        print(f"τ={tau}: next-token match {row['next_token_match']:.3f}, KL {row['mean_kl']:.4f} nats, "
              f"mean exit layer {row['mean_exit_layer']:.2f}/{row['num_layers']}, "
              f"exit fraction {row['exit_fraction']:.2f}", flush=True)
        if args.out:  # rewritten after every τ, so a stopped run keeps what it measured
            _write(args, rows)


def _write(args, rows) -> None:
    from river_hf.eval.common import write_json

    write_json(args.out, {"model": args.model, "prompts": f"first {args.n_prompts} HumanEval prompts, chat template",
                          "new_tokens": args.new_tokens, "rows": rows})


if __name__ == "__main__":
    main()
