"""``river-hf`` command line: one subcommand per job, each registered by the module that owns it.

A module ``river_hf.<name>.cli`` (or ``river_hf.<name>_cli``) exposes ``register(subparsers)``,
which adds its subcommand(s) with ``set_defaults(func=handler)``; ``handler(args)`` returns an
exit status. Heavy imports (torch, transformers) happen inside handlers, so ``--help`` is fast.

A :class:`~river_hf.errors.RiverError` (bad input, missing prerequisite) prints one
``river-hf: error: ...`` line and exits with status 2; a failed write to standard output (a full
disk, ``> /dev/full``) one such line and status 1 (a closed pipe, ``| head``: quietly, status 0);
nothing else is caught.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import os
import sys
import warnings

from .errors import RiverError

#: Modules that may register subcommands, in help order (missing ones are skipped).
COMMAND_MODULES = (
    "river_hf.river.cli",
    "river_hf.eval.cli",
    "river_hf.eval.calibrate",
    "river_hf.bench",
    "river_hf.pareto",
    "river_hf.stitch.cli",
    "river_hf.diffusion.cli",
    "river_hf.quant.cli",
    "river_hf.serve.cli",
)


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (``river-hf generate: error: ...``), exit status 2,
    as for every other bad input; ``--help`` still shows the full usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from ._version import __version__

    parser = OneLineParser(
        prog="river-hf",
        description="Training-free faster decoding for Hugging Face models: River-LLM, R-Stitch, dLLM-Cache.",
    )
    parser.add_argument("--version", action="version", version=f"river-hf {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=OneLineParser)
    for name in COMMAND_MODULES:
        if importlib.util.find_spec(name) is not None:
            importlib.import_module(name).register(sub)
    return parser


class _StdoutGuard:
    """``sys.stdout`` while a command runs: the stream itself, except that an ``OSError`` raised by
    writing or flushing it is marked (``river_stdout = True``) before it propagates, so
    :func:`main` can tell a failed write of the output (``> /dev/full``, a full disk, a closed
    pipe) from any other ``OSError``."""

    def __init__(self, stream):
        self._stream = stream

    def _marked(self, method, *args):
        try:
            return method(*args)
        except OSError as e:
            e.river_stdout = True
            raise

    def write(self, text):
        return self._marked(self._stream.write, text)

    def writelines(self, lines):
        return self._marked(self._stream.writelines, lines)

    def flush(self):
        return self._marked(self._stream.flush)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _detach_stdout(stream) -> None:
    """Point file descriptor 1 at /dev/null, so the output still buffered in ``stream`` does not
    fail a second time (with a traceback) when the interpreter flushes it at exit."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
    except (OSError, ValueError, AttributeError):  # not a real file (a test's capture): nothing to do
        pass


@contextlib.contextmanager
def _quiet_progress():
    """``--no-progress`` of any subcommand: transformers' own bars too ("Loading weights", and the
    Hub's download bars, which ``disable_progress_bar`` also turns off), restored afterwards."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; returns its exit status (0 done; 2 bad input, one ``river-hf: error:``
    line; 1 the output could not be written to standard output, one such line; 130 interrupted)."""
    parser = build_parser()
    args = parser.parse_args(argv)  # argparse itself ignores a failed write of --help / --version
    old_format, warnings.formatwarning = warnings.formatwarning, _one_line_warning  # not file:line + source
    stdout = sys.stdout
    sys.stdout = _StdoutGuard(stdout)
    quiet = _quiet_progress() if getattr(args, "no_progress", False) else contextlib.nullcontext()
    try:
        with quiet:
            status = int(args.func(args) or 0)
        sys.stdout.flush()  # output still buffered fails here, not in the interpreter's exit
        return status
    except RiverError as e:
        print(f"river-hf: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("river-hf: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader (e.g. `river-hf kernels --list | head`) closed the pipe: stop quietly
        _detach_stdout(stdout)
        return 0
    except OSError as e:
        if not getattr(e, "river_stdout", False):
            raise
        _detach_stdout(stdout)
        print(f"river-hf: error: cannot write to standard output: {e.strerror or e}", file=sys.stderr)
        return 1
    finally:
        sys.stdout = stdout
        warnings.formatwarning = old_format


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    return f"river-hf: warning: {message}\n"


def generate_main() -> None:  # pragma: no cover - convenience
    """``river-hf generate`` as a command of its own (the arguments are those of ``generate``)."""
    sys.exit(main(["generate", *sys.argv[1:]]))


if __name__ == "__main__":
    sys.exit(main())
