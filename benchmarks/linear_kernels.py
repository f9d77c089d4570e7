"""Time one Linear at decode shape (1 token): fp32 vs bf16 vs quanto int4 (bf16 activations).

    python benchmarks/linear_kernels.py [--out docs/results/linear_kernels_cpu.json]

Shapes are those of the models river-hf ships keys for. Prints one line per shape and writes JSON
(microseconds per call, median of 5 batches of 100 calls; relative output error of int4).
"""

from __future__ import annotations

import argparse
import statistics
import time

SHAPES = [(896, 896), (896, 4864), (4864, 896), (576, 1536), (1536, 576), (1536, 8960), (640, 2048)]


def per_call_us(f, x, calls=100, batches=5):
    import torch

    with torch.no_grad():
        for _ in range(10):
            f(x)
        times = []
        for _ in range(batches):
            t = time.perf_counter()
            for _ in range(calls):
                f(x)
            times.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="docs/results/linear_kernels_cpu.json")
    args = ap.parse_args()
    import torch
    from optimum.quanto import freeze, qint4, quantize

    torch.manual_seed(0)
    rows = []
    for fan_in, fan_out in SHAPES:
        dense = torch.nn.Linear(fan_in, fan_out, bias=False)
        x = torch.randn(1, 1, fan_in)
        bf16 = torch.nn.Linear(fan_in, fan_out, bias=False).to(torch.bfloat16)
        bf16.weight.data.copy_(dense.weight.data)
        q = torch.nn.Sequential(torch.nn.Linear(fan_in, fan_out, bias=False).to(torch.bfloat16))
        q[0].weight.data.copy_(dense.weight.data)
        quantize(q, weights=qint4)
        freeze(q)
        with torch.no_grad():
            ref = dense(x)
            err = float((q(x.bfloat16()).float() - ref).norm() / ref.norm())
        row = {
            "in_features": fan_in, "out_features": fan_out,
            "fp32_us": per_call_us(dense, x), "bf16_us": per_call_us(bf16, x.bfloat16()),
            "int4_bf16_us": per_call_us(q, x.bfloat16()), "int4_relative_error": err,
            "int4_weight_type": type(q[0].weight).__name__,
        }
        rows.append(row)
        print(f"{fan_in}x{fan_out}: fp32 {row['fp32_us']:.0f} µs, bf16 {row['bf16_us']:.0f} µs, "
              f"int4 {row['int4_bf16_us']:.0f} µs ({row['int4_weight_type']}), rel. error {err:.3f}", flush=True)
    result = {"torch": torch.__version__, "threads": torch.get_num_threads(), "rows": rows}
    from river_hf.eval.common import write_json

    write_json(args.out, result)

if __name__ == "__main__":
    main()
