"""river-hf's own products (river-int4's ``mm``, river-fp32's ``dense_mm`` with ``--product dense``, or
river-grid's ``grid_mm`` with ``--product grid``) against an earlier revision of their source: the same weights, the same inputs, both builds
in one process, timed alternating.

Builds ``src/river_hf/quant/csrc/river_int4.cpp`` as it is in the work tree and as it was at
``--baseline`` (a git revision, read with ``git show``), each with the flags river-hf uses for this CPU
(``river_int4.INSTRUCTION_SETS``), into a temporary directory. For each weight shape (``in x out``;
Qwen2.5-Coder-0.5B's exit shapes for int4, its backbone shapes for dense) it makes random weights
(packed 4-bit; fp32 as ``nn.Linear`` stores them; a Q4_K-like grid, int8 values with fp32 scales and
offsets per 32 input channels, packed by the current build; copies totalling ``--stream-mb`` MB, so they
stream from memory as in a decode step), and for each row count in ``--rows`` checks that both builds
give the same floats bit for bit, then times one call per copy, ``--rounds`` rounds in alternating
order after one untimed round: median and min-max µs per call, GB/s of weight bytes and GFLOP/s.
JSON + PNG.

    python benchmarks/probes/int4_rows.py --baseline 4bf3929 \\
        --out docs/results/epyc-zen1-2core/int4_rows_4bf3929.json
    python benchmarks/probes/int4_rows.py --product dense --rows 1,2,4,8,16 --baseline eff03e5 \\
        --out docs/results/epyc-zen1-2core/dense_rows_eff03e5.json
    python benchmarks/probes/int4_rows.py --product grid --rows 1,4,6,8,12,16 --baseline ec3ea4e \
        --out docs/results/epyc-zen5-2core/grid_rows_ec3ea4e.json
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

SHAPES = {"int4": ((896, 1152), (896, 896), (896, 9728), (4864, 896), (896, 151936)),
          "dense": ((896, 896), (896, 128), (896, 4864), (4864, 896), (896, 151936)),
          "grid": ((896, 4864), (4864, 896), (1536, 8960), (8960, 1536))}  # the MLP shapes of Qwen2.5-Coder-0.5B / 1.5B
SOURCE = Path("src/river_hf/quant/csrc/river_int4.cpp")


def _sources(root: Path, revision: str | None) -> dict[str, str]:
    """The kernel's C++ files (the source and the headers beside it) by name: as they are in the work
    tree (``revision`` None) or at git ``revision``."""
    folder = SOURCE.parent
    if revision is None:
        return {p.name: p.read_text() for p in sorted((root / folder).iterdir()) if p.suffix in (".cpp", ".h")}
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{revision}:{folder}"], cwd=root, check=True,
                           capture_output=True, text=True).stdout.split()
    return {n: subprocess.run(["git", "show", f"{revision}:{folder / n}"], cwd=root, check=True,
                              capture_output=True, text=True).stdout
            for n in names if n.endswith((".cpp", ".h"))}


def build(name: str, source: Path, flags: list[str]):
    from torch.utils.cpp_extension import load

    directory = source.parent / name
    directory.mkdir()
    return load(name=name, sources=[str(source)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                build_directory=str(directory), verbose=False)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True, help="git revision of the source to compare with")
    ap.add_argument("--product", choices=("int4", "dense", "grid"), default="int4",
                    help="river-int4's packed 4-bit product (default), river-fp32's dense_mm or river-grid's grid_mm")
    ap.add_argument("--rows", default="1", help="row counts per call, a comma list (default: 1)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--stream-mb", type=float, default=64.0)
    ap.add_argument("--out", required=True, help="JSON path (a PNG beside it)")
    args = ap.parse_args(argv)
    try:
        row_counts = [int(r) for r in args.rows.split(",")]
    except ValueError:
        ap.error(f"--rows: a comma list of positive integers, got {args.rows!r}")
    if not row_counts or min(row_counts) < 1:
        ap.error(f"--rows: a comma list of positive integers, got {args.rows!r}")

    from river_hf.bench_harness.output import command_line
    from river_hf.quant import river_int4
    from river_hf.quant.autotune import load_average

    isa = river_int4.instruction_set()
    if isa is None:
        ap.error("this CPU has neither instruction set river-int4 is built for")
    flags = [*river_int4._CFLAGS, *river_int4.INSTRUCTION_SETS[isa][1]]
    root = Path(__file__).resolve().parents[2]
    try:
        old = _sources(root, args.baseline)
    except subprocess.CalledProcessError as e:
        ap.error(f"--baseline {args.baseline}: {e.stderr.strip()}")
    load_before = load_average()
    with tempfile.TemporaryDirectory() as tmp:
        tag = f"{os.getpid()}"
        builds = {}
        for name, files in (("baseline", old), ("current", _sources(root, None))):
            folder = Path(tmp) / name
            folder.mkdir()
            for file, text in files.items():
                (folder / file).write_text(text)
            builds[name] = build(f"ri4_{name}_{tag}", folder / SOURCE.name, flags)
        rows = []
        for k, n in SHAPES[args.product]:
            gen = torch.Generator().manual_seed(k * n)
            run, weights, nbytes = _product(args.product, builds["current"], k, n, args.stream_mb, gen)
            for count in row_counts:
                x = torch.randn(count, k, generator=gen)
                outs = {name: run(m, x, weights[0]) for name, m in builds.items()}
                same = torch.equal(outs["baseline"], outs["current"])
                for m in builds.values():
                    for w in weights:
                        run(m, x, w)
                times = {name: [] for name in builds}
                for r in range(args.rounds):
                    for name in (list(builds) if r % 2 == 0 else list(builds)[::-1]):
                        start = time.perf_counter()
                        for w in weights:
                            run(builds[name], x, w)
                        times[name].append((time.perf_counter() - start) / len(weights) * 1e6)
                row = {"shape": f"{k}x{n}", "rows": count, "weight_bytes": nbytes, "bit_identical": same}
                for name, v in times.items():
                    med = statistics.median(v)
                    row[name] = {"median_us": med, "min_us": min(v), "max_us": max(v), "gb_per_s": nbytes / med / 1e3,
                                 "gflop_per_s": 2 * count * k * n / med / 1e3}
                row["speedup"] = row["baseline"]["median_us"] / row["current"]["median_us"]
                rows.append(row)
                print(f"{row['shape']:>11} x {count:>2} rows: baseline {row['baseline']['median_us']:.0f} us, current "
                      f"{row['current']['median_us']:.0f} us ({row['speedup']:.2f}x), bit-identical {same}", flush=True)
    report = {"command": command_line(argv), "baseline": args.baseline, "isa": isa, "product": args.product, "rows": row_counts,
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
    fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(rows)), 3))
    labels = [r["shape"] if len(row_counts) == 1 else f"{r['shape']}\n{r['rows']} rows" for r in rows]
    for i, name in enumerate(("baseline", "current")):
        ax.bar([j + 0.4 * i for j in range(len(rows))], [r[name]["gb_per_s"] for r in rows], width=0.4,
               label=f"{name} ({args.baseline})" if name == "baseline" else name)
    ax.set_xticks([j + 0.2 for j in range(len(rows))], labels, fontsize=6)
    ax.set_ylabel("GB/s of fp32 weights" if args.product == "dense" else "GB/s of packed weights")
    title = {"int4": "river-int4", "dense": "river-fp32 dense_mm", "grid": "river-grid grid_mm"}[args.product]
    ax.set_title(f"{title} ({isa}), rows {args.rows}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=100)
    return 0


def _product(product: str, current, k: int, n: int, stream_mb: float, gen):
    """``(run, weights, weight bytes of one copy)`` for ``product`` on an ``in k x out n`` weight:
    ``run(build, x, weight)`` is one call, ``weights`` the copies (packed by ``current`` for int4)."""
    if product == "int4":
        g = 128
        copies = max(2, int(stream_mb * 1e6 // (k * n // 2)))
        weights = [current.pack(torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen),
                                (torch.rand(n, k // g, generator=gen) * 0.01).half(),
                                (torch.randn(n, k // g, generator=gen) * 0.01).half(), g)
                   for _ in range(copies)]
        return (lambda m, x, w: m.mm(x, w, None, g, None, 0.0, False, None)), weights, weights[0].numel()
    if product == "grid":
        g = 32
        copies = max(2, int(stream_mb * 1e6 // (k * n * 1.25)))
        weights = [current.grid_pack(torch.randint(-32, 32, (n, k), dtype=torch.int8, generator=gen),
                                     torch.rand(n, k // g, generator=gen) * 0.01, torch.rand(n, k // g, generator=gen) * 0.01)
                   for _ in range(copies)]
        return (lambda m, x, w: m.grid_mm(x, w, n, k, g, True, None)), weights, weights[0].numel()
    copies = max(2, int(stream_mb * 1e6 // (k * n * 4)))
    weights = [torch.randn(n, k, generator=gen) for _ in range(copies)]
    return (lambda m, x, w: m.dense_mm(x, w, None)), weights, k * n * 4


if __name__ == "__main__":
    sys.exit(main())
