"""GLM-4 (the first 9B models as transformers writes them, ``glm``): Llama's pre-norm
layer with GLM-4's attention (biases on q, k and v; a rope turning adjacent pairs of the
first half of each head, put in rotate-half order as the rows load) and gate and up fused.

llama.cpp's converter writes these as ``chatglm`` files, with q, k and v apart as the
checkpoint has them. The fused ``attn_qkv`` of the older ChatGLM conversions is refused."""

from ...errors import UnsupportedArchitectureError
from .family import COMMON_GGUF_NAMES, Family, Fields, GgufKeys, HfKeys, rotate_pairs_as_halves
from .glm4 import hf_fields as glm4_fields


def _hf(keys: HfKeys, head_dim: int) -> Fields:
    return {**glm4_fields(keys, head_dim), "norm_placement": "pre"}


def _gguf(keys: GgufKeys, fields: Fields) -> Fields:
    if keys.has_tensor("blk.0.attn_qkv.weight"):
        raise UnsupportedArchitectureError(
            "a chatglm GGUF with fused q/k/v (blk.0.attn_qkv, the older ChatGLM "
            "conversions) is not supported; supported: q, k and v apart (GLM-4 converted "
            "from transformers' glm checkpoints)"
        )
    return {"qkv_bias": keys.has_tensor("blk.0.attn_q.bias")}


FAMILY = Family(
    name="glm",
    model_types=("glm",),
    gguf_archs=("chatglm",),
    hf_fields=_hf,
    gguf_fields=_gguf,
    gguf_names={**COMMON_GGUF_NAMES, "ffn_up": "mlp.gate_up_proj"},
    tensors=rotate_pairs_as_halves,
    # llama.cpp's converter writes a 1e-5 eps and a base of 10,000 whatever the
    # checkpoint says: the tiny model's own, so that its GGUF twin is the same model.
    tiny={"head_dim": 16, "rms_norm_eps": 1e-5},
)
