"""river-int4's product against an earlier revision of its own source: the same packed weights, the
same inputs, both builds in one process, timed alternating.

Builds ``src/river_hf/quant/csrc/river_int4.cpp`` as it is in the work tree and as it was at
``--baseline`` (a git revision, read with ``git show``), each with the flags river-hf uses for this CPU
(``river_int4.INSTRUCTION_SETS``), into a temporary directory. For each weight shape (``in x out``,
the Qwen2.5-Coder-0.5B exit shapes by default) it packs random 4-bit weights (copies totalling
``--stream-mb`` MB, so they stream from memory as in a decode step), checks that both builds give the
same floats bit for bit on ``--rows`` rows, then times one call per copy, ``--rounds`` rounds in
alternating order after one untimed round: median and min-max µs per call and GB/s of packed bytes.
JSON + PNG.

    python benchmarks/probes/int4_rows.py --baseline 4bf3929 \\
        --out docs/results/epyc-zen1-2core/int4_rows_4bf3929.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SHAPES = ((896, 1152), (896, 896), (896, 9728), (4864, 896), (896, 151936))
SOURCE = Path("src/river_hf/quant/csrc/river_int4.cpp")


def build(name: str, source: Path, flags: list[str]):
    from torch.utils.cpp_extension import load

    directory = source.parent / name
    directory.mkdir()
    return load(name=name, sources=[str(source)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                build_directory=str(directory), verbose=False)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True, help="git revision of the source to compare with")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--stream-mb", type=float, default=64.0)
    ap.add_argument("--out", required=True, help="JSON path (a PNG beside it)")
    args = ap.parse_args(argv)

    from river_hf.bench_harness.output import command_line
    from river_hf.quant import river_int4
    from river_hf.quant.autotune import load_average

    isa = river_int4.instruction_set()
    if isa is None:
        ap.error("this CPU has neither instruction set river-int4 is built for")
    flags = [*river_int4._CFLAGS, *river_int4.INSTRUCTION_SETS[isa][1]]
    root = Path(__file__).resolve().parents[2]
    try:
        old = subprocess.run(["git", "show", f"{args.baseline}:{SOURCE}"], cwd=root, check=True,
                             capture_output=True, text=True).stdout
    except subprocess.CalledProcessError as e:
        ap.error(f"--baseline {args.baseline}: {e.stderr.strip()}")
    load_before = load_average()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "baseline.cpp").write_text(old)
        (Path(tmp) / "current.cpp").write_text((root / SOURCE).read_text())
        tag = f"{os.getpid()}"
        builds = {"baseline": build(f"ri4_baseline_{tag}", Path(tmp) / "baseline.cpp", flags),
                  "current": build(f"ri4_current_{tag}", Path(tmp) / "current.cpp", flags)}
        rows = []
        for k, n in SHAPES:
            g = 128
            copies = max(2, int(args.stream_mb * 1e6 // (k * n // 2)))
            gen = torch.Generator().manual_seed(k * n)
            packs = [builds["current"].pack(torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen),
                                            (torch.rand(n, k // g, generator=gen) * 0.01).half(),
                                            (torch.randn(n, k // g, generator=gen) * 0.01).half(), g)
                     for _ in range(copies)]
            x = torch.randn(args.rows, k, generator=gen)
            outs = {name: m.mm(x, packs[0], None, g, None, 0.0, False, None) for name, m in builds.items()}
            same = torch.equal(outs["baseline"], outs["current"])
            calls = {name: (lambda m=m: [m.mm(x, p, None, g, None, 0.0, False, None) for p in packs])
                     for name, m in builds.items()}
            for call in calls.values():
                call()
            times = {name: [] for name in calls}
            for r in range(args.rounds):
                for name in (list(calls) if r % 2 == 0 else list(calls)[::-1]):
                    start = time.perf_counter()
                    calls[name]()
                    times[name].append((time.perf_counter() - start) / copies * 1e6)
            nbytes = packs[0].numel()
            row = {"shape": f"{k}x{n}", "packed_bytes": nbytes, "bit_identical": same}
            for name, v in times.items():
                med = statistics.median(v)
                row[name] = {"median_us": med, "min_us": min(v), "max_us": max(v), "gb_per_s": nbytes / med / 1e3}
            row["speedup"] = row["baseline"]["median_us"] / row["current"]["median_us"]
            rows.append(row)
            print(f"{row['shape']:>11}: baseline {row['baseline']['median_us']:.0f} us, current "
                  f"{row['current']['median_us']:.0f} us ({row['speedup']:.2f}x), bit-identical {same}", flush=True)
    report = {"command": command_line(argv), "baseline": args.baseline, "isa": isa, "rows": args.rows,
              "rounds": args.rounds, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
              "torch": torch.__version__, "load_avg_1m_before": load_before, "load_avg_1m_after": load_average(),
              "shapes": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return 0
    fig, ax = plt.subplots(figsize=(6, 3))
    labels = [r["shape"] for r in rows]
    for i, name in enumerate(("baseline", "current")):
        ax.bar([j + 0.4 * i for j in range(len(rows))], [r[name]["gb_per_s"] for r in rows], width=0.4,
               label=f"{name} ({args.baseline})" if name == "baseline" else name)
    ax.set_xticks([j + 0.2 for j in range(len(rows))], labels)
    ax.set_ylabel("GB/s of packed weights")
    ax.set_title(f"river-int4 ({isa}), {args.rows} row(s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=100)
    return 0


if __name__ == "__main__":
    sys.exit(main())
