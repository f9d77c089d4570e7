"""llama.cpp on the same GGUF, timed like the transformers methods (benchmarks/heldout_speed.py and
benchmarks/lossless_bench.py offer it as their ``llama.cpp`` method).

llama-cpp-python is not a river-hf dependency (it builds from its PyPI sdist, ~12 minutes on 2 cores);
the benchmarks offer the ``llama.cpp`` method only where it imports (:func:`available`).
"""

from __future__ import annotations

import importlib.util
import time

__all__ = ["available", "gguf_tensor_bytes", "LlamaCppRunner"]


def available() -> bool:
    """True when ``llama_cpp`` (llama-cpp-python) can be imported."""
    return importlib.util.find_spec("llama_cpp") is not None


def gguf_tensor_bytes(path: str) -> int:
    """Bytes of tensor data a llama.cpp decode step reads from the GGUF at ``path``: every tensor,
    except that the token embedding table counts one row when the file has its own ``output.weight``
    (the step looks up one token's row; a model with tied embeddings has no ``output.weight`` and
    reads the whole table as its LM head). Qwen2.5-Coder-0.5B Q4_K_M: 391.9 of the file's 485.5 MB."""
    from gguf import GGUFReader

    tensors = GGUFReader(path).tensors
    untied = any(t.name == "output.weight" for t in tensors)
    total = 0
    for t in tensors:
        if untied and t.name == "token_embd.weight":
            rows = int(t.shape[-1]) if len(t.shape) > 1 else 1  # GGUF shapes list the row length first
            total += int(t.n_bytes) // max(rows, 1)
        else:
            total += int(t.n_bytes)
    return total


class LlamaCppRunner:
    """One llama.cpp model over ``path`` (a GGUF), ``threads`` threads for decode and prompt, greedy.

    :meth:`run` decodes exactly ``new_tokens`` tokens after a prompt of token ids, the ``eos`` ids'
    logits set to -inf at every step (as ``SuppressIds`` does for the transformers methods), with no
    prefix reuse between runs (every run pays its prompt, as the others do).

    Args:
        path: the GGUF file (``river_hf.models.gguf_file(key)``).
        n_ctx: context length to allocate (tokens; at least the longest prompt plus ``new_tokens``).
        threads: llama.cpp threads (use torch's, ``torch.get_num_threads()``).
        eos: token ids never sampled.
        new_tokens: tokens per run.

    Raises:
        ImportError: llama-cpp-python is not installed.
    """

    def __init__(self, path: str, *, n_ctx: int, threads: int, eos, new_tokens: int):
        from importlib.metadata import version

        from llama_cpp import Llama

        self.path, self.eos, self.new_tokens = path, sorted(set(eos)), new_tokens
        self.weight_bytes = gguf_tensor_bytes(path)
        self.version = version("llama_cpp_python")
        self.llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, n_batch=512,
                         verbose=False, seed=0)

    def run(self, ids):
        """Decode after ``ids`` (``int64 [1, prompt]`` or a list of ints); returns ``(Measurement, new token ids)``
        with ``weight_bytes_per_step`` from :func:`gguf_tensor_bytes`."""
        import numpy as np

        from ..timing import Measurement

        eos = self.eos

        def suppress(_ids, scores):
            scores[eos] = -np.inf
            return scores

        prompt = ids[0].tolist() if hasattr(ids, "tolist") else list(ids)
        self.llm.reset()
        new, ttft = [], 0.0
        start = time.perf_counter()
        for token in self.llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0,
                                       reset=True, logits_processor=[suppress]):
            if not new:
                ttft = time.perf_counter() - start
            new.append(int(token))
            if len(new) == self.new_tokens:
                break
        seconds = time.perf_counter() - start
        return Measurement(new_tokens=len(new), seconds=seconds, ttft_s=ttft, decode_tokens=len(new) - 1,
                           decode_s=seconds - ttft, decode_steps=len(new) - 1,
                           weight_bytes_per_step=self.weight_bytes), new
