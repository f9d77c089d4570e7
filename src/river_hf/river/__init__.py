"""River-LLM: KV-shared seamless early exit through quantized exit layers."""

from .cache import RiverCache
from .controllers import (
    ExitRule,
    ExitRuleList,
    MinLayerRule,
    StateTransitionSimilarityRule,
    state_transition_similarity,
)
from .layer import RiverLayer, RiverRouter
from .modeling import SUPPORTED_MODEL_TYPES, RiverConfig, RiverForCausalLM, default_config, enable_river

__all__ = [
    "RiverCache",
    "RiverConfig",
    "RiverForCausalLM",
    "RiverLayer",
    "RiverRouter",
    "ExitRule",
    "ExitRuleList",
    "MinLayerRule",
    "StateTransitionSimilarityRule",
    "state_transition_similarity",
    "enable_river",
    "default_config",
    "SUPPORTED_MODEL_TYPES",
]
