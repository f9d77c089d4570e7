"""The dLLM-Cache settings ``benchmarks/diffusion_bench.py`` compares (``Kp,Kr,rho[,kernel]``), their
names, and its one-line verdict per run."""

from __future__ import annotations

from ..diffusion.cli import SMALL_BATCH_LINEAR

__all__ = ["parse_settings", "setting_name", "report_line"]


def parse_settings(text: str, kernel: str = "auto") -> list[tuple[int, int, float, str]]:
    """``"Kp,Kr,rho[,auto|on|off];..."`` -> ``[(Kp, Kr, rho, small_batch_linear), ...]``; a setting
    without the fourth field takes ``kernel`` (``--small-batch-linear``).

    Raises:
        SystemExit: a malformed setting (the message says which; the script's argument error)."""
    out = []
    for part in text.split(";"):
        fields = part.split(",")
        kp, kr, rho = fields[:3]
        sbl = fields[3] if len(fields) > 3 else kernel
        if sbl not in SMALL_BATCH_LINEAR or len(fields) > 4:
            raise SystemExit(f"bad setting {part!r}: use Kp,Kr,rho or Kp,Kr,rho,auto|on|off")
        out.append((int(kp), int(kr), float(rho), sbl))
    return out


def setting_name(s: tuple | None, kernel: str = "auto") -> str:
    """A setting's name in the report (``Kp=50,Kr=7,rho=0.25``, its kernel named when it is not
    ``kernel``); None is the uncached run."""
    if s is None:
        return "uncached"
    return f"Kp={s[0]},Kr={s[1]},rho={s[2]}" + ("" if s[3] == kernel else f",small-batch {s[3]}")


def report_line(r: dict, target: float) -> str:
    """One run's line of the printed summary: seconds, and for a cached setting its speedup, FLOPs
    ratios and verdicts (``r``: a row of the benchmark's JSON ``runs``; ``target``: ``--target``)."""
    s = r["seconds"]
    line = f"{r['name']}: {s['median']:.4g} s median [{s['min']:.4g}-{s['max']:.4g}] over {r['repeats']} rounds"
    if r["name"] == "uncached":
        return line
    lo, hi = r["speedup_range"]

    def word(v):
        return "not resolved (spreads overlap)" if v == "not resolved" else v

    return (f"{line}, speedup {r['speedup']:.2f}x [{lo:.2f}-{hi:.2f}], whole-model FLOPs ratio "
            f"{r['model_flops_ratio']:.2f}x (overhead share {r['model_overhead_share']:.2f}), layer-FLOPs ratio "
            f"{r['flops_ratio']:.2f}x (overhead share {r['overhead_share']:.2f}); faster than uncached: "
            f"{word(r['faster_than_uncached'])}; >= {target:g}x: {word(r['meets_target'])}; >= share of whole-model "
            f"FLOPs ratio: {word(r['meets_model_flops_share'])}; >= share of layer-FLOPs ratio: "
            f"{word(r['meets_flops_share'])}")
