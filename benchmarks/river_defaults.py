"""The sweep behind configs/: free-running quality against decode speed, per exit kernel and τ.

    python benchmarks/river_defaults.py --bench B1.json [B2.json ...] --eval E1.json [E2.json ...] \
        --out docs/results/river_defaults_qwen2.5-coder-0.5b

Joins ``river-hf bench`` reports (decode tokens/s, per-round speedup over the unmodified model,
its min-max spread) with ``river-hf eval --task humaneval`` reports (pass@1) on the same
(exit kernel, exit head, τ) — the unmodified model is τ > 1, the fully quantized models the rows
with ``mode == "exit"`` — and writes ``OUT.json``, ``OUT.md`` (a table) and ``OUT.png``
(pass@1 against decode speedup, one point per setting, the speedup's min-max as an error bar).
Nothing is measured here; every number comes from the reports, which keep their own commands.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _key(backend, head, mode, tau):
    if mode == "backbone" or (tau is not None and tau > 1):
        return ("unmodified",)
    if mode == "exit":
        return ("exit", backend, head)
    return ("route", backend, head, round(float(tau), 4))


def _label(key) -> str:
    if key[0] == "unmodified":
        return "unmodified"
    if key[0] == "exit":
        return f"fully {key[1]}" + (f" + {key[2]} head" if key[2] and key[2] != key[1] else "")
    return f"River {key[1]} + {key[2] or 'fp32'} head, τ={key[3]:g}"


def join(bench_files, eval_files) -> list[dict]:
    points: dict[tuple, dict] = {}
    for path in bench_files:
        report = json.loads(Path(path).read_text())
        for r in report["rows"]:
            key = _key(r["exit_layers"], r["exit_head"], r["mode"], r["tau"])
            points.setdefault(key, {})["bench"] = {
                "file": str(path), "decode_tokens_per_s": r["decode_tokens_per_s"], "speedup": r["speedup"],
                "verdict": r["verdict"], "ttft_s": r["ttft_s"]["median"], "weight_mb_per_step": r["weight_bytes_per_token"] / 1e6,
                "bandwidth_share": r.get("stream_triad_share", r.get("bandwidth_share")), "mean_exit_layer": r["mean_exit_layer"],
                "next_token_match": r["next_token_match"]}
    for path in eval_files:
        report = json.loads(Path(path).read_text())
        rc = report["river_config"]
        for r in report["results"]:
            key = _key(rc["backend"], rc.get("exit_head"), r.get("mode", "route"), r["tau"])
            points.setdefault(key, {})["eval"] = {
                "file": str(path), "pass@1": r["pass@1"], "n": r["n"],
                "failed": [s["task_id"] for s in r["samples"] if not s["passed"]],
                "mean_exit_layer": r["mean_exit_layer"]}
    return [{"label": _label(k), "key": list(k), **v} for k, v in sorted(points.items(), key=lambda kv: str(kv[0]))]


def table(points) -> str:
    lines = ["| setting | HumanEval pass@1 (first 20) | decode tokens/s (min-max) | × unmodified, decode (min-max) | "
             "TTFT s | weight MB / step | % of bandwidth | mean exit layer |", "|---|---|---|---|---|---|---|---|"]
    for p in points:
        b, e = p.get("bench"), p.get("eval")
        q = f"{e['pass@1']:.2f}" if e else "not run"
        if b:
            d, sp = b["decode_tokens_per_s"], b["speedup"]
            speed = f"{d['median']:.2f} ({d['min']:.2f}-{d['max']:.2f})"
            ratio = "1 (reference)" if p["label"] == "unmodified" else \
                f"{sp['median']:.2f} ({sp['min']:.2f}-{sp['max']:.2f}) {b['verdict']}"
            share = f"{100 * b['bandwidth_share']:.0f} %" if b.get("bandwidth_share") else ""
            exit_ = "" if b["mean_exit_layer"] is None else f"{b['mean_exit_layer']:.1f}"
            lines.append(f"| {p['label']} | {q} | {speed} | {ratio} | {b['ttft_s']:.2f} | {b['weight_mb_per_step']:.0f} | "
                         f"{share} | {exit_} |")
        else:
            lines.append(f"| {p['label']} | {q} | not timed | | | | | |")
    return "\n".join(lines)


def plot(points, png: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    seen: dict[float, int] = {}  # labels of points at the same pass@1 alternate above / below
    for p in points:
        b, e = p.get("bench"), p.get("eval")
        if not (b and e):
            continue
        sp = b["speedup"]
        kind = p["key"][0]
        color = {"unmodified": "tab:gray", "exit": "tab:red", "route": "tab:blue"}[kind]
        ax.errorbar([sp["median"]], [100 * e["pass@1"]], xerr=[[sp["median"] - sp["min"]], [sp["max"] - sp["median"]]],
                    fmt="o", color=color, capsize=3)
        key = p["key"]
        short = ("unmodified" if kind == "unmodified" else f"fully {key[1]}" if kind == "exit"
                 else f"{key[1]}, τ={key[3]:g}")
        same_y = seen.setdefault(round(e["pass@1"], 3), 0)
        seen[round(e["pass@1"], 3)] += 1
        ax.annotate(short, (sp["median"], 100 * e["pass@1"]), textcoords="offset points",
                    xytext=(-10, 7 if same_y % 2 == 0 else -13), fontsize=8)
    ax.axvline(2.0, color="tab:green", ls="--", lw=1)
    ax.text(2.0, ax.get_ylim()[0], " 2× target", color="tab:green", fontsize=8, va="bottom")
    ax.set_xlabel("decode speedup over the unmodified model (median, min-max over rounds)\n"
                  "River points: exit-layer kernel width, τ (exit head int4, prompt on the backbone)")
    ax.set_ylabel("HumanEval pass@1, first 20 problems (%)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = png.with_name(f".{png.name}.tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(png)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench", nargs="+", required=True, help="river-hf bench JSON reports")
    ap.add_argument("--eval", nargs="+", required=True, help="river-hf eval --task humaneval JSON reports")
    ap.add_argument("--out", required=True, help="output prefix (OUT.json, OUT.md, OUT.png)")
    ap.add_argument("--title", default="", help="plot title")
    args = ap.parse_args()
    from river_hf.eval.common import atomic_write, write_json

    points = join(args.bench, args.eval)
    out = args.out  # a prefix: model names such as qwen2.5-coder-0.5b contain dots
    write_json(Path(out + ".json"), {"bench": args.bench, "eval": args.eval, "points": points,
                                     "note": "speedups are per round within each bench run; the unmodified row shows "
                                             "the last bench file's own unmodified run"})
    atomic_write(Path(out + ".md"), table(points) + "\n")
    plot(points, Path(out + ".png"), args.title)
    print(table(points))


if __name__ == "__main__":
    main()
