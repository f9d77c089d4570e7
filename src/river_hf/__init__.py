"""river-hf: training-free faster decoding for Hugging Face transformers.

Three methods, one subpackage each: River-LLM early exit (:mod:`river_hf.river`), R-Stitch
small/large model stitching (:mod:`river_hf.stitch`) and dLLM-Cache for masked diffusion LMs
(:mod:`river_hf.diffusion`). Public names are imported on first use (torch loads then).
"""

from ._lazy import lazy_exports
from ._version import __version__
from .errors import RiverError
from .models import resolve

_EXPORTS = {
    **{name: ".river" for name in ("RiverCache", "RiverConfig", "RiverForCausalLM", "enable_river", "disable_river",
                                        "plain_model")},
    **{name: "." + name for name in ("river", "stitch", "diffusion", "eval")},  # river_hf.stitch.generate, ...
}
__all__ = ["RiverCache", "RiverConfig", "RiverForCausalLM", "RiverError", "enable_river", "disable_river", "plain_model",
           "resolve",
           "__version__"]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
