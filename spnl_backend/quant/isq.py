"""In-situ quantization: which weights of a text model become which GGML type, as they load.

The attention and MLP projections take the requested type; the token embedding and the
output head take a higher one, as mistral.rs promotes them (2-4-bit types to Q6K, 5-bit
and 8-bit types to Q8_0); norms and biases stay as they are. A matrix whose rows do not
split into a K-quant's 256-value blocks takes the 32-value type mistral.rs falls back to
(Q2K, Q3K → Q4_0; Q4K → Q4_1; Q5K → Q5_0; Q6K → Q5_1); one that fits neither stays in
float. The log says which tensors took a fallback or stayed float, and why.
"""

import re
from collections.abc import Iterator

import torch
from gguf import GGMLQuantizationType as Q

from ..log import get_logger
from ..memory import on_host_pages, release_freed_memory
from ..settings.values import IsqType
from .ggml import ggml_format
from .linear import QuantizedWeight
from .quantize import quantize

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
# K-quant → the 32-value type of similar size, for rows that are not a multiple of 256.
FALLBACK = {Q.Q2_K: Q.Q4_0, Q.Q3_K: Q.Q4_0, Q.Q4_K: Q.Q4_1, Q.Q5_K: Q.Q5_0, Q.Q6_K: Q.Q5_1}
REQUANTIZE_SLICE_ELEMENTS = 1 << 22  # 16 MB of float32 at a time
_PROMOTED_TO_Q6K = {IsqType.Q2K, IsqType.Q3K, IsqType.Q4K, IsqType.Q4_0, IsqType.Q4_1}
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_EMBEDDINGS = ("model.embed_tokens.weight", "lm_head.weight")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def isq_type_for(name: str, isq: IsqType) -> Q | None:
    """The GGML type ISQ gives the weight called ``name``, or None to leave it alone."""
    if name in _EMBEDDINGS:
        return Q.Q6_K if isq in _PROMOTED_TO_Q6K else Q.Q8_0
    module = name.removesuffix(".weight").rpartition(".")[2]
    if name.endswith(".weight") and module in _PROJECTIONS:
        return GGML_TYPE[isq]
    return None


def linear_type(isq: IsqType, cols: int, head: bool = False) -> Q | None:
    """The GGML type ISQ gives a projection of ``cols`` inputs (``head``: the output head,
    promoted as `isq_type_for` promotes it), its fallback where its blocks do not fit, or
    None where neither does."""
    wanted = (Q.Q6_K if isq in _PROMOTED_TO_Q6K else Q.Q8_0) if head else GGML_TYPE[isq]
    return _fitting_type(wanted, cols)


def apply_isq(
    tensors: Iterator[tuple[str, torch.Tensor]], isq: IsqType, keep_quantized: bool = False
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Quantize each eligible weight as it streams past, so only one float matrix is alive.

    Weights already quantized are requantized when their type differs (a GGUF's, for a
    draft), or with ``keep_quantized`` kept as they are (a checkpoint's quantized experts,
    gpt-oss's MXFP4: requantizing would only add error)."""
    fallbacks: dict[tuple[Q, Q], list[str]] = {}
    kept: list[str] = []
    layer = None
    for name, tensor in tensors:
        if (match := _LAYER.match(name)) and match[1] != layer:
            # The last layer's float matrices and quantization buffers are free now, but
            # the allocator keeps them among the live blocks it handed out since; without
            # handing them back the load's peak grows by up to twice one layer's floats.
            layer = match[1]
            release_freed_memory()
        if keep_quantized and isinstance(tensor, QuantizedWeight):
            kept.append(name)
            yield name, tensor
            continue
        qtype = isq_type_for(name, isq)
        if qtype is None or len(tensor.shape) != 2:
            yield name, tensor
            continue
        chosen = _fitting_type(qtype, tensor.shape[1])
        if chosen is None:
            log.warning(
                "isq.skipped",
                tensor=name,
                type=qtype.name,
                reason=f"rows of {tensor.shape[1]} values do not split into blocks "
                f"of {ggml_format(qtype).block_size} (nor of 32); kept in float",
            )
            yield name, tensor
            continue
        if chosen != qtype:
            fallbacks.setdefault((qtype, chosen), []).append(name)
        if isinstance(tensor, QuantizedWeight):
            yield name, tensor if tensor.qtype == chosen else requantize(tensor, chosen)
            continue
        yield name, _on_host_pages(QuantizedWeight.from_float(tensor, chosen))
    if kept:
        log.info(
            "isq.kept",
            tensors=len(kept),
            first=kept[0],
            reason="stored quantized by the checkpoint; kept as its blocks",
        )
    for (qtype, chosen), names in fallbacks.items():
        log.info(
            "isq.fallback",
            type=qtype.name,
            fallback=chosen.name,
            tensors=len(names),
            first=names[0],
            reason=f"rows do not split into {qtype.name}'s blocks of "
            f"{ggml_format(qtype).block_size} values",
        )


def requantize(weight: QuantizedWeight, qtype: Q) -> QuantizedWeight:
    """``weight`` in another GGML type, a slice of rows at a time (no whole float copy)."""
    rows = max(1, REQUANTIZE_SLICE_ELEMENTS // weight.shape[1])
    parts = [
        quantize(weight.rows(slice(start, start + rows)).dequantize(), qtype)
        for start in range(0, weight.shape[0], rows)
    ]
    return QuantizedWeight(on_host_pages(torch.cat(parts)), qtype, weight.shape)


def _on_host_pages(weight: QuantizedWeight) -> QuantizedWeight:
    return QuantizedWeight(on_host_pages(weight.data), weight.qtype, weight.shape)


def _fitting_type(qtype: Q, cols: int) -> Q | None:
    """``qtype`` if rows of ``cols`` values split into its blocks, else its fallback if
    they split into that one's, else None."""
    for candidate in (qtype, FALLBACK.get(qtype)):
        if candidate is not None and cols % ggml_format(candidate).block_size == 0:
            return candidate
    return None
