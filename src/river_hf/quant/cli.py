"""``river-hf kernels``: see and re-measure the cached kernel timings (``kernels.json``).

``river-hf kernels`` (or ``--list``) prints one row per cached entry: shape, dtype, bias, the
kernel chosen, every candidate's µs per one-token call (per multi-row call for the dense modes of
lossless mode's verify and dLLM-Cache's partial steps, shown with their row count), when it was measured, the load average
then, and whether the next build trusts it (:mod:`.autotune` says when it does not).
``--remeasure`` drops every entry (the next build with ``int4``/``int8`` exit layers measures
again); ``--remeasure 896x4864 4864x896`` measures the cached entries of those shapes for this
machine again now and drops those shapes' entries of other machines. ``--file`` reads another
file than ``$RIVER_HF_CACHE/kernels.json``. Bad input (a shape that is not ``INxOUT``, one with
no entry for this machine) is one ``river-hf: error: ...`` line, exit status 2.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from ..errors import RiverError

_SHAPE = re.compile(r"^(\d+)x(\d+)$")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "kernels",
        help="list or re-measure the cached kernel timings (kernels.json)",
        description="Show the kernel timings cached for the int4/int8 exit-layer choices and the dense modes of "
        "multi-row calls (lossless verify, dLLM-Cache partial steps), or measure them again. "
        "The cache is $RIVER_HF_CACHE/kernels.json (default ~/.cache/river_hf/kernels.json).",
    )
    what = p.add_mutually_exclusive_group()
    what.add_argument("--list", action="store_true", help="list the cached entries (the default)")
    what.add_argument("--remeasure", nargs="*", metavar="SHAPE",
                      help="no SHAPE: drop every cached entry (the next build measures); SHAPE (INxOUT, e.g. "
                           "896x4864): measure this machine's entries of those shapes again now")
    p.add_argument("--file", help="the kernels.json to read (default: $RIVER_HF_CACHE/kernels.json)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=handler)


def parse_shapes(shapes: list[str]) -> list[str]:
    """``INxOUT`` strings, normalized (``896X4864`` -> ``896x4864``).

    Raises:
        RiverError: a shape that is not two positive integers joined by ``x``.
    """
    out = []
    for s in shapes:
        m = _SHAPE.match(s.strip().lower())
        if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
            raise RiverError(f"shape {s!r} is not IN x OUT (e.g. 896x4864, as `river-hf kernels --list` shows it)")
        out.append(f"{int(m.group(1))}x{int(m.group(2))}")
    return out


def _path(args) -> Path:
    if args.file:
        return Path(args.file).expanduser()
    from ..files import cache_dir

    return cache_dir() / "kernels.json"


def handler(args) -> int:
    path = _path(args)
    if args.file:  # a file the user named must be there and be a kernels.json (the default may be absent)
        from .autotune import read_cache

        if path.is_dir():
            raise RiverError(f"--file {path}: a folder, not a file (name the kernels.json inside it, e.g. "
                             f"--file {path / 'kernels.json'})")
        if not path.is_file():
            raise RiverError(f"--file {path}: no such file (leave --file out for this machine's cache)")
        if read_cache(path)[2] is None:
            raise RiverError(f"--file {path}: not a kernels.json (river-hf's kernel timing cache)")
    if args.remeasure is None:
        return list_cache(path, as_json=args.json)
    if not args.remeasure:
        return drop_all(path, as_json=args.json)
    return remeasure(path, parse_shapes(args.remeasure), as_json=args.json)


def _rows(entries: dict) -> list[dict]:
    from .autotune import entry_status, is_loaded, machine_id

    here = machine_id("cpu")
    rows = []
    for key, e in sorted(entries.items(), key=lambda kv: (kv[1]["shape"], kv[1]["bias"], kv[1]["machine"])):
        status = ("another machine, thread count or device" if e["machine"] != here else entry_status(e)
                  or (f"invalid timings ({e['invalid']}): the prior ranking for {e.get('prior', '?')} decides; "
                      "measured again on a quiet machine" if "invalid" in e else None)
                  or ("measured under load: measured again at the first build on a quiet machine"
                      if is_loaded(e["load_avg_1m"], e["cpus"]) else "ok"))
        rows.append({"key": key, "shape": e["shape"], "rows": e.get("rows", 1), "dtype": e["dtype"], "bias": e["bias"],
                     "kernel": e["kernel"] if "invalid" in e and e.get("kernel") in e["timings_us"]
                     else min(e["timings_us"], key=e["timings_us"].get),
                     "timings_us": e["timings_us"], "measured_at": e["measured_at"], "load_avg_1m": e["load_avg_1m"],
                     "cpus": e["cpus"], "machine": e["machine"], "river_hf_version": e["river_hf_version"],
                     "status": status})
    return rows


def list_cache(path: Path, *, as_json: bool = False) -> int:
    """Print the cache at ``path`` (table or JSON); returns 0."""
    from .autotune import FORMAT_VERSION, read_cache

    entries, invalid, fmt = read_cache(path)
    rows = _rows(entries)
    if as_json:
        print(json.dumps({"file": str(path), "format": fmt, "entries": rows, "invalid": invalid}, indent=2))
        return 0
    if fmt is None:
        print(f"{path}: no kernel timings cached" + (" (not a kernels.json: it is measured again)"
                                                     if path.exists() else "")
              + "; the next build with int4/int8 exit layers measures each shape")
        return 0
    if fmt > FORMAT_VERSION:
        print(f"{path}: format {fmt}, newer than this river-hf reads ({FORMAT_VERSION}); left as it is")
        return 0
    print(f"{path}: {len(rows)} entr{'y' if len(rows) == 1 else 'ies'}"
          + (f", {len(invalid)} invalid (dropped and measured again at their next use)" if invalid else ""))
    width = max([len(r["shape"]) for r in rows] + [5])
    if rows:
        print(f"  {'shape':>{width}} {'rows':>4} {'dtype':<8} {'bias':<7}    {'kernel':<14} "
              f"[every candidate, us per call]  measured, load  (status)")
    for r in rows:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(r["measured_at"]))
        load = "load ?" if r["load_avg_1m"] is None else f"load {r['load_avg_1m']:.2f}/{r['cpus']} cores"
        times = ", ".join(f"{k} {v:.1f}" for k, v in sorted(r["timings_us"].items(), key=lambda kv: kv[1]))
        print(f"  {r['shape']:>{width}} {r['rows']:>4} {r['dtype']:<8} {'bias' if r['bias'] else 'no bias':<7} -> "
              f"{r['kernel']:<14} [{times} us]  {when}, {load}  ({r['status']})")
    if any(r["rows"] > 1 for r in rows):
        print("  rows 1: an exit Linear's int4/int8 kernel (one-token decode calls); rows > 1: the fp32 mode of "
              "lossless mode's verify and prompt passes and dLLM-Cache's partial steps, or (int4/int8 kernels) an "
              "exit Linear's prompt kernel")
    for key, why in sorted(invalid.items()):
        print(f"  invalid: {key}: {why}")
    return 0


def drop_all(path: Path, *, as_json: bool = False) -> int:
    """Remove every entry of the cache at ``path`` (under its lock); returns 0.

    Raises:
        RiverError: the file cannot be written.
    """
    from .autotune import read_cache, update_cache

    before, invalid, fmt = read_cache(path)
    if fmt is None and not path.exists():
        dropped = 0
    else:
        try:
            if update_cache(path, remove=lambda key, entry: True) is None:
                raise RiverError(f"{path} has a newer format ({fmt}) than this river-hf writes; "
                                 "delete it or use the newer river-hf")
        except OSError as e:
            raise RiverError(f"cannot rewrite {path} ({e}); check its folder's permissions") from None
        dropped = len(before) + len(invalid)
    if as_json:
        print(json.dumps({"file": str(path), "dropped": dropped}))
    else:
        print(f"{path}: dropped {dropped} cached kernel timing(s); the next build with int4/int8 exit layers "
              "measures each shape again")
    return 0


def remeasure(path: Path, shapes: list[str], *, as_json: bool = False) -> int:
    """Measure this machine's cached entries of ``shapes`` again now (their dtype, bias and
    candidates as cached), drop those shapes' entries of other machines, and drop (without
    measuring) an entry naming a kernel not available here any more (its library uninstalled):
    the next build measures that shape with the candidates it has. Returns 0.

    Raises:
        RiverError: a shape has no cached entry for this machine (nothing to measure it for).
    """
    from .autotune import KernelTuner, machine_id, read_cache, update_cache
    from .dense_river import measure_modes

    entries, _, _ = read_cache(path)
    here = machine_id("cpu")
    mine = {k: e for k, e in entries.items() if e["shape"] in shapes and e["machine"] == here}
    missing = [s for s in shapes if not any(e["shape"] == s for e in mine.values())]
    if missing:
        cached = sorted({e["shape"] for e in entries.values() if e["machine"] == here})
        raise RiverError(
            f"no cached timings for {', '.join(missing)} on this machine in {path} (cached here: "
            f"{', '.join(cached) or 'none'}); a build with int4/int8 exit layers measures the shapes it needs")
    tuner = KernelTuner(False)
    fresh, gone = {}, []
    for key, e in mine.items():
        entry = tuner.measure_again(e, measure_modes)
        if entry is None:  # a kernel not available here any more: a build measures the shape with what it has
            gone.append(key)
        else:
            fresh[key] = entry
    try:
        update_cache(path, fresh, remove=lambda key, entry: key in gone or (
            entry["shape"] in shapes and entry["machine"] != here))
    except OSError as e:
        raise RiverError(f"cannot rewrite {path} ({e}); check its folder's permissions") from None
    rows = _rows(fresh)
    if as_json:
        print(json.dumps({"file": str(path), "remeasured": rows}, indent=2))
    else:
        for r in rows:
            times = ", ".join(f"{k} {v:.1f}" for k, v in sorted(r["timings_us"].items(), key=lambda kv: kv[1]))
            suffix = "" if r["rows"] == 1 else f" x{r['rows']} rows"
            print(f"{r['shape']}{suffix} {r['dtype']} {'bias' if r['bias'] else 'no bias'}: {r['kernel']} [{times} us]")
    return 0
