"""The model families, one module each (`family.Family`), and lookups by name, by
``config.json`` model type and by GGUF architecture. Loaders, tokenizer rules and the
tests iterate this list; a family is added here and nowhere else."""

import functools

from . import (
    apertus,
    arcee,
    cohere,
    cohere2,
    deepseek,
    ernie4_5,
    ernie4_5_moe,
    exaone4,
    falcon_h1,
    gemma,
    gemma2,
    gemma3,
    gemma4,
    glm,
    glm4,
    glm4_moe,
    gpt_neox,
    gpt_oss,
    granite,
    granitemoehybrid,
    hunyuan_v1_dense,
    jamba,
    llama,
    llama4,
    ministral,
    mistral,
    mixtral,
    nemotron,
    olmo,
    olmo2,
    olmoe,
    phi,
    phi3,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_5,
    qwen3_5_moe,
    qwen3_moe,
    seed_oss,
    smollm3,
    stablelm,
    starcoder2,
)
from .family import Family

FAMILIES: tuple[Family, ...] = (
    tuple(
        module.FAMILY
        for module in (
            llama,
            mistral,
            qwen2,
            qwen3,
            phi3,
            gemma2,
            gemma3,
            gemma4,
            olmo2,
            smollm3,
            qwen3_5,
            qwen3_5_moe,
            granitemoehybrid,
            falcon_h1,
            jamba,
            qwen3_moe,
            mixtral,
            olmoe,
            granite,
            cohere,
            cohere2,
            qwen2_moe,
            gpt_oss,
            seed_oss,
            ernie4_5,
            glm4,
            glm,
            exaone4,
            arcee,
            ministral,
            hunyuan_v1_dense,
            apertus,
            gemma,
            llama4,
            phi,
            starcoder2,
            gpt_neox,
            nemotron,
            olmo,
            stablelm,
            glm4_moe,
            ernie4_5_moe,
        )
    )
    + deepseek.FAMILIES
)


@functools.cache
def family_names() -> tuple[str, ...]:
    return tuple(f.name for f in FAMILIES)


def family(name: str) -> Family:
    """The family of a `ModelConfig.architecture`."""
    return _by_name()[name]


def family_of_model_type(model_type: object) -> Family | None:
    return next((f for f in FAMILIES if model_type in f.model_types), None)


def family_of_wrapper(model_type: object) -> Family | None:
    """The family whose language model a multimodal ``config.json`` of ``model_type``
    nests in its ``text_config``."""
    return next((f for f in FAMILIES if model_type in f.wrapper_types), None)


def family_of_gguf(arch: str) -> Family | None:
    return next((f for f in FAMILIES if arch in f.gguf_archs), None)


@functools.cache
def checkpoint_prefixes() -> tuple[tuple[str, str], ...]:
    """Every family's checkpoint name prefixes outside the ``model.`` layout, with ours
    (`Family.hf_prefixes`)."""
    return tuple(pair for f in FAMILIES for pair in f.hf_prefixes.items())


def gguf_architectures() -> tuple[str, ...]:
    return tuple(a for f in FAMILIES for a in f.gguf_archs)


@functools.cache
def _by_name() -> dict[str, Family]:
    return {f.name: f for f in FAMILIES}


__all__ = [
    "FAMILIES",
    "Family",
    "checkpoint_prefixes",
    "family",
    "family_names",
    "family_of_gguf",
    "family_of_model_type",
    "family_of_wrapper",
    "gguf_architectures",
]
