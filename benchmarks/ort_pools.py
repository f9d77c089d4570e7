"""onnxruntime's thread pools against torch's int4 kernel, in a synthetic decode step (docs/river.md).

One "step" is 24 layers of Qwen2.5-0.5B's exit-layer products (q 896x896, k/v 896x128, o
896x896, gate/up 896x4864, down 4864x896; random weights) plus the 896x151936 head, with the
norms, the SiLU product and the residual adds between them, and (unless ``--no-attention``) one
``scaled_dot_product_attention`` per layer (14 query heads over 2 KV heads of 300 positions), as
a real step has torch work between the products. Configurations (``MODE``, one per process,
because onnxruntime's pool choice is process-wide):

- ``torch-int4``: tinygemm (``torch._weight_int4pack_mm_for_cpu``) for every product;
- ``ort-session``: onnxruntime ``MatMulNBits`` int4, one pool per session, spinning off (river-hf's setting);
- ``ort-global``: the same sessions on onnxruntime's process-wide pool
  (``set_global_thread_pool_sizes(torch threads, 1)``, ``use_per_session_threads = False``; its
  workers spin, and the Python API cannot turn that off);
- ``ort-global-t1``: ``ort-global`` with torch on one thread (so torch's OpenMP pool does not
  compete with onnxruntime's);
- ``ark-int4``: ARK ``woqgemm`` (auto-round-lib) for every product.

Prints and writes (``--out``, JSON lines appended) the median and min over ``--steps`` steps
after 3 warm-up steps, with the 1-minute load average.

    for m in torch-int4 ort-session ort-global ort-global-t1 ark-int4; do
        python benchmarks/ort_pools.py $m --out docs/results/ort_pools.jsonl; done
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

H, INTER, KV, VOCAB, LAYERS = 896, 4864, 128, 151936, 24
SHAPES = [(H, H), (H, KV), (H, KV), (H, H), (H, INTER), (H, INTER), (INTER, H)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("torch-int4", "ort-session", "ort-global", "ort-global-t1", "ark-int4"))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--no-attention", action="store_true")
    ap.add_argument("--out", default=None, help="JSON-lines file to append the result to")
    args = ap.parse_args(argv)

    from river_hf.quant import external
    from river_hf.quant.autotune import load_average
    from river_hf.quant.kernels import KERNELS

    if args.mode.startswith("ort-global"):
        import onnxruntime as ort

        ort.set_global_thread_pool_sizes(max(1, torch.get_num_threads()), 1)

        def global_session(model: bytes):
            so = ort.SessionOptions()
            so.use_per_session_threads = False
            so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            so.log_severity_level = 3
            return ort.InferenceSession(model, sess_options=so, providers=["CPUExecutionProvider"])

        external._ort_session = global_session  # this process only
    kernel = KERNELS[{"torch-int4": "torch-int4", "ark-int4": "ark-int4"}.get(args.mode, "ort-int4")]
    torch.manual_seed(0)
    layers = [[kernel.build(nn.Linear(i, o, bias=False)) for i, o in SHAPES] for _ in range(LAYERS)]
    head = kernel.build(nn.Linear(H, VOCAB, bias=False))
    threads = torch.get_num_threads()
    if args.mode == "ort-global-t1":
        torch.set_num_threads(1)
    x = torch.randn(1, 1, H)
    q_att, kv_att = torch.randn(1, 14, 1, 64), torch.randn(1, 2, 300, 64)

    def step():
        h = x
        for q, k, v, o, gate, up, down in layers:
            n = F.rms_norm(h, (H,))
            if not args.no_attention:
                F.scaled_dot_product_attention(q_att, kv_att, kv_att, enable_gqa=True)
            qq, _, _ = q(n), k(n), v(n)
            h = h + o(qq)
            n = F.rms_norm(h, (H,))
            h = h + down(F.silu(gate(n)) * up(n))
        return head(F.rms_norm(h, (H,)))

    with torch.no_grad():
        for _ in range(3):
            step()
        times = []
        for _ in range(args.steps):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
    result = {"mode": args.mode, "attention_between": not args.no_attention, "steps": args.steps,
              "median_ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3,
              "torch_threads": torch.get_num_threads(), "threads": threads, "load_avg_1m": load_average(),
              "command": "python benchmarks/ort_pools.py " + " ".join(argv if argv is not None else os.sys.argv[1:])}
    print(json.dumps(result))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
