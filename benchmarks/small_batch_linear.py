"""Time a few-token forward on top of a cached prefix (R-Stitch's catch-up, assisted generation's
verify step) with torch's stock Linear kernels and inside ``river_hf.quant.dense.SmallBatchLinear``.

    PYTHONPATH=src python benchmarks/small_batch_linear.py [--models qwen2.5-coder-0.5b,qwen2.5-coder-1.5b] \
        [--chunks 1,2,3,4,8,16,32,64,128] [--cache-length 150] [--out docs/results/small_batch_linear_cpu]

For every model and chunk size k: a prefill of ``--cache-length`` random tokens, then a forward of
k tokens on top of it (``logits_to_keep=1``, the cache cropped back in between), stock and routed
alternately, ``--repeats`` times each; the median is reported, with the cost in one-token decode
steps (k = 1, stock), the achieved weight bandwidth of a decode step (weight bytes read per step /
seconds) and the largest absolute logit difference between the two paths. Writes
``OUT.json`` and ``OUT.png`` (write to a temp file, then rename).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from river_hf.eval.common import atomic_write


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen2.5-coder-0.5b,qwen2.5-coder-1.5b")
    ap.add_argument("--chunks", default="1,2,3,4,8,16,32,64,128")
    ap.add_argument("--cache-length", type=int, default=150)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="docs/results/small_batch_linear_cpu")
    args = ap.parse_args(argv)
    chunks = [int(c) for c in args.chunks.split(",")]

    import torch
    from transformers import DynamicCache

    from river_hf.quant.dense import SmallBatchLinear
    from river_hf.models import load

    results = {"command": "PYTHONPATH=src python " + " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
               "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
               "cache_length": args.cache_length, "repeats": args.repeats, "models": {}}
    gen = torch.Generator().manual_seed(0)
    for key in args.models.split(","):
        model, _ = load(key, dtype=torch.float32, progress=False)
        # weight bytes one decode step reads: every parameter except an untied input-embedding table
        # (a step reads one of its rows)
        emb = model.get_input_embeddings().weight
        tied = emb is model.get_output_embeddings().weight
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if tied or p is not emb)
        ids = torch.randint(100, 20000, (1, args.cache_length + max(chunks)), generator=gen)
        cache = DynamicCache(config=model.config)
        rows = []
        with torch.no_grad():
            model(input_ids=ids[:, : args.cache_length], cache=cache, use_cache=True, logits_to_keep=1)

            def forward(k: int, routed: bool):
                x = ids[:, args.cache_length : args.cache_length + k]
                t0 = time.perf_counter()
                if routed:
                    with SmallBatchLinear():
                        out = model(input_ids=x, cache=cache, use_cache=True, logits_to_keep=1)
                else:
                    out = model(input_ids=x, cache=cache, use_cache=True, logits_to_keep=1)
                dt = time.perf_counter() - t0
                cache.crop(-k)  # transformers 5: negative = tokens to drop
                return dt, out.logits[0, -1]

            forward(1, False)  # warm-up
            for k in chunks:
                times = {False: [], True: []}
                logits = {}
                for _ in range(args.repeats):
                    for routed in (False, True):
                        dt, logits[routed] = forward(k, routed)
                        times[routed].append(dt)
                stock, routed = statistics.median(times[False]), statistics.median(times[True])
                rows.append({"tokens": k, "stock_s": stock, "routed_s": routed, "speedup": stock / routed,
                             "max_abs_logit_diff": float((logits[True] - logits[False]).abs().max())})
                print(f"{key} k={k:4d} stock {stock:.3f} s  routed {routed:.3f} s  {stock / routed:.2f}x  "
                      f"max |dlogit| {rows[-1]['max_abs_logit_diff']:.1e}", flush=True)
        decode = rows[0]["stock_s"] if rows and rows[0]["tokens"] == 1 else None
        for r in rows:
            r["stock_decode_steps"] = r["stock_s"] / decode if decode else None
            r["routed_decode_steps"] = r["routed_s"] / decode if decode else None
        results["models"][key] = {"weight_bytes_read_per_decode_step": weight_bytes, "rows": rows,
                                  "decode_GBps": weight_bytes / decode / 1e9 if decode else None}
        if decode:
            print(f"{key}: decode step {decode:.3f} s = {weight_bytes / decode / 1e9:.1f} GB/s of weights "
                  f"({weight_bytes / 1e9:.2f} GB read per step)", flush=True)
        del model

    atomic_write(args.out + ".json", json.dumps(results, indent=1).encode())
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for key, m in results["models"].items():
        ks = [r["tokens"] for r in m["rows"]]
        if m["rows"][0]["stock_decode_steps"] is None:
            continue
        ax.plot(ks, [r["stock_decode_steps"] for r in m["rows"]], "o--", label=f"{key} stock F.linear")
        ax.plot(ks, [r["routed_decode_steps"] for r in m["rows"]], "s-", label=f"{key} SmallBatchLinear")
    ax.plot(chunks, chunks, ":", color="grey", label="k one-token steps")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("tokens in the forward (k), on top of %d cached" % args.cache_length)
    ax.set_ylabel("cost in one-token decode steps")
    ax.set_title(f"fp32 CPU, {results['torch_threads']} threads: few-token forward cost")
    ax.legend(fontsize=7)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    atomic_write(args.out + ".png", buf.getvalue())
    print("wrote", args.out + ".json", args.out + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
