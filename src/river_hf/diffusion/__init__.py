"""dLLM-Cache for masked diffusion language models (LLaDA, Dream), on HF-style models.

``generate(model, input_ids, steps=..., gen_length=..., block_length=..., cache=...)``
runs the LLaDA-style denoising loop and returns a ``DiffusionGenerationOutput`` (``.sequences``,
``.stats``); ``cache=DLLMCacheConfig(prompt_interval, response_interval, ratio)`` serves the
decoder layers through dLLM-Cache (Liu et al., 2025). See docs/diffusion.md.
"""

from .._lazy import lazy_exports

_EXPORTS = {
    **{name: ".cache" for name in ("DLLMCacheConfig", "FeatureCache", "attach_cache", "select_response_tokens")},
    **{name: ".denoising" for name in ("DiffusionGenerationOutput", "generate", "mask_token_id",
                                       "num_transfer_tokens")},
    **{name: ".modeling" for name in ("BidirectionalLlamaConfig", "BidirectionalLlamaForMaskedLM", "LLaDALayoutConfig",
                                      "LLaDALayoutForMaskedLM", "build_test_model")},
}

__all__ = [
    "BidirectionalLlamaConfig",
    "BidirectionalLlamaForMaskedLM",
    "DLLMCacheConfig",
    "DiffusionGenerationOutput",
    "FeatureCache",
    "LLaDALayoutConfig",
    "LLaDALayoutForMaskedLM",
    "attach_cache",
    "build_test_model",
    "generate",
    "mask_token_id",
    "num_transfer_tokens",
    "select_response_tokens",
]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
