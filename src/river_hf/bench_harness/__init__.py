"""The shared harness of the benchmark scripts in ``benchmarks/`` (importable and tested, so no
script imports another and no test imports a script's internals).

- :mod:`.prompts`: prompt sets (``humaneval:100-102,gsm8k:5``), their texts, left-padded batches;
- :mod:`.generation`: exactly N tokens with EOS suppressed by index (``SuppressIds``), method names
  carrying River settings (``lossless[KEY=VALUE;...]``, ``--set``);
- :mod:`.kernel_modes`: the plain model on prepacked oneDNN, a kernel mode entered around given
  Linears, the verify-kernel mode for multi-row forwards, prompt kernels bypassed;
- :mod:`.llama_cpp`: llama.cpp on the same GGUF, timed like the transformers methods;
- :mod:`.rounds`: rounds in alternating order, verdicts on a speedup's spread;
- :mod:`.step_profile`: a decode step's wall time by category of module (``step_profile.py``);
- :mod:`.stitch_report`: R-Stitch's per-round summary and report (``stitch_bench.py``);
- :mod:`.diffusion_settings`: dLLM-Cache settings, their names and verdict lines (``diffusion_bench.py``).

The last four are imported by their module path (``from river_hf.bench_harness.rounds import ...``).

The timer itself (``compare``, ``spread``, tables, figures) is :mod:`river_hf.timing`.
"""

from __future__ import annotations

from .generation import (EOS_SUPPRESSED, LOSSLESS_SETTINGS, SuppressIds, config_overrides, eos_ids, exact_generation,
                         json_or_text, lossless_settings, split_methods)
from .kernel_modes import all_modules, linears_in_mode, multi_row_kernel_hooks, plain_onednn_mode, prompt_kernels_off
from .llama_cpp import LlamaCppRunner, available, gguf_tensor_bytes
from .prompts import DATASETS, left_padded, parse_problems, parse_prompt_sets, prompt_texts

__all__ = ["EOS_SUPPRESSED", "LOSSLESS_SETTINGS", "SuppressIds", "config_overrides", "eos_ids", "exact_generation",
           "json_or_text", "lossless_settings", "split_methods", "linears_in_mode", "multi_row_kernel_hooks", "plain_onednn_mode",
           "prompt_kernels_off", "all_modules", "LlamaCppRunner", "available", "gguf_tensor_bytes", "DATASETS", "left_padded",
           "parse_problems", "parse_prompt_sets", "prompt_texts"]
