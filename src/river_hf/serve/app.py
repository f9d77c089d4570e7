"""River inside ``transformers serve``: the same FastAPI app, handlers, SSE streaming, request
validation and uvicorn server (``transformers.cli.serving``), with four small subclasses that add
only what River needs:

- :class:`RiverModelManager` (a ``ModelManager`` pinned to one model): loads it with
  ``RiverForCausalLM.from_pretrained`` (model key, saved River folder or Hub id, with the River
  settings given on the command line) and its tokenizer, once, before the server starts; the model
  is served and listed by ``GET /v1/models`` under the name it was started with.
- :class:`RiverGenerateManager` (a ``GenerateManager``): transformers' one inference thread per
  model, so requests are run one at a time in arrival order (a FIFO queue); each job also reads
  that call's ``river_stats`` (kept per thread by River, read in the thread that generated) and,
  for a stream, releases the tokens the call really returned (:class:`RiverStreamer`).
- :class:`RiverChatCompletionHandler`, :class:`RiverCompletionHandler` (``/v1/chat/completions``,
  ``/v1/completions``): check the request first (:func:`check_request`: 422 with a message) and put
  the call's statistics under a ``river`` key of the JSON, or of the last chunk of a stream.

``/v1/responses`` and ``/v1/systemone`` are transformers' handlers unchanged (River generates,
no ``river`` key). Continuous batching is refused (:meth:`RiverForCausalLM.init_continuous_batching`).
Importing this module needs ``transformers[serving]`` (fastapi, uvicorn, openai, pydantic).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import json
import time

import torch
import uvicorn
from fastapi import HTTPException
from fastapi.responses import JSONResponse, StreamingResponse
from transformers.cli.serving.chat_completion import ChatCompletionHandler
from transformers.cli.serving.completion import CompletionHandler
from transformers.cli.serving.model_manager import ModelManager
from transformers.cli.serving.response import ResponseHandler
from transformers.cli.serving.server import build_server
from transformers.cli.serving.systemone import SystemOneHandler
from transformers.cli.serving.transcription import TranscriptionHandler
from transformers.cli.serving.utils import (DirectStreamer, GenerateManager, GenerationState, _GenerationCancelled,
                                            _StreamError)

from ..river.cli_common import check_model
from ..river.layer import LOSSLESS
from ..river.modeling import RiverForCausalLM

__all__ = ["RiverModelManager", "RiverGenerateManager", "RiverGenerationState", "RiverStreamer",
           "RiverChatCompletionHandler", "RiverCompletionHandler", "check_request", "response_stats", "build_app",
           "ReadyServer"]

#: The request being handled (set by the River handlers, read by :class:`RiverGenerateManager`).
_CALL: contextvars.ContextVar = contextvars.ContextVar("river_serve_call", default=None)


@dataclasses.dataclass
class _Call:
    """One request: when the handler received it (``time.perf_counter()`` s) and, once its
    ``generate`` returned, its statistics (:func:`response_stats`)."""

    received: float
    stats: dict | None = None


def response_stats(stats: dict, queued_seconds: float) -> dict:
    """The ``river`` key of a completion: the parts of ``model.river_stats`` (see
    :func:`river_hf.river.stats.summarize`) that describe one served call.

    Returns ``mode`` (``route`` or ``lossless``), ``strategy``, ``num_layers``, ``new_tokens``,
    ``seconds`` (the generate call, s), ``prefill_seconds`` (its TTFT, s), ``decode_tokens_per_s``
    and ``tokens_per_s`` (tokens/s), ``queued_seconds`` (s the request waited for the inference
    thread), and in route mode ``mean_exit_layer`` (0..L; L: no exit) and ``exit_fraction``, in
    lossless mode ``acceptance_rate``, ``tokens_per_verify`` and ``mean_draft_exit_layer``. A
    figure that could not be measured (a call of one token has no decode phase) is None.
    """
    out = {k: stats.get(k) for k in ("mode", "strategy", "num_layers", "new_tokens", "seconds", "prefill_seconds",
                                     "decode_tokens_per_s", "tokens_per_s")}
    lossless = stats.get("lossless")
    if lossless is not None:
        out.update({k: lossless.get(k) for k in ("acceptance_rate", "tokens_per_verify", "mean_draft_exit_layer")})
    else:
        out.update({k: stats.get(k) for k in ("mean_exit_layer", "exit_fraction")})
    out["queued_seconds"] = max(queued_seconds, 0.0)
    return out


def _generate(model, kwargs: dict, call: _Call | None):
    """One ``model.generate(**kwargs)`` on the inference thread; the call's statistics go to ``call``.
    ``river_stats`` is per thread, and this thread runs one call at a time, so it is this call's."""
    start = time.perf_counter()
    sequences = model.generate(**kwargs)
    if call is not None:
        call.stats = response_stats(dict(model.river_stats), start - call.received)
    return sequences


class RiverStreamer(DirectStreamer):
    """transformers' ``DirectStreamer`` (tokens decoded incrementally onto the SSE queue), with
    what a River call needs:

    - a put of several tokens (``[1, n]``: a lossless round, accepted drafts and the bonus token) is
      streamed token by token (``DirectStreamer`` takes one-token puts only);
    - with ``hold_rounds`` (lossless mode) each round is held until the next one arrives, and the
      last is cut to the length ``generate`` returned: River ends a call at the first stop inside a
      round (:class:`~river_hf.river.lossless.FirstStop`), and the stream then has exactly the
      tokens of the JSON answer (one round later, a few ms);
    - the end of the stream (the ``None`` sentinel) is sent by :meth:`finish` after ``generate``
      returned and its statistics were recorded, not by ``end`` inside ``generate``.
    """

    def __init__(self, *args, hold_rounds: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self._hold = hold_rounds
        self._pending: list[int] = []

    def put(self, value: torch.Tensor) -> None:
        if self._cancelled.is_set():
            raise _GenerationCancelled()
        if self._first:  # the prompt
            return super().put(value)
        ids = value.reshape(-1).tolist()
        if self._hold:
            ids, self._pending = self._pending, ids
        self._emit(ids)

    def _emit(self, ids: list[int]) -> None:
        if ids:
            super().put(torch.tensor(ids))

    def end(self) -> None:
        """Called inside ``generate``: nothing yet (see :meth:`finish`)."""

    def finish(self, new_tokens: int) -> None:
        """Release the held tokens up to ``new_tokens`` in all (the answer's length), flush the
        response parser and end the stream."""
        self._emit(self._pending[: max(new_tokens - self.total_tokens, 0)])
        self._pending = []
        super().end()

    def close(self) -> None:
        """End the stream without flushing (a cancelled call: the client has gone)."""
        self._enqueue(None)


class RiverGenerateManager(GenerateManager):
    """transformers' sequential ``GenerateManager`` (one inference thread per model, jobs run in
    arrival order), whose jobs record the call's statistics and stream with :class:`RiverStreamer`."""

    def generate_streaming(self, model, processor, inputs, gen_config, request_id, response_parser=None):
        call = _CALL.get()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        rust_tokenizer = getattr(processor, "tokenizer", processor)._tokenizer
        streamer = RiverStreamer(rust_tokenizer, loop, queue, response_parser=response_parser,
                                 hold_rounds=model.river.mode == LOSSLESS)
        kwargs = {**inputs, "streamer": streamer, "generation_config": gen_config, "tokenizer": processor}
        prompt_tokens = inputs["input_ids"].shape[-1]

        def run() -> None:
            try:
                sequences = _generate(model, kwargs, call)
            except _GenerationCancelled:
                streamer.close()
                return
            except Exception as e:  # noqa: BLE001 - reported in the stream, as transformers does
                loop.call_soon_threadsafe(queue.put_nowait, _StreamError(str(e)))
                return
            streamer.finish(sequences.shape[-1] - prompt_tokens)

        self.submit(run)
        return queue, streamer

    async def generate_non_streaming(self, model, processor, inputs, gen_config, request_id):
        kwargs = {**inputs, "generation_config": gen_config, "tokenizer": processor}
        sequences = await self.async_submit(_generate, model, kwargs, _CALL.get())
        input_len = inputs["input_ids"].shape[-1]
        generated_ids = sequences[0, input_len:]
        return processor.decode(generated_ids, skip_special_tokens=True), input_len, generated_ids


class RiverGenerationState(GenerationState):
    """transformers' ``GenerationState`` without continuous batching, handing out
    :class:`RiverGenerateManager`\\ s."""

    def __init__(self):
        super().__init__(continuous_batching=False)

    def get_manager(self, model_id: str, use_cb: bool = False) -> GenerateManager:
        if model_id not in self._generate_managers:
            self._generate_managers[model_id] = RiverGenerateManager()
        return self._generate_managers[model_id]


class RiverModelManager(ModelManager):
    """A ``ModelManager`` pinned to ``model`` (never unloaded), loaded through River.

    Args:
        model: model key, saved River folder or Hub id; also the name requests must use (or omit).
        river_kwargs: ``RiverForCausalLM.from_pretrained`` settings (``tau``, ``lossless``, ...).
        draft_tokens: lossless mode's first-round draft length (None: the model's setting).
        device: ``"cpu"`` or ``"cuda"`` (``"cuda:N"``). dtype: a torch dtype name (``"float32"``).
        progress: progress bars while the exit layers are built.

    Raises:
        RiverError: the model cannot be loaded (see :func:`river_hf.river.cli_common.check_model`
            and ``RiverForCausalLM.from_pretrained``), before the server starts.
    """

    def __init__(self, model: str, *, river_kwargs: dict, draft_tokens: int | None = None, device: str = "cpu",
                 dtype: str = "float32", progress: bool = True):
        self._river_kwargs, self._draft_tokens, self._progress = dict(river_kwargs), draft_tokens, progress
        self._checked = None
        super().__init__(device=device, dtype=dtype, force_model=model, model_timeout=-1)

    @staticmethod
    def process_model_name(model_id: str) -> str:
        """The name as given: a model key has no ``@revision`` (transformers would add ``@main``)."""
        return model_id

    def load_model_and_processor(self, model_id_and_revision: str, *args, **kwargs):
        if model_id_and_revision != self.force_model:  # POST /load_model of another model
            raise HTTPException(status_code=400, detail=f"this server serves {self.force_model!r} only, "
                                                        f"not {model_id_and_revision!r}")
        return super().load_model_and_processor(model_id_and_revision, *args, **kwargs)

    def _load_processor(self, model_id_and_revision: str, gguf_file: str | None = None):
        self._checked = check_model(model_id_and_revision, progress=self._progress)
        return self._checked[2]

    def _load_model(self, model_id_and_revision: str, tqdm_class=None, progress_callback=None, gguf_file=None):
        _, config, _ = self._checked
        model = RiverForCausalLM.from_pretrained(model_id_and_revision, config=config, dtype=self.dtype,
                                                 device_map=self.device, progress=self._progress,
                                                 **self._river_kwargs)
        if self._draft_tokens is not None:
            model.river_config = dataclasses.replace(model.river_config, draft_tokens=self._draft_tokens)
        return model

    @property
    def model(self) -> RiverForCausalLM:
        """The served River model."""
        return self.loaded_models[self.force_model].model

    @property
    def context_length(self) -> int | None:
        """The model's ``max_position_embeddings`` (tokens), or None when its config has none."""
        return getattr(self.model.config.get_text_config(decoder=True), "max_position_embeddings", None)


def check_request(body: dict, *, chat: bool, max_tokens_limit: int | None) -> None:
    """River's checks of a request body before transformers' handler sees it (which would answer
    some of these with a 500 or generate without end).

    Args:
        body: the parsed JSON body (FastAPI already answered 422 for malformed JSON or a non-object).
        chat: ``/v1/chat/completions`` (``messages``) rather than ``/v1/completions`` (``prompt``).
        max_tokens_limit: the largest ``max_tokens`` / ``max_completion_tokens`` accepted.

    Raises:
        HTTPException: 422 with a message: no ``messages`` (or not a non-empty list of objects with
            a string ``role`` and a string, list or null ``content``); a ``max_tokens`` that is not
            an integer in 1..``max_tokens_limit``.
    """
    def bad(message: str):
        raise HTTPException(status_code=422, detail=message)

    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            bad("`messages` is required: a non-empty list of {\"role\": ..., \"content\": ...} objects")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                bad(f"messages[{i}] must be an object with a string `role`")
            if not isinstance(m.get("content"), (str, list, type(None))):
                bad(f"messages[{i}].content must be a string or a list of content parts")
    for key in ("max_tokens", "max_completion_tokens") if chat else ("max_tokens",):
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            bad(f"`{key}` must be an integer, got {value!r}")
        if value < 1 or (max_tokens_limit is not None and value > max_tokens_limit):
            bad(f"`{key}` must be from 1 to {max_tokens_limit}, got {value}")


class _RiverHandler:
    """In front of a transformers handler: :func:`check_request`, then the handler, then the call's
    statistics under ``river`` (the JSON answer, or the last chunk of a stream)."""

    _chat = True

    def __init__(self, *args, max_tokens_limit: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_tokens_limit = max_tokens_limit

    async def handle_request(self, body: dict, request_id: str):
        check_request(body, chat=self._chat, max_tokens_limit=self.max_tokens_limit)
        call = _Call(time.perf_counter())
        token = _CALL.set(call)
        try:
            response = await super().handle_request(body, request_id)
        finally:
            _CALL.reset(token)
        if isinstance(response, StreamingResponse):
            response.body_iterator = _stats_in_last_chunk(response.body_iterator, call)
        elif isinstance(response, JSONResponse) and call.stats is not None:
            payload = json.loads(response.body)
            payload["river"] = call.stats
            response = JSONResponse(payload, status_code=response.status_code)
        return response


async def _stats_in_last_chunk(parts, call: _Call):
    """The SSE parts of ``parts``; the chunk with a ``finish_reason`` (the last) gets ``river``."""
    try:
        async for part in parts:
            if call.stats is not None and '"finish_reason"' in part:
                part = "".join(_with_stats(event, call.stats) for event in part.split("\n\n") if event)
            yield part
    finally:
        await parts.aclose()  # a client gone mid-stream: transformers' generator cancels the call


def _with_stats(event: str, stats: dict) -> str:
    prefix = "data: "
    if event.startswith(prefix) and '"finish_reason"' in event:
        chunk = json.loads(event[len(prefix):])
        chunk["river"] = stats
        event = prefix + json.dumps(chunk, separators=(",", ":"))
    return event if event.endswith("\n\n") else event + "\n\n"


class RiverChatCompletionHandler(_RiverHandler, ChatCompletionHandler):
    """``/v1/chat/completions``: transformers' handler, checked first, with a ``river`` key."""


class RiverCompletionHandler(_RiverHandler, CompletionHandler):
    """``/v1/completions``: transformers' handler, checked first, with a ``river`` key."""

    _chat = False


def build_app(manager: RiverModelManager, *, max_tokens_limit: int | None = None, enable_cors: bool = False):
    """transformers' FastAPI app (``build_server``) over ``manager``, with River's handlers for the
    two completion endpoints. ``max_tokens_limit`` None: the model's context length."""
    state = RiverGenerationState()
    limit = max_tokens_limit if max_tokens_limit is not None else manager.context_length
    return build_server(
        manager,
        RiverChatCompletionHandler(model_manager=manager, generation_state=state, max_tokens_limit=limit),
        completion_handler=RiverCompletionHandler(model_manager=manager, generation_state=state,
                                                  max_tokens_limit=limit),
        response_handler=ResponseHandler(model_manager=manager, generation_state=state),
        transcription_handler=TranscriptionHandler(manager, state),
        systemone_handler=SystemOneHandler(model_manager=manager, generation_state=state),
        generation_state=state,
        enable_cors=enable_cors,
    )


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
