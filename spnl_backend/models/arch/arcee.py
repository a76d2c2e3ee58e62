"""Arcee (AFM): Llama whose MLP has no gate: ``down(relu2(up(x)))``, ReLU squared.

llama.cpp's converter permutes q and k as for Llama (NORM rope)."""

from .family import Family, Fields, GgufKeys, HfKeys, biases


def _hf(keys: HfKeys, head_dim: int) -> Fields:
    if keys.get("mlp_bias", False):
        raise keys.wrong("mlp_bias", True, "false (biased MLP projections are not supported)")
    return {**biases(keys), "mlp_gated": False}


def _gguf(keys: GgufKeys, fields: Fields) -> Fields:
    # (llama.cpp's graph for arcee is ReLU squared, whatever the file says)
    return {"mlp_gated": False, "activation": "relu2"}


FAMILY = Family(
    name="arcee",
    model_types=("arcee",),
    gguf_archs=("arcee",),
    hf_fields=_hf,
    gguf_fields=_gguf,
    gguf_permuted_qk=True,
    tiny={
        "head_dim": 16,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
        },
    },
)
