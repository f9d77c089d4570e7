"""fp32 CPU Linear on a few rows (a verify pass of k + 1 tokens): torch's F.linear against oneDNN on
prepacked weights (river_hf.quant.dense.PrepackedLinear.measure: weights streamed from memory, the two
alternating round by round, median µs per call), with the weight bandwidth each reaches.

    python benchmarks/verify_linear.py [--in 896 --out 4864] [--rows 1,2,4,8,16]
"""

from __future__ import annotations

import argparse

from river_hf.quant.dense import PrepackedLinear


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--in", dest="in_features", type=int, default=896)
    ap.add_argument("--out", dest="out_features", type=int, default=4864)
    ap.add_argument("--rows", default="1,2,4,8,16")
    args = ap.parse_args(argv)
    size = args.in_features * args.out_features * 4
    print(f"{args.in_features}x{args.out_features} fp32 ({size / 1e6:.1f} MB); median of 5 alternating rounds")
    print(f"{'rows':>4} {'F.linear us':>12} {'GB/s':>6} {'oneDNN us':>10} {'GB/s':>6}")
    for rows in (int(r) for r in args.rows.split(",")):
        t = PrepackedLinear.measure(args.in_features, args.out_features, rows)
        print(f"{rows:>4} {t['torch']:>12.0f} {size / t['torch'] / 1e3:>6.1f} {t['onednn']:>10.0f} {size / t['onednn'] / 1e3:>6.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
