"""River-LLM: KV-shared seamless early exit through quantized exit layers."""

from .._lazy import lazy_exports

_EXPORTS = {
    "RiverCache": ".cache",
    "ExitRule": ".controllers",
    "ExitRuleList": ".controllers",
    "MinLayerRule": ".controllers",
    "StateTransitionSimilarityRule": ".controllers",
    "state_transition_similarity": ".controllers",
    "RiverLayer": ".layer",
    "RiverRouter": ".layer",
    "exit_modules": ".wrapping",
    "SUPPORTED_MODEL_TYPES": ".arch",
    "RiverConfig": ".config",
    "default_config": ".config",
    "RiverForCausalLM": ".modeling",
    "enable_river": ".modeling",
    "disable_river": ".modeling",
    "plain_model": ".plain",
}

__all__ = [
    "RiverCache",
    "RiverConfig",
    "RiverForCausalLM",
    "RiverLayer",
    "RiverRouter",
    "exit_modules",
    "ExitRule",
    "ExitRuleList",
    "MinLayerRule",
    "StateTransitionSimilarityRule",
    "state_transition_similarity",
    "enable_river",
    "disable_river",
    "plain_model",
    "default_config",
    "SUPPORTED_MODEL_TYPES",
]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
