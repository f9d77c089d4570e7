"""River's OpenAI-compatible HTTP server: a small FastAPI app over one River model, run by uvicorn.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (JSON, or server-sent events
with ``"stream": true``: ``data: {chunk}`` events, the last with ``finish_reason``, then
``data: [DONE]``), ``GET /v1/models``, ``GET /health``. Each completion carries its call's River
statistics under a ``river`` key (a stream: in its last chunk). Requests are checked on the event
loop (:mod:`.requests`: 422 / 404 with a ``detail``), then queued for the one inference thread
(:mod:`.scheduler`), which batches them or runs them one at a time.

Only transformers' public API is used (``apply_chat_template``, ``generate``, a
``BaseStreamer``), so the server runs unchanged across transformers versions.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid

import torch
import uvicorn
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..cli_args import with_draft_flags
from ..river.cli_common import check_model
from ..river.layer import LOSSLESS
from ..river.modeling import RiverForCausalLM
from .requests import AnswerText, check_request, prepare
from .scheduler import Job, Scheduler, response_stats

__all__ = ["load_model", "build_app", "check_request", "response_stats", "ReadyServer", "DEFAULT_MAX_BATCH_SIZE"]

#: Most requests one ``generate`` call batches by default (``--max-batch-size``).
DEFAULT_MAX_BATCH_SIZE = 8


def load_model(name: str, *, river_kwargs: dict, draft_tokens: int | None = None, draft_schedule: str | None = None,
               device: str = "cpu", dtype: str = "float32", progress: bool = True):
    """The served model and its tokenizer: :func:`~river_hf.river.cli_common.check_model`, then
    ``RiverForCausalLM.from_pretrained`` with the River settings.

    Args:
        name: model key, saved River folder or Hub id.
        river_kwargs: ``from_pretrained`` settings (``tau``, ``lossless``, ...).
        draft_tokens: lossless mode's first-round draft length (None: the model's setting).
        draft_schedule: lossless mode's draft schedule name (None: the model's setting).
        device: ``"cpu"`` or ``"cuda"`` (``"cuda:N"``). dtype: a torch dtype name (``"float32"``).
        progress: progress bars while the exit layers are built.

    Returns:
        ``(model, tokenizer)``, the model in eval mode.

    Raises:
        RiverError: the model cannot be loaded (see ``check_model`` and ``from_pretrained``), or
            ``draft_tokens`` is above its ``max_draft_tokens``.
    """
    path, config, tokenizer = check_model(name, progress=progress)
    model = RiverForCausalLM.from_pretrained(path, config=config, dtype=getattr(torch, dtype), device_map=device,
                                             progress=progress, **river_kwargs)
    model.river_config = with_draft_flags(model.river_config, draft_tokens, draft_schedule)
    return model.eval(), tokenizer


def context_length(model) -> int | None:
    """The model's ``max_position_embeddings`` (tokens), or None when its config has none."""
    return getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)


def build_app(model, tokenizer, name: str, *, max_tokens_limit: int | None = None, batching: bool = True,
              max_batch_size: int = DEFAULT_MAX_BATCH_SIZE) -> FastAPI:
    """The FastAPI app serving ``model`` as ``name``; its inference thread starts and stops with the
    app (lifespan).

    Args:
        model: a River model (route or lossless mode). tokenizer: its tokenizer.
        name: the model's name (``GET /v1/models``; a request naming another gets a 404).
        max_tokens_limit: the largest ``max_tokens`` accepted (None: the model's context length).
        batching: batch the requests (up to ``max_batch_size`` at once); False: FIFO. Route mode
            runs a running batch that requests join between decode steps; lossless mode batches
            the waiting requests into one call (River's batched lossless loop); see
            :mod:`~river_hf.serve.scheduler`.
        max_batch_size: most requests in flight at once (>= 1).

    ``app.state.scheduler`` is the :class:`~river_hf.serve.scheduler.Scheduler`.
    """
    lossless = model.river.mode == LOSSLESS
    scheduler = Scheduler(model, tokenizer, max_batch_size=max_batch_size if batching else 1, lossless=lossless)
    limit = max_tokens_limit if max_tokens_limit is not None else context_length(model)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        try:
            yield
        finally:
            await asyncio.to_thread(scheduler.stop)

    app = FastAPI(title="river-hf serve", lifespan=lifespan)
    app.state.scheduler = scheduler
    created = int(time.time())

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "river-hf",
                                            "status": {"value": "loaded"}}]}

    async def complete(request: Request, chat: bool):
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            raise HTTPException(status_code=422, detail="the body must be JSON (an object)") from None
        if not isinstance(body, dict):
            raise HTTPException(status_code=422, detail="the body must be a JSON object")
        settings = prepare(body, tokenizer, chat=chat, max_tokens_limit=limit, model_name=name,
                           generation_config=model.generation_config)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def deliver(event) -> None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits
                loop.call_soon_threadsafe(events.put_nowait, event)

        job = Job(settings, deliver)
        reply = _Reply(chat, name, tokenizer, settings)
        scheduler.submit(job)
        if settings.stream:
            return StreamingResponse(_stream(events, job, reply), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            kind, payload = await events.get()
            while kind == "tokens":
                kind, payload = await events.get()
        except asyncio.CancelledError:
            job.cancelled.set()
            raise
        if kind == "error":
            raise HTTPException(status_code=500, detail=payload)
        return JSONResponse(reply.final(payload))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)

    return app


class _Reply:
    """The OpenAI JSON of one request: chunks of a stream and the final answer."""

    def __init__(self, chat: bool, model: str, tokenizer, settings):
        self.chat, self.model = chat, model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.text = AnswerText(tokenizer, settings.stop)

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def chunk(self, text: str | None, *, role: bool = False, finish_reason: str | None = None) -> dict:
        """One stream chunk (``text`` None: an empty delta)."""
        if self.chat:
            delta = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return {**self._head("text_completion"), "choices": [choice]}

    def finish_reason(self, result) -> str:
        return "stop" if self.text.stopped else result.finish_reason

    @staticmethod
    def usage(result) -> dict:
        return {"prompt_tokens": result.prompt_tokens, "completion_tokens": len(result.ids),
                "total_tokens": result.prompt_tokens + len(result.ids)}

    def final(self, result) -> dict:
        """The JSON answer of a finished request."""
        text = self.text.text(result.ids)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": self.finish_reason(result)}
            head = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": self.finish_reason(result)}
            head = self._head("text_completion")
        return {**head, "choices": [choice], "usage": self.usage(result), "river": result.river}


def _sse(payload) -> str:
    return "data: " + (payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))) + "\n\n"


async def _stream(events: asyncio.Queue, job: Job, reply: _Reply):
    """The SSE events of one request: chunks as its tokens arrive, the last with ``finish_reason``,
    ``usage`` and ``river``, then ``data: [DONE]``. A client that leaves cancels its row."""
    try:
        if reply.chat:
            yield _sse(reply.chunk("", role=True))
        while True:
            kind, payload = await events.get()
            if kind == "tokens":
                text = reply.text.feed(payload)
                if text:
                    yield _sse(reply.chunk(text))
            elif kind == "error":
                yield _sse({"error": {"message": payload, "type": "server_error"}})
                break
            else:
                text = reply.text.finish(payload.ids)
                if text:
                    yield _sse(reply.chunk(text))
                last = reply.chunk(None, finish_reason=reply.finish_reason(payload))
                yield _sse({**last, "usage": reply.usage(payload), "river": payload.river})
                break
        yield _sse("[DONE]")
    finally:
        job.cancelled.set()  # no effect once the call has ended


class ReadyServer(uvicorn.Server):
    """uvicorn's server, calling ``on_ready(host, port)`` once it listens (``port``: the bound one,
    also for ``--port 0``)."""

    def __init__(self, config: uvicorn.Config, on_ready=None):
        super().__init__(config)
        self._on_ready = on_ready

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if self._on_ready is not None and self.started and self.servers:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            self._on_ready(host, port)
