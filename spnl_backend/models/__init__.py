"""Transformer architectures (Llama/Mistral, Qwen2, Qwen3, Phi-3, Gemma 3), written once."""

from .attention import AttentionSpec, StepAttention
from .config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeConfig
from .transformer import CausalLM

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "AttentionSpec",
    "CausalLM",
    "ModelConfig",
    "RopeConfig",
    "StepAttention",
]
