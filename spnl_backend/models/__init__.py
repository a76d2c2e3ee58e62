"""Transformer architectures (Llama/Mistral, Qwen2, Qwen3, Phi-3, Gemma 3), written once."""

from .config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeConfig
from .layers import AttentionBackend, AttentionSpec
from .transformer import CausalLM

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "AttentionBackend",
    "AttentionSpec",
    "CausalLM",
    "ModelConfig",
    "RopeConfig",
]
