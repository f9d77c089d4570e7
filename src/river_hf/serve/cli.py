"""``river-hf serve``: River's OpenAI-compatible HTTP server (FastAPI + uvicorn, :mod:`.app`) on a River model.

Arguments are checked before anything heavy is imported or loaded (a bad τ, a port in use, the
serving extras missing: one ``river-hf: error:`` line, exit 2); the model is loaded before the
server listens, and one ``river-hf serve: ready on http://HOST:PORT ...`` line on stdout says
when requests are answered (``--port 0``: a free port, named in that line).
"""

from __future__ import annotations

import argparse
import errno
import importlib.util
import math
import socket
import sys

from ..cli_args import (add_river_arguments, check_lossless_flags, negative_tau_noted, parse_taus, positive_int,
                        river_overrides)
from ..errors import RiverError
from ..river.draft_schedule import SCHEDULES

#: The packages the server needs (the ``serve`` extra).
SERVING_MODULES = ("fastapi", "uvicorn")

LOG_LEVELS = ("debug", "info", "warning", "error")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a River model over HTTP (OpenAI-compatible)",
        description="Serve one River model over an OpenAI-compatible HTTP API (/v1/chat/completions, "
                    "/v1/completions, /v1/models, /health; streaming over SSE). Each completion carries the "
                    "call's River statistics under a \"river\" key. Requests are batched (--batching, the "
                    "default): in route mode they join a running batch between decode steps and leave it when "
                    "finished; in lossless mode the waiting requests with the same sampling settings run as one "
                    "batch. --fifo serves one at a time in arrival order.",
    )
    p.add_argument("model", help="model key, saved River folder or Hub id; requests name it (or omit \"model\")")
    p.add_argument("--tau", default=None, help="state transition similarity threshold τ; > 1 never exits "
                                               "(default: the folder's or per-model config)")
    add_river_arguments(p)
    p.add_argument("--lossless", action="store_true",
                   help="lossless mode: the exit path drafts, the backbone verifies (the unmodified model's tokens)")
    p.add_argument("--draft-tokens", type=positive_int, default=None,
                   help="lossless mode: drafts of the first round (default: per-model config)")
    p.add_argument("--draft-schedule", choices=tuple(SCHEDULES), default=None,
                   help="lossless mode: how the draft length adapts from round to round (default: per-model config)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free port; default: %(default)s)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--max-tokens-limit", type=positive_int, default=None,
                   help="largest max_tokens a request may ask for (default: the model's context length)")
    batching = p.add_mutually_exclusive_group()
    batching.add_argument("--batching", dest="fifo", action="store_false", default=False,
                          help="batch the requests (default): in route mode they join the running batch between "
                               "decode steps and leave it when finished; in lossless mode the waiting ones run as "
                               "one batch")
    batching.add_argument("--continuous-batching", dest="fifo", action="store_false",
                          help="the same as --batching (River batches with its own scheduler)")
    batching.add_argument("--fifo", dest="fifo", action="store_true",
                          help="one request at a time, in arrival order")
    p.add_argument("--max-batch-size", type=positive_int, default=8,
                   help="most requests in flight at once (default: %(default)s)")
    p.add_argument("--log-level", default="warning", choices=LOG_LEVELS,
                   help="transformers' and uvicorn's log level (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars while the model loads")
    p.set_defaults(func=run_serve)


def check_args(args) -> dict:
    """``RiverForCausalLM.from_pretrained`` settings from the arguments, checked before any import of
    torch. Raises :class:`RiverError` (one line) for a bad τ, kernel, port or device,
    ``--draft-tokens`` without ``--lossless``, a port already in use on that host, or the serving
    extras not installed."""
    if not 0 <= args.port <= 65535:
        raise RiverError(f"--port must be from 0 to 65535, got {args.port}")
    check_lossless_flags(args)
    if args.device is not None and args.device != "cpu" and not args.device.startswith("cuda"):
        raise RiverError(f"--device must be cpu or cuda (cuda:N), got {args.device!r}")
    settings = river_overrides(args)
    if args.tau is not None:
        taus = parse_taus([args.tau])
        if len(taus) != 1 or math.isnan(taus[0]):
            raise RiverError(f"--tau must be one number such as 0.95 (above 1 never exits), got {args.tau!r}")
        settings["tau"] = taus[0]
    if args.lossless:
        settings["lossless"] = True
    missing = [m for m in SERVING_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise RiverError(f"river-hf serve needs fastapi and uvicorn ({', '.join(missing)} missing): "
                         "pip install \"river-hf[serve]\" (or run bash scripts/setup.sh)")
    _check_port_free(args.host, args.port)
    return settings


def _check_port_free(host: str, port: int) -> None:
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise RiverError(f"--host {host!r} is not an address this machine can listen on ({e})") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise RiverError(f"port {port} on {host} is in use; pass another --port (0: any free port)") from None
            raise RiverError(f"cannot listen on {host}:{port} ({e.strerror or e})") from None


def run_serve(args) -> int:
    settings = check_args(args)
    import torch
    import uvicorn
    from transformers.utils import logging as hf_logging

    from .app import ReadyServer, build_app, load_model

    if args.device is not None and args.device.startswith("cuda") and not torch.cuda.is_available():
        raise RiverError("--device cuda was asked for, but this torch build sees no CUDA GPU; use --device cpu")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    hf_logging.get_logger("transformers").setLevel(hf_logging.log_levels[args.log_level])
    if args.no_progress:
        hf_logging.disable_progress_bar()
    with negative_tau_noted(settings.get("tau"), lossless=args.lossless):
        model, tokenizer = load_model(args.model, river_kwargs=settings, draft_tokens=args.draft_tokens,
                                      draft_schedule=args.draft_schedule, device=device,
                                      dtype="float32" if device == "cpu" else "bfloat16", progress=not args.no_progress)
    mode = "lossless" if args.lossless else "route"
    app = build_app(model, tokenizer, args.model, max_tokens_limit=args.max_tokens_limit, batching=not args.fifo,
                    max_batch_size=args.max_batch_size)
    scheduler = app.state.scheduler
    queueing = {"fifo": "one request at a time",
                "step": f"a running batch of up to {scheduler.max_batch_size} joined between decode steps",
                "call": f"batches of up to {scheduler.max_batch_size} per call"}[scheduler.batching]

    def ready(host, port) -> None:
        print(f"river-hf serve: ready on http://{host}:{port} (model {args.model!r}, River {mode}, τ "
              f"{model.river_config.tau}, {model.river.num_layers} layers, {device}, {queueing}); Ctrl-C stops it",
              flush=True)

    server = ReadyServer(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level), on_ready=ready)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C / SIGINT after its graceful shutdown: a normal end
        print("river-hf serve: stopped", flush=True)
        return 0
    if not server.started:  # uvicorn could not bind (it logged why)
        print(f"river-hf: error: the server could not listen on {args.host}:{args.port}", file=sys.stderr)
        return 2
    return 0
