"""How much of a fully quantized decode step is the exit products, and how they scale with threads.

One process, one model (``RiverForCausalLM.from_pretrained(--model)``, ``river_mode("exit")``: every
layer its exit copy, the exit head). The same prompt (HumanEval ``--problem``), greedy, exactly
``--new-tokens`` tokens (EOS suppressed by one index fill per step), ``--repeats`` timed calls
after a warm-up; decode ms per token = (median call time - a one-token call's time) / (tokens - 1).
Rows:

- ``exit``: as built (``--backend`` for every exit Linear and the head; default: the model's own
  choice), with torch's default threads;
- ``exit, 1 thread``: the same with ``torch.set_num_threads(1)``;
- ``no products``: every exit Linear and the exit head replaced by a module that returns zeros
  of the right shape (tokens become garbage; only the time matters): what the rest of the
  model, the generate loop and River's routing cost per step.

products = exit - no products. Writes JSON (``--out``) and prints it.

    python benchmarks/exit_products_share.py --model qwen2.5-coder-0.5b --backend torch-int4 \\
        --out docs/results/exit_products_share_qwen2.5-coder-0.5b.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from torch import nn


class _Zeros(nn.Module):
    """Stands in for an exit Linear: ``[..., in] -> zeros [..., out]`` (no product)."""

    def __init__(self, out_features: int):
        super().__init__()
        self.out_features = out_features

    def forward(self, x):
        return x.new_zeros(*x.shape[:-1], self.out_features)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--backend", default=None, help="one kernel (or choice) for exit layers and head")
    ap.add_argument("--problem", type=int, default=100)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from heldout_speed import SuppressIds, eos_ids  # noqa: E402 - the sibling benchmark's EOS suppressor
    from transformers import AutoTokenizer, LogitsProcessorList

    from river_hf import RiverForCausalLM
    from river_hf.eval.common import humaneval_problems, write_json
    from river_hf.eval.data import humaneval_prompt
    from river_hf.models import encode_prompt, resolve
    from river_hf.quant.autotune import load_average

    kw = {"backend": args.backend, "exit_head": args.backend} if args.backend else {}
    model = RiverForCausalLM.from_pretrained(args.model, dtype=torch.float32, progress=False, **kw)
    tok = AutoTokenizer.from_pretrained(resolve(args.model, progress=False))
    ids = encode_prompt(tok, humaneval_prompt(humaneval_problems()[args.problem]))["input_ids"]
    gen = dict(do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=eos_ids(tok, model)[0],
               logits_processor=LogitsProcessorList([SuppressIds(eos_ids(tok, model))]))

    def ms_per_token() -> float:
        model.generate(ids, max_new_tokens=args.new_tokens, **gen)
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=args.new_tokens, **gen)
            times.append(time.perf_counter() - t)
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=1, **gen)
        first = time.perf_counter() - t
        return (statistics.median(times) - first) / (args.new_tokens - 1) * 1e3

    rows = {}
    threads = torch.get_num_threads()
    with torch.no_grad(), model.river_mode("exit"):
        rows["exit"] = ms_per_token()
        torch.set_num_threads(1)
        rows["exit, 1 thread"] = ms_per_token()
        torch.set_num_threads(threads)
        kernels = {k["kernel"] for k in model.river_kernels()}
        replaced = 0
        for name, module in list(model.named_modules()):
            if hasattr(module, "river_kernel") or type(module).__name__.endswith(("WeightOnlyLinear", "CastLinear")) \
                    or type(module).__name__ in ("OrtMatMulNBitsLinear", "ArkWoqLinear", "DynamicInt8Linear"):
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, child, _Zeros(module.out_features))
                replaced += 1
        rows["no products"] = ms_per_token()
    report = {"command": "python " + " ".join([os.path.relpath(sys.argv[0])] + (argv if argv is not None else sys.argv[1:])),
              "model": args.model, "problem": f"HumanEval/{args.problem}", "new_tokens": args.new_tokens,
              "repeats": args.repeats, "threads": threads, "kernels": sorted(kernels), "replaced_modules": replaced,
              "decode_ms_per_token": rows, "products_ms_per_token": rows["exit"] - rows["no products"],
              "load_avg_1m_after": load_average(), "torch": torch.__version__}
    write_json(args.out, report)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
