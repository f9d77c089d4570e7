"""The front page's results, regenerated: run the held-out benchmark at each batch size on one machine
and write its tables where the README and docs read them.

    python benchmarks/report.py --machine-label xeon-2core

runs ``benchmarks/heldout_speed.py`` (a separate process per batch size, one at a time: the
protocol is its own, see its docstring) on held-out HumanEval prompts, writes
``docs/results/<machine-label>/heldout_<model>_b<N>.{json,md,png}``, then
``docs/results/<machine-label>/README.md`` (every table, with its command) and the README's
headline block between ``<!-- headline:start -->`` and ``<!-- headline:end -->``. A figure that
was wrong is fixed by rerunning this, never by hand. ``--render-only`` rebuilds the two Markdown
files from the JSON already there (no benchmark runs); with ``--batches ''`` the folder's README
lists only its other results (a machine without the standard runs).

Run it alone on the machine: a second job on 2 cores makes every timing meaningless (the
benchmark warns when the load average says so, and the tables print the load it saw).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
START, END = "<!-- headline:start -->", "<!-- headline:end -->"
#: What each method of heldout_speed is called on the front page.
NAMES = {"unmodified": "plain transformers fp32", "unmodified-onednn": "plain fp32 on prepacked oneDNN",
         "unmodified-river-fp32": "plain fp32 on river-fp32 (1-8 rows)",
         "river": "**River** (defaults)", "exit": "fully quantized (every layer its exit copy)",
         "lossless": "**lossless** (the plain model's tokens)", "llama.cpp": "llama.cpp, same GGUF",
         "river-mkl": "River, backbone layers on F.linear (backbone_kernel torch)"}


def result_path(folder: Path, model: str, batch: int) -> Path:
    return folder / f"heldout_{model}_b{batch}.json"


def run(args, folder: Path) -> None:
    """One heldout_speed process per batch size; stops at the first that fails."""
    for batch in args.batches:
        methods = args.methods if batch == 1 else ",".join(m for m in args.methods.split(",") if m != "llama.cpp")
        cmd = [sys.executable, str(ROOT / "benchmarks" / "heldout_speed.py"), "--model", args.model,
               "--methods", methods, "--prompts", args.prompts, "--new-tokens", str(args.new_tokens),
               "--repeats", str(args.repeats), "--batch", str(batch),
               "--out", os.path.relpath(result_path(folder, args.model, batch), ROOT)]
        print("report:", " ".join(cmd[1:]), file=sys.stderr, flush=True)
        subprocess.run(cmd, cwd=ROOT, check=True)


def headline(report: dict, label: str, link: str) -> str:
    """The README's headline table from a batch-1 heldout_speed report."""
    comp = report["comparison"]
    ref = next(r for r in comp["rows"] if r["label"] == comp["reference"])
    n = len(report["prompts"])
    sets = " and ".join(name for name, prefix in (("HumanEval", "HumanEval/"), ("GSM8K", "gsm8k/"))
                        if any(p.startswith(prefix) for p in report["prompts"]))
    lines = [f"Measured on **{label}** ({report['cpus']} cores, torch {report['torch']}, {report['threads']} threads), "
             f"{report['model']}, {n} held-out {sets} prompts × exactly {report['new_tokens']} new tokens, greedy, "
             f"batch 1, median (min-max) of {comp['repeats']} alternating rounds ([table and command]({link})):", "",
             "| method | end to end tok/s (× plain) | decode tok/s (× plain, min-max) | same tokens as plain fp32 |",
             "|---|---|---|---|"]
    for r in comp["rows"]:
        e2e, d, sp = r["tokens_per_s"], r["decode_tokens_per_s"], r["speedup"]
        ratio = "1" if r is ref else f"{sp['median']:.2f}, {sp['min']:.2f}-{sp['max']:.2f}"
        lines.append(f"| {NAMES.get(r['label'], r['label'])} | {e2e['median']:.1f} "
                     f"({e2e['median'] / ref['tokens_per_s']['median']:.2f}) | {d['median']:.1f} ({ratio}) | "
                     f"{report['identical_to_fp32_reference'][r['label']]}/{n} |")
    return "\n".join(lines)


def batch_table(reports: dict[int, dict]) -> str:
    """Decode speedup over the plain model at the same batch size, one row per batch size."""
    methods = [m for m in ("river", "exit", "lossless") if all(m in r["tokens"] for r in reports.values())]
    lines = ["| batch | plain fp32 decode tok/s | " + " | ".join(f"{NAMES[m]} × plain (min-max)" for m in methods) + " |",
             "|---|---|" + "---|" * len(methods)]
    for batch, rep in sorted(reports.items()):
        rows = {r["label"]: r for r in rep["comparison"]["rows"]}
        plain = rows[rep["comparison"]["reference"]]["decode_tokens_per_s"]["median"]
        cells = [f"{rows[m]['speedup']['median']:.2f} ({rows[m]['speedup']['min']:.2f}-{rows[m]['speedup']['max']:.2f})"
                 + _fell_back(rep, m) for m in methods]
        lines.append(f"| {batch} | {plain:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fell_back(report: dict, method: str) -> str:
    """" (ran on the backbone)" when every call of ``method`` ran in another mode than its own
    (lossless mode falls back to the backbone for what it cannot draft, e.g. a streamer in a batch)."""
    modes = {row.get("mode") for row in report.get("per_prompt_stats", {}).get(method, [])}
    own = {"river": "route", "exit": "exit", "lossless": "lossless"}.get(method)
    return " (ran on the backbone)" if own and modes and own not in modes else ""


def other_results(folder: Path, done: set[Path]) -> list[str]:
    """A section for the folder's other results (another benchmark, model or prompt set): each JSON
    with the command it records, and the Markdown table written next to it where there is one."""
    lines = []
    for path in sorted(folder.glob("*.json")):
        if path in done:
            continue
        command = json.loads(path.read_text()).get("command")
        table = path.with_suffix(".md").read_text().strip() if path.with_suffix(".md").is_file() else ""
        shown = f"`{command}`" if command else "(no command recorded)"
        lines += [f"### {path.name}", ""] + ([] if command and table.startswith(shown) else [shown, ""])
        if table:  # a heldout_speed table opens with its own command line
            lines += [table, ""]
    return ["## Other results in this folder", "", *lines] if lines else []


def render(args, folder: Path) -> None:
    reports = {}
    for batch in args.batches:
        path = result_path(folder, args.model, batch)
        if not path.is_file():
            raise SystemExit(f"report: {path} is missing: run without --render-only first")
        reports[batch] = json.loads(path.read_text())
    rel = os.path.relpath(folder, ROOT)
    index = [f"# Results on {args.machine_label}", "", f"Written by `{args.command}` (do not edit by hand: rerun it).",
             ""]
    for batch, rep in sorted(reports.items()):
        md = result_path(folder, args.model, batch).with_suffix(".md")
        index += [f"## Batch {batch}", "", md.read_text().strip(), ""]
    if len(reports) > 1:
        index += ["## Decode speedup by batch size", "", batch_table(reports), ""]
    index += other_results(folder, {result_path(folder, args.model, b) for b in reports})
    (folder / "README.md").write_text("\n".join(index))
    if 1 in reports and args.readme:
        block = headline(reports[1], args.machine_label, f"{rel}/README.md")
        if len(reports) > 1:
            block += "\n\nThe same prompts in left-padded batches (each row exactly as many tokens; speedup over the " \
                     "plain model at the same batch size):\n\n" + batch_table(reports)
        readme = Path(args.readme)
        text = readme.read_text()
        if START not in text or END not in text:
            raise SystemExit(f"report: {readme} has no {START} ... {END} block")
        text = re.sub(re.escape(START) + ".*?" + re.escape(END), lambda _: f"{START}\n{block}\n{END}", text,
                      flags=re.S)
        readme.write_text(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--machine-label", required=True, help="a short name for this machine (folder name)")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--methods", default="unmodified,unmodified-onednn,unmodified-river-fp32,river,exit,lossless,llama.cpp")
    ap.add_argument("--prompts", default="humaneval:100-107", help="held-out prompts (no default was tuned on them)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", default="1,4,8", help="comma list of batch sizes (default: %(default)s; '' with "
                                                       "--render-only: none, the folder's other results only)")
    ap.add_argument("--readme", default=str(ROOT / "README.md"), help="README whose headline block is rewritten ('' : none)")
    ap.add_argument("--render-only", action="store_true", help="rebuild the Markdown from the JSON already written")
    args = ap.parse_args(argv)
    args.command = "python benchmarks/report.py " + shlex.join(sys.argv[1:] if argv is None else argv)  # as called
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", args.machine_label):
        ap.error("--machine-label: letters, digits, '.', '_' and '-' only")
    try:
        args.batches = sorted({int(b) for b in args.batches.split(",") if b.strip()})
    except ValueError:
        ap.error(f"--batches: a comma list of integers, got {args.batches!r}")
    if args.batches and args.batches[0] < 1:
        ap.error("--batches: sizes must be >= 1")
    if not args.batches and not args.render_only:
        ap.error("--batches: at least one batch size to run (none only with --render-only)")
    folder = ROOT / "docs" / "results" / args.machine_label
    folder.mkdir(parents=True, exist_ok=True)
    if not args.render_only:
        run(args, folder)
    render(args, folder)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
