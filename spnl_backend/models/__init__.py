"""Transformer architectures (Llama/Mistral, Qwen2, Qwen3, Phi-3, Gemma 3), written once."""

from .config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeConfig
from .step_attention import AttentionSpec, StepAttention
from .transformer import CausalLM

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "AttentionSpec",
    "CausalLM",
    "ModelConfig",
    "RopeConfig",
    "StepAttention",
]
