"""Time one Linear at decode shape (1 token): fp32 and bf16 dense against every weight-only kernel.

    python benchmarks/linear_kernels.py [--out docs/results/linear_kernels_cpu.json]

Shapes are those of the models river-hf ships keys for. The timing is the kernel tuner's own
(``river_hf.quant.autotune.KernelTuner.measure``, the routine ``enable_river`` chooses kernels
with): separate copies of each kernel's module totalling twice the last-level cache, so a pass
reads its weights from memory as a decode step does; one warm-up call each; ``--rounds`` rounds,
the candidates' order alternating from round to round; median µs per call. Dense fp32 and bf16 are
the ``copy`` kernel on an fp32 / a bf16 weight. Next to each kernel: its relative output error
||Wq x − W x|| / ||W x|| on a random weight (the same check the kernels pass before use). Prints
one line per shape and writes JSON.
"""

from __future__ import annotations

import argparse
import copy

SHAPES = [(896, 896), (896, 4864), (4864, 896), (576, 1536), (1536, 576), (1536, 8960), (640, 2048)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="docs/results/linear_kernels_cpu.json")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--shapes", default=None, help="comma list of INxOUT (default: the shipped models' shapes)")
    args = ap.parse_args(argv)
    import torch

    from river_hf.eval.common import write_json
    from river_hf.quant.autotune import KernelTuner, last_level_cache_bytes
    from river_hf.quant.kernels import KERNELS

    shapes = SHAPES if not args.shapes else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    tuner = KernelTuner(cache_file=False, rounds=args.rounds)
    torch.manual_seed(0)
    rows = []
    for fan_in, fan_out in shapes:
        dense = torch.nn.Linear(fan_in, fan_out, bias=False)
        kernels = [k for k in KERNELS.values() if k.name != "copy" and k.available() and k.supports(dense)]
        fp32 = tuner.measure([KERNELS["copy"]] + kernels, dense)
        bf16 = tuner.measure([KERNELS["copy"]], copy.deepcopy(dense).to(torch.bfloat16))["copy"]
        x = torch.randn(4, fan_in)
        errors = {}
        with torch.no_grad():
            ref = dense(x)
            for k in kernels:
                q = k.build(dense)
                errors[k.name] = float((q(x).float() - ref).norm() / ref.norm())
        row = {"in_features": fan_in, "out_features": fan_out, "fp32_us": fp32.pop("copy"), "bf16_us": bf16,
               "kernels_us": fp32, "relative_error": errors}
        rows.append(row)
        print(f"{fan_in}x{fan_out}: fp32 {row['fp32_us']:.0f} µs, bf16 {bf16:.0f} µs, " + ", ".join(
            f"{name} {us:.0f} µs (err {errors[name]:.3f})" for name, us in fp32.items()), flush=True)
    write_json(args.out, {
        "command": "python benchmarks/linear_kernels.py" + ("" if argv is None else " " + " ".join(argv)),
        "protocol": (f"KernelTuner.measure: weights streamed (copies totalling {tuner.stream_bytes / 1e6:.0f} MB; last-level "
                     f"cache {last_level_cache_bytes() / 1e6:.0f} MB), warm-up, {args.rounds} alternating rounds, median"),
        "torch": torch.__version__, "threads": torch.get_num_threads(), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
