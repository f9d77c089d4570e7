"""Request checks of ``river-hf serve``: an OpenAI request body -> :class:`Settings` (the prompt's
token ids and the ``generate`` settings), or one HTTP error with a ``detail`` message; and the text
of an answer (:class:`AnswerText`: special tokens dropped, cut at a ``stop`` string).

Nothing here touches the model: :func:`prepare` needs only the tokenizer and the model's default
generation settings, so every check runs on the event loop before the request is queued.
"""

from __future__ import annotations

import dataclasses
import json
import math

from fastapi import HTTPException

__all__ = ["ROLES", "DEFAULT_MAX_TOKENS", "Settings", "check_request", "prepare", "AnswerText"]

#: Message roles a chat request may use.
ROLES = ("system", "user", "assistant", "tool", "developer")

#: ``max_tokens`` when a request gives none (capped by the server's limit), as ``transformers serve``.
DEFAULT_MAX_TOKENS = 1024

#: Most ``stop`` strings a request may give (OpenAI's limit).
MAX_STOPS = 4

#: Request fields River does not implement, with the value that means "off" (any other is refused).
UNSUPPORTED = {
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False), "suffix": (None, ""),
    "best_of": (None, 1), "frequency_penalty": (None, 0, 0.0), "presence_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}), "tools": (None, []), "functions": (None, []), "tool_choice": (None, "none", "auto"),
}


#: The fields of :data:`UNSUPPORTED` that OpenAI's API types as numbers (a boolean there is refused,
#: though ``false == 0`` in Python).
NUMERIC_UNSUPPORTED = ("top_logprobs", "best_of", "frequency_penalty", "presence_penalty")


@dataclasses.dataclass(frozen=True)
class Settings:
    """One checked request.

    Attributes:
        prompt_ids: the prompt's token ids (chat: the chat template with the generation prompt).
        max_tokens: new tokens at most (1..limit).
        do_sample: sample (True) or greedy. temperature, top_p: the sampling settings (None when greedy).
        stop: strings that end the answer (not included in it), at most :data:`MAX_STOPS`.
        seed: the running batch: the seed of the request's own generator; whole calls:
            ``torch.manual_seed`` before the call (such a request runs alone); or None.
        stream: answer as server-sent events.
    """

    prompt_ids: tuple[int, ...]
    max_tokens: int
    do_sample: bool
    temperature: float | None
    top_p: float | None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    stream: bool = False

    def group(self):
        """Requests with the same group may run in one ``generate`` batch (same sampling and stop
        strings; ``max_tokens`` may differ). A seeded request is a group of its own."""
        return (self.do_sample, self.temperature, self.top_p, self.stop, object() if self.seed is not None else None)


def _bad(message: str, status: int = 422):
    raise HTTPException(status_code=status, detail=message)


def _shown(value) -> str:
    """``value`` as the request spelled it (JSON: ``true``, ``"many"``), cut to 100 characters."""
    return json.dumps(value)[:100]


def _not_bool(key: str, value, kind: str = "a number") -> None:
    """Refuse a JSON boolean where a number is expected (Python's ``bool`` is an ``int``, so every
    numeric check asks this first)."""
    if isinstance(value, bool):
        _bad(f"`{key}` must be {kind}, got {_shown(value)} (a boolean is not a number)")


def _integer(body: dict, key: str) -> int | None:
    """``body[key]`` as an integer (None when absent or null); 422 for a boolean or a non-integer."""
    value = body.get(key)
    if value is None:
        return None
    _not_bool(key, value, "an integer")
    if not isinstance(value, int):
        _bad(f"`{key}` must be an integer, got {_shown(value)}")
    return value


def _number(body: dict, key: str, low: float, high: float, *, low_open: bool = False):
    value = body.get(key)
    if value is None:
        return None
    _not_bool(key, value)
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        _bad(f"`{key}` must be a number, got {_shown(value)}")
    if value > high or value < low or (low_open and value == low):
        _bad(f"`{key}` must be {'above' if low_open else 'from'} {low} {'and at most' if low_open else 'to'} {high}, "
             f"got {value}")
    return float(value)


def check_request(body: dict, *, chat: bool, max_tokens_limit: int | None, model_name: str | None = None) -> None:
    """The checks of a request body that need no tokenizer.

    Args:
        body: the parsed JSON body.
        chat: ``/v1/chat/completions`` (``messages``) rather than ``/v1/completions`` (``prompt``).
        max_tokens_limit: the largest ``max_tokens`` / ``max_completion_tokens`` accepted (None: any).
        model_name: the served model's name; a request naming another gets a 404 (None: not checked).

    Raises:
        HTTPException: 404 for another ``model``; 422 with a message for: no ``messages`` (or not a
            non-empty list of objects with a role of :data:`ROLES` and a string or list-of-text-parts
            ``content``); no ``prompt`` or an empty one, or not a string or a list holding one
            (several prompts and token-id prompts are refused); ``max_tokens`` not an integer in
            1..``max_tokens_limit``; ``temperature`` not a number in [0, 2]; ``top_p`` not in
            (0, 1]; ``n`` other than 1; ``stop`` not a string or a list of up to 4 non-empty
            strings; ``seed`` not an integer; ``stream`` not a boolean; a field of
            :data:`UNSUPPORTED` switched on; a boolean in any numeric field (``max_tokens``,
            ``temperature``, ``n``, ``seed``, :data:`NUMERIC_UNSUPPORTED`; Python's ``bool`` is an
            ``int``, JSON's boolean is not a number).
    """
    model = body.get("model")
    if model_name is not None and model is not None and model != model_name:
        _bad(f"model {model!r} not found: this server serves {model_name!r} (or omit \"model\")", 404)
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            _bad("`messages` is required: a non-empty list of {\"role\": ..., \"content\": ...} objects")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES:
                _bad(f"messages[{i}] must be an object with a `role` of {', '.join(ROLES)}, got "
                     f"{_shown(m.get('role') if isinstance(m, dict) else m)}")
            _message_text(m.get("content"), f"messages[{i}].content")
    else:
        _prompt_text(body.get("prompt"))
    for key in ("max_tokens", "max_completion_tokens") if chat else ("max_tokens",):
        value = _integer(body, key)
        if value is None:
            continue
        if value < 1 or (max_tokens_limit is not None and value > max_tokens_limit):
            _bad(f"`{key}` must be from 1 to {max_tokens_limit}, got {value}")
    _number(body, "temperature", 0.0, 2.0)
    _number(body, "top_p", 0.0, 1.0, low_open=True)
    if _integer(body, "n") not in (None, 1):
        _bad(f"`n` must be 1 (one answer per request), got {body['n']}")
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop
    if stop is not None and (not isinstance(stops, list) or len(stops) > MAX_STOPS
                             or not all(isinstance(s, str) and s for s in stops)):
        _bad(f"`stop` must be a non-empty string or a list of up to {MAX_STOPS} of them, got {_shown(stop)}")
    _integer(body, "seed")
    if not isinstance(body.get("stream", False), bool):
        _bad(f"`stream` must be true or false, got {_shown(body.get('stream'))}")
    for key, off in UNSUPPORTED.items():
        if key in NUMERIC_UNSUPPORTED and body.get(key) is not None:
            _not_bool(key, body[key])
        if body.get(key) not in off:
            _bad(f"`{key}` is not supported by river-hf serve (got {_shown(body[key])}); drop it")


def _prompt_text(prompt) -> str:
    """The text of ``/v1/completions``' ``prompt``: a non-empty string, or OpenAI's list form
    holding one such string. Several prompts (OpenAI answers each) and token-id prompts are
    refused: a request here is one generate row, answered as one choice."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    accepted = "a non-empty string, or a list holding one"
    if prompt is None or prompt in ("", []):
        _bad(f"`prompt` is required: {accepted}")
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        _bad(f"`prompt` holds {len(prompt)} prompts; river-hf serve answers one prompt per request (send one "
             "request per prompt)")
    if isinstance(prompt, list) and all(isinstance(p, (int, list)) and not isinstance(p, bool) for p in prompt):
        _bad(f"`prompt` as token ids is not supported; send the text: {accepted}")
    _bad(f"`prompt` must be {accepted}, got {type(prompt).__name__} {_shown(prompt)}")


def _message_text(content, where: str) -> str:
    """A message's text: a string, or the text parts of a list joined (other parts refused)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                _bad(f"{where}: only text parts ({{\"type\": \"text\", \"text\": ...}}) are supported, got {_shown(part)}")
            parts.append(part["text"])
        return "".join(parts)
    _bad(f"{where} must be a string or a list of text parts, got {_shown(content)}")


def prepare(body: dict, tokenizer, *, chat: bool, max_tokens_limit: int | None, model_name: str | None,
            generation_config=None) -> Settings:
    """:func:`check_request`, then the prompt's tokens and the generation settings.

    Sampling follows OpenAI's fields over the model's defaults: ``temperature`` 0 is greedy, above
    0 samples at that temperature (with ``top_p``, default 1); without ``temperature`` the model's
    ``generation_config`` decides (greedy for a model that does not sample by default, as
    ``transformers serve`` did). ``max_tokens`` defaults to :data:`DEFAULT_MAX_TOKENS`, capped by
    the limit.

    Args:
        body, chat, max_tokens_limit, model_name: as for :func:`check_request`.
        tokenizer: the model's tokenizer (``apply_chat_template`` for chat, ``tokenizer(prompt)``
            for a completion).
        generation_config: the model's ``GenerationConfig`` (defaults: ``do_sample``,
            ``temperature``, ``top_p``), or None (greedy).

    Raises:
        HTTPException: as :func:`check_request`; 422 for a prompt of 0 tokens or a chat template
            that cannot render the messages.
    """
    check_request(body, chat=chat, max_tokens_limit=max_tokens_limit, model_name=model_name)
    if chat:
        messages = [{**m, "content": _message_text(m.get("content"), f"messages[{i}].content")}
                    for i, m in enumerate(body["messages"])]
        try:
            encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                    return_dict=True)
        except Exception as e:  # noqa: BLE001 - a template's own refusal (e.g. roles out of order)
            _bad(f"the model's chat template cannot render these messages: {str(e).splitlines()[0][:300]}")
    else:
        encoded = tokenizer(_prompt_text(body["prompt"]))
    ids = encoded["input_ids"]
    ids = ids.reshape(-1).tolist() if hasattr(ids, "reshape") else list(ids[0] if ids and isinstance(ids[0], list)
                                                                       else ids)
    if not ids:
        _bad("the prompt is 0 tokens long after tokenization; send some text")
    limit = max_tokens_limit if max_tokens_limit is not None else DEFAULT_MAX_TOKENS
    max_tokens = body.get("max_completion_tokens") if chat else None
    max_tokens = max_tokens or body.get("max_tokens") or min(DEFAULT_MAX_TOKENS, limit)
    temperature, top_p = body.get("temperature"), body.get("top_p")
    if temperature is None:
        do_sample = bool(getattr(generation_config, "do_sample", False))
        temperature = getattr(generation_config, "temperature", None) if do_sample else None
        top_p = (top_p if top_p is not None else getattr(generation_config, "top_p", None)) if do_sample else None
    else:
        do_sample = temperature > 0
        temperature = float(temperature) if do_sample else None
        top_p = float(top_p if top_p is not None else 1.0) if do_sample else None
    stop = body.get("stop")
    stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
    return Settings(prompt_ids=tuple(ids), max_tokens=int(max_tokens), do_sample=do_sample, temperature=temperature,
                    top_p=top_p, stop=stop, seed=body.get("seed"), stream=bool(body.get("stream", False)))


class AnswerText:
    """The text of one answer as its tokens arrive: special tokens dropped, cut before the first
    ``stop`` string; :meth:`feed` returns only text that is final (not a possible start of a stop
    string, not a half-decoded character), :meth:`finish` the rest.

    Args:
        tokenizer: decodes the tokens (``skip_special_tokens=True``).
        stop: the request's stop strings.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self._tok, self._stop = tokenizer, stop
        self._ids: list[int] = []
        self._sent = 0
        self.stopped = False  # a stop string was found (the text ends before it)

    def text(self, ids: list[int]) -> str:
        """The answer's text for ``ids`` (cut at a stop string; sets :attr:`stopped`)."""
        text = self._tok.decode(ids, skip_special_tokens=True)
        cuts = [i for i in (text.find(s) for s in self._stop) if i >= 0]
        self.stopped = bool(cuts)
        return text[:min(cuts)] if cuts else text

    def feed(self, ids: list[int]) -> str:
        """Add ``ids``; returns the text now final and not yet returned ('' when none)."""
        self._ids.extend(ids)
        text = self.text(self._ids)
        safe = len(text)
        if not self.stopped:
            safe -= max((k for s in self._stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            while safe > 0 and text[safe - 1] == "\ufffd":  # a character whose bytes are not all here yet
                safe -= 1
        return self._take(text, safe)

    def finish(self, ids: list[int]) -> str:
        """The answer is ``ids``: returns the text not yet returned."""
        text = self.text(ids)
        return self._take(text, len(text))

    def _take(self, text: str, upto: int) -> str:
        if upto <= self._sent:
            return ""
        out, self._sent = text[self._sent:upto], upto
        return out
