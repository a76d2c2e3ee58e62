"""Mixtral: Llama's attention over experts whose top-k weights are always renormalised,
and kept in float32 (its GGUFs are ``llama`` files with experts: `llama`)."""

import dataclasses

from .family import Family, Fields, HfKeys, experts


def _hf(keys: HfKeys, head_dim: int) -> Fields:
    moe = experts(keys, "intermediate_size", renormalize=True)
    return {"moe": dataclasses.replace(moe, float_weights=True)}


FAMILY = Family(
    name="mixtral",
    model_types=("mixtral",),
    hf_fields=_hf,
    tiny={"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2},
)
