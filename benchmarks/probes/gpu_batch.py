"""River with a batch on a GPU: per-row exit and batched lossless on CUDA, and what a batch buys.

    python benchmarks/probes/gpu_batch.py [--shape qwen2.5-0.5b] [--batches 1,8,32] [--new-tokens 64] [--out FILE.json]

Random weights of a real shape (no checkpoint travels to the GPU machine): exit *decisions* mean
nothing here, so this checks exactness on CUDA and measures the bounds of the speed. Checks, each
on a left-padded batch of 8 prompts of different lengths: τ > 1 equals the unmodified model's
batch; each row of a River batch against its solo River tokens (counted: batched products may sum
in another order); lossless greedy equals the unmodified batch. Speed: total new tokens per second
(every row's tokens, wall clock around ``generate`` with the device synchronized) for the
unmodified model, the fully 4-bit model (every layer on its exit copy) and lossless, at each batch
size, median of ``--repeats`` alternating rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from gpu_river import SHAPES


def left_padded(torch, batch: int, device, seed: int = 0):
    """``(input_ids, attention_mask)``: ``batch`` random prompts of 24-64 tokens, left-padded with 0."""
    g = torch.Generator().manual_seed(seed)
    lengths = [24 + (40 * r) // max(batch - 1, 1) for r in range(batch)]
    width = max(lengths)
    ids = torch.randint(100, 20000, (batch, width), generator=g)
    mask = torch.ones_like(ids)
    for r, n in enumerate(lengths):
        ids[r, : width - n] = 0
        mask[r, : width - n] = 0
    return ids.to(device), mask.to(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen2.5-0.5b", choices=SHAPES)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tau", type=float, default=0.9, help="River's τ for the per-row check")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                    help="default: bfloat16 on a GPU, float32 on the CPU")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from river_hf import enable_river
    from river_hf.river import ExitRuleList, MinLayerRule, StateTransitionSimilarityRule

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device == "cuda" else torch.float32)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    torch.manual_seed(0)
    config = Qwen2Config(**SHAPES[args.shape], max_position_embeddings=4096)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()
    model.generation_config.pad_token_id = 0
    gen = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    ids, mask = left_padded(torch, 8, device)
    ref = model.generate(input_ids=ids, attention_mask=mask, **gen)

    def rows_differing_from_solo(batched):
        """How many rows of ``batched`` differ from the same prompt generated alone (no padding)."""
        n = 0
        for r in range(ids.shape[0]):
            solo = model.generate(input_ids=ids[r:r + 1, mask[r].bool()], **gen)
            n += int(not torch.equal(solo[0, -args.new_tokens:], batched[r, -args.new_tokens:]))
        return n

    unmodified_differ = rows_differing_from_solo(ref)  # the noise floor: batched products in another order
    t0 = time.perf_counter()
    enable_river(model, tau=2.0, min_layer=2, progress=False)
    build_s = time.perf_counter() - t0
    checks = {"tau_above_one_batch_equals_unmodified": bool(torch.equal(
        model.generate(input_ids=ids, attention_mask=mask, **gen), ref))}
    with model.river_mode("lossless"):
        out = model.generate(input_ids=ids, attention_mask=mask, **gen)
        s = model.river_stats
    checks["lossless_batch_equals_unmodified"] = bool(torch.equal(out, ref))
    checks["lossless_mode"] = s["mode"]
    checks["lossless_acceptance_rate"] = s.get("lossless", {}).get("acceptance_rate")
    model.river.rules = ExitRuleList([MinLayerRule(2), StateTransitionSimilarityRule(args.tau)])
    differ = rows_differing_from_solo(model.generate(input_ids=ids, attention_mask=mask, **gen))
    checks.update({"river_tau": args.tau, "river_rows_differing_from_solo": differ, "river_rows": ids.shape[0],
                   "unmodified_rows_differing_from_solo": unmodified_differ,
                   "river_mean_exit_layer": model.river_stats["mean_exit_layer"]})
    print(json.dumps(checks), flush=True)

    def once(mode, b_ids, b_mask):
        with model.river_mode(mode):
            sync()
            t = time.perf_counter()
            model.generate(input_ids=b_ids, attention_mask=b_mask, **gen)
            sync()
            return b_ids.shape[0] * args.new_tokens / (time.perf_counter() - t)

    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        b_ids, b_mask = left_padded(torch, batch, device, seed=batch)
        modes = ["backbone", "exit", "lossless"]
        for m in modes:  # warm-up
            once(m, b_ids, b_mask)
        rates = {m: [] for m in modes}
        for i in range(args.repeats):
            for m in (modes if i % 2 == 0 else modes[::-1]):
                rates[m].append(once(m, b_ids, b_mask))
        for m in modes:
            row = {"batch": batch, "mode": m, "tokens_per_s": statistics.median(rates[m]),
                   "min": min(rates[m]), "max": max(rates[m])}
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
              "shape": args.shape, "dtype": str(dtype), "new_tokens": args.new_tokens,
              "exit_layer_build_seconds": build_s, "checks": checks, "rows": rows}
    if args.out:
        from river_hf.files import write_json

        write_json(args.out, result)


if __name__ == "__main__":
    main()
