"""R-Stitch: entropy-guided stitching of a small (SLM) and a large (LLM) causal LM (arXiv 2507.17307).

``river_hf.stitch.generate(slm, llm, input_ids, tau=...)`` decodes one answer with both models;
see :mod:`river_hf.stitch.generation`. The latency estimator is in :mod:`river_hf.stitch.latency`;
``llm.generate(..., custom_generate=river_hf.stitch.CUSTOM_GENERATE_DIR, trust_remote_code=True,
assistant_model=slm, tau=...)`` runs the same function through transformers' ``custom_generate``.
"""

from pathlib import Path

from .._lazy import lazy_exports

_EXPORTS = {
    **{name: ".generation" for name in ("LLM", "SLM", "StitchOutput", "StitchStats", "check_pair", "generate",
                                         "normalized_entropy", "shared_vocab_size")},
    "LatencyEstimator": ".latency",
}
CUSTOM_GENERATE_DIR = str(Path(__file__).resolve().parent)

__all__ = [
    "generate",
    "normalized_entropy",
    "check_pair",
    "shared_vocab_size",
    "StitchOutput",
    "StitchStats",
    "LatencyEstimator",
    "SLM",
    "LLM",
    "CUSTOM_GENERATE_DIR",
]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
