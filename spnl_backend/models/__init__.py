"""Model families (`models.arch`, one module each) and the one transformer their per-layer
descriptions (`models.layers`) build."""

from .arch import FAMILIES, family_names
from .config import ModelConfig, RopeConfig
from .layers import LayerSpec
from .step_attention import AttentionSpec, StepAttention
from .transformer import CausalLM

__all__ = [
    "FAMILIES",
    "AttentionSpec",
    "CausalLM",
    "LayerSpec",
    "ModelConfig",
    "RopeConfig",
    "StepAttention",
    "family_names",
]
