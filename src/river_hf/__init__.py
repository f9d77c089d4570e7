"""river-hf: training-free faster decoding for Hugging Face transformers.

Three methods, one subpackage each: River-LLM early exit (:mod:`river_hf.river`), R-Stitch
small/large model stitching (:mod:`river_hf.stitch`) and dLLM-Cache for masked diffusion LMs
(:mod:`river_hf.diffusion`).
"""

from .errors import RiverError
from .models import resolve
from .river import RiverCache, RiverConfig, RiverForCausalLM, enable_river

__version__ = "0.1.0"
__all__ = ["RiverCache", "RiverConfig", "RiverForCausalLM", "RiverError", "enable_river", "resolve", "__version__"]
