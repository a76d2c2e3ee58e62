"""In-situ quantization: which weights of a text model become which GGML type, as they load.

The attention and MLP projections take the requested type; the token embedding and the
output head take a higher one, as mistral.rs promotes them (2-4-bit types to Q6K, 5-bit
and 8-bit types to Q8_0); norms and biases stay as they are. A matrix whose rows do not
split into the type's blocks stays in float, and the log says so.
"""

from collections.abc import Iterator

import torch
from gguf import GGMLQuantizationType as Q

from ..log import get_logger
from ..settings.values import IsqType
from .ggml import ggml_format
from .linear import QuantizedWeight

log = get_logger()

GGML_TYPE = {
    IsqType.Q2K: Q.Q2_K,
    IsqType.Q3K: Q.Q3_K,
    IsqType.Q4K: Q.Q4_K,
    IsqType.Q5K: Q.Q5_K,
    IsqType.Q6K: Q.Q6_K,
    IsqType.Q4_0: Q.Q4_0,
    IsqType.Q4_1: Q.Q4_1,
    IsqType.Q5_0: Q.Q5_0,
    IsqType.Q5_1: Q.Q5_1,
    IsqType.Q8_0: Q.Q8_0,
    IsqType.Q8_1: Q.Q8_1,
}
_PROMOTED_TO_Q6K = {IsqType.Q2K, IsqType.Q3K, IsqType.Q4K, IsqType.Q4_0, IsqType.Q4_1}
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_EMBEDDINGS = ("model.embed_tokens.weight", "lm_head.weight")


def isq_type_for(name: str, isq: IsqType) -> Q | None:
    """The GGML type ISQ gives the weight called ``name``, or None to leave it alone."""
    if name in _EMBEDDINGS:
        return Q.Q6_K if isq in _PROMOTED_TO_Q6K else Q.Q8_0
    module = name.removesuffix(".weight").rpartition(".")[2]
    if name.endswith(".weight") and module in _PROJECTIONS:
        return GGML_TYPE[isq]
    return None


def apply_isq(
    tensors: Iterator[tuple[str, torch.Tensor]], isq: IsqType
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Quantize each eligible weight as it streams past, so only one float matrix is alive."""
    for name, tensor in tensors:
        qtype = isq_type_for(name, isq)
        if qtype is None or tensor.ndim != 2:
            yield name, tensor
            continue
        block = ggml_format(qtype).block_size
        if tensor.shape[1] % block:
            log.warning(
                "isq.skipped",
                tensor=name,
                type=qtype.name,
                reason=f"rows of {tensor.shape[1]} values do not split into blocks "
                f"of {block}; kept in float",
            )
            yield name, tensor
            continue
        yield name, QuantizedWeight.from_float(tensor, qtype)
