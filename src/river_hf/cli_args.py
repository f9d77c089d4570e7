"""Command-line argument helpers shared by every ``river-hf`` subcommand: the River settings
(``add_river_arguments``, ``river_overrides``), counts and τ lists (``positive_int``,
``parse_taus``), the one line a negative ``--tau`` gets (``negative_tau_noted``), and output
paths checked before any model runs (``check_output_path``, ``check_writable_place``).

Imports only :mod:`river_hf.errors` (no torch), so ``river-hf --help`` stays fast.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import warnings
from pathlib import Path

from .errors import RiverError
from .files import gguf_file_problem

__all__ = ["positive_int", "KERNEL_CHOICES", "EXIT_LAYER_IMPLS", "add_river_arguments", "river_overrides", "parse_taus",
           "negative_tau_note", "negative_tau_noted", "check_output_path", "check_writable_place", "existing_report"]


def positive_int(text: str) -> int:
    """argparse ``type=`` for a count that must be >= 1 (raises ``argparse.ArgumentTypeError``)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


#: ``RiverConfig.exit_layer_impl`` values (river_hf.river.config.EXIT_LAYER_IMPLS), without importing torch.
EXIT_LAYER_IMPLS = ("architecture", "fused", "auto")
#: ``RiverConfig.backbone_kernel`` values (river_hf.river.config.VERIFY_KERNELS), without importing torch.
BACKBONE_KERNELS = ("auto", "onednn", "river-fp32", "torch")
#: kernel choices the CLI offers for --backend / --exit-head (river_hf.quant.BACKENDS), without importing torch.
KERNEL_CHOICES = ("int8", "int4", "int4-g32", "torch-int8", "torch-int4", "torch-int4-g32", "quanto-int8", "quanto-int4",
                  "ort-int4", "ort-int4-g32", "ort-int8", "torch-dyn-int8", "ark-int4", "ark-int8", "river-int4", "quanto",
                  "copy")


def add_river_arguments(p, *, min_layer: bool = True) -> None:
    """The River settings every model-loading subcommand takes (defaults: the model's configs/ file)."""
    if min_layer:
        p.add_argument("--min-layer", type=positive_int, default=None,
                       help="backbone layers always run before an exit is considered (default: per-model config)")
    p.add_argument("--backend", default=None, metavar="KERNEL",
                   help="exit-layer kernels: int8 / int4 (fastest of that width per shape, measured here), int4-g32 "
                        "(groups of 32: more accurate), or one of torch-int8, torch-int4, torch-int4-g32, quanto-int8, "
                        "quanto-int4, ort-int4, ort-int4-g32, ort-int8 (onnxruntime: only when named, it lost inside a decode "
                        "step), torch-dyn-int8, ark-int4, "
                        "ark-int8 (auto-round-lib), copy (default: per-model config)")
    p.add_argument("--exit-head", default=None, metavar="KERNEL",
                   help="quantized copy of the LM head for steps that left the backbone: int4, int8, a kernel name, "
                        "or none (default: per-model config)")
    p.add_argument("--prefill", default=None, choices=("route", "backbone"),
                   help="route: the prompt pass may exit (sequence-level); backbone: the prompt runs on the backbone "
                        "(default: per-model config)")
    p.add_argument("--exit-layer-impl", default=None, choices=EXIT_LAYER_IMPLS,
                   help="what the exit layers run: architecture (the architecture's decoder-layer code over the "
                        "quantized Linears), fused (River's fused layer where its family has one: Llama, Qwen2, "
                        "Mistral; warns otherwise) or auto (fused where supported, no warning where not); a layer whose fused "
                        "build check fails runs the architecture copy, with a warning (default: per-model config)")
    p.add_argument("--backbone-kernel", default=None, choices=BACKBONE_KERNELS,
                   help="fp32 CPU, route mode: the kernel of the backbone layers River runs (auto: the fastest "
                        "measured at one row of F.linear, river-fp32 and a packed oneDNN copy; onednn, river-fp32: "
                        "always; torch: never; τ > 1 never does) (default: auto)")
    p.add_argument("--backbone-grid", default=None, metavar="auto|off|GGUF",
                   help="fp32 CPU, a model converted from a GGUF file: the backbone's products of a few rows read "
                        "the GGUF's own grid (the same weights bit for bit, ~1.25 bytes a weight instead of 4): auto "
                        "(a registry model's own GGUF), off, or the GGUF file's path; a file that gives no grid warns and "
                        "the backbone reads its fp32 weights (default: auto)")


def river_overrides(args) -> dict:
    """``RiverForCausalLM.from_pretrained`` keyword arguments for the River options that were given.

    Raises:
        RiverError: an unknown kernel name (checked before any model loads).
    """
    for flag, value, allowed in (("--backend", getattr(args, "backend", None), KERNEL_CHOICES),
                                 ("--exit-head", getattr(args, "exit_head", None), KERNEL_CHOICES + ("none",))):
        if value is not None and value not in allowed:
            raise RiverError(f"unknown quantization backend {value!r} for {flag}: choose one of {', '.join(allowed)}")
    out = {}
    for name in ("min_layer", "backend", "prefill", "exit_layer_impl", "backbone_kernel", "backbone_grid"):
        value = getattr(args, name, None)
        if value is not None:
            out[name] = value
    grid = out.get("backbone_grid")
    problem = gguf_file_problem(grid) if grid is not None and grid not in ("auto", "off") else None
    if problem:
        raise RiverError(f"--backbone-grid {grid!r}: {problem} (give auto, off or the GGUF file the model was converted from)")
    head = getattr(args, "exit_head", None)
    if head is not None:
        out["exit_head"] = None if head == "none" else head
    return out


def check_lossless_flags(args) -> None:
    """The flags that only mean something with or without ``--lossless`` (``generate`` and ``serve``).

    Raises:
        RiverError: ``--draft-tokens`` or ``--draft-schedule`` without ``--lossless``; ``--prefill`` with it (lossless mode
            always reads the prompt with the backbone).
    """
    if getattr(args, "draft_tokens", None) is not None and not args.lossless:
        raise RiverError("--draft-tokens sets the lossless mode's draft length; add --lossless")
    if getattr(args, "draft_schedule", None) is not None and not args.lossless:
        raise RiverError("--draft-schedule sets how the lossless mode's draft length adapts; add --lossless")
    if args.lossless and getattr(args, "prefill", None) is not None:
        raise RiverError("--prefill chooses where River's lossy mode reads the prompt; lossless mode always reads it "
                         "with the backbone (its tokens are the unmodified model's): drop --prefill or --lossless")


def with_draft_flags(river_config, draft_tokens: int | None = None, draft_schedule: str | None = None):
    """``river_config`` (a :class:`~river_hf.RiverConfig`) with ``--draft-tokens`` and
    ``--draft-schedule`` put in (None: the model's own setting), checked in the flags' words.

    Raises:
        RiverError: ``--draft-tokens`` above the config's ``max_draft_tokens`` (the most drafts one
            round may propose; the verify kernel is chosen for up to that many rows plus one).
    """
    import dataclasses

    changes = {}
    if draft_tokens is not None:
        cap = river_config.max_draft_tokens
        if draft_tokens > cap:
            raise RiverError(f"--draft-tokens {draft_tokens} is more than this model's max_draft_tokens ({cap}), the most "
                             f"drafts one round may propose: use at most {cap}")
        changes["draft_tokens"] = draft_tokens
    if draft_schedule is not None:
        changes["draft_schedule"] = draft_schedule
    return dataclasses.replace(river_config, **changes) if changes else river_config


def parse_taus(values) -> list[float]:
    """τ values from CLI strings: each may be one number or a comma list (``["2", "0.95,0.9"]``).

    Returns the numbers in order, duplicates removed. Raises RiverError for a non-number.
    """
    taus: list[float] = []
    for value in values or []:
        for part in str(value).split(","):
            part = part.strip()
            if not part:
                continue
            try:
                tau = float(part)
            except ValueError:
                raise RiverError(f"tau must be a number (e.g. 0.95; above 1 never exits), got {part!r}") from None
            if tau != tau:
                raise RiverError("tau must be a number, got NaN")
            if tau not in taus:
                taus.append(tau)
    return taus


#: The start of the library's negative-τ warning (``river.config.warn_if_negative_tau``), as a
#: ``warnings.filterwarnings`` pattern: where the CLI prints :func:`negative_tau_note`, it drops that one.
NEGATIVE_TAU_WARNING = r"tau=\S+ is negative"


def negative_tau_note(tau: float | None, *, lossless: bool = False) -> str | None:
    """The one stderr line for a negative ``--tau`` (None for any other τ). The state transition
    similarity is a cosine in [-1, 1] and a backbone layer exits when it exceeds τ (River-LLM,
    Sec. 3.2), so below 0 (nearly) every pass exits at the first layer ``--min-layer`` allows:
    in route mode every token runs on the exit path (about the fully quantized model's speed,
    approximate tokens); in lossless mode only the drafts do (the answer stays the unmodified
    model's)."""
    if tau is None or not tau < 0:
        return None
    every = "every" if tau < -1 else "(nearly) every"
    if lossless:
        what = (f"{every} draft leaves the backbone at the first layer --min-layer allows: the drafts come from the "
                "exit path, the answer is still the unmodified model's tokens; use τ in (0, 1) to exit only where "
                "the backbone layers change the hidden state little")
    else:
        what = (f"{every} decode step leaves the backbone at the first layer --min-layer allows: the model runs each "
                "token on the exit path (about the fully quantized model's speed, approximate tokens); use τ in "
                "(0, 1) for early exit, above 1 for the unmodified model")
    return f"river-hf: warning: --tau {tau:g} is negative, so {what}"


@contextlib.contextmanager
def negative_tau_noted(tau: float | None, *, lossless: bool = False):
    """Print :func:`negative_tau_note` on stderr (when τ is negative) and, within the block (the
    model's load), drop the library's own warning about that τ, so the user reads one line."""
    note = negative_tau_note(tau, lossless=lossless)
    if note is None:
        yield
        return
    print(note, file=sys.stderr, flush=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=NEGATIVE_TAU_WARNING, category=UserWarning)
        yield


def check_output_path(path: str | os.PathLike, flag: str = "--out", suffix: str = ".json") -> Path:
    """Check, before any model runs, that a report can be written at ``path``: it ends with
    ``suffix``, is not a folder, and its folder (or the nearest existing ancestor, for folders that
    will be created) accepts a new file (tried with a temporary file, removed at once).

    Returns:
        ``path`` as a ``Path``.

    Raises:
        RiverError: naming ``flag`` and what to change.
    """
    path = Path(path)
    if path.is_dir():
        raise RiverError(f"{flag} {str(path)!r} is a folder; give a file path such as {str(path / ('report' + suffix))!r}")
    if path.suffix != suffix:
        raise RiverError(f"{flag} must name a {suffix} file, got {str(path)!r}")
    check_writable_place(path, flag)
    return path


def check_writable_place(path: str | os.PathLike, flag: str) -> None:
    """Check that a file or folder can be created at ``path``: its folder, or the nearest existing
    ancestor (missing folders are created on write), accepts a new entry (tried with a temporary
    file, removed at once).

    Raises:
        RiverError: naming ``flag``; the place is a file or not writable.
    """
    folder = Path(path).absolute().parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise RiverError(f"{flag} {str(path)!r}: {str(folder)!r} is a file, not a folder")
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".river-hf-write-check-")
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise RiverError(f"{flag} {str(path)!r}: cannot write in {str(folder)!r} ({e.strerror}); choose another path") from None


def existing_report(path: str | os.PathLike, key: str, what: str) -> dict:
    """The JSON report a ``--plot-only`` run redraws from: the file at ``--out`` ``path``, which
    must exist, parse and hold ``key`` (``what`` names the report in the error, e.g. "bench").

    Raises:
        RiverError: the report is missing, not JSON or lacks ``key``.
    """
    import json

    try:
        report = json.loads(Path(path).read_text())
        report[key]
    except (OSError, ValueError, KeyError) as e:
        raise RiverError(f"--plot-only needs an existing {what} report at --out {path} ({type(e).__name__})") from None
    return report
