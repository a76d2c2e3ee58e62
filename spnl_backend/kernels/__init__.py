"""Triton kernels and their torch reference twins, chosen through one dispatch point."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from ..log import get_logger
from .paged_ref import paged_attention_ref, store_kv_ref

log = get_logger()


@dataclass(frozen=True)
class Kernels:
    """The kernels the paged engine calls; every set has the same signatures."""

    name: str
    store_kv: Callable[..., None]
    paged_attention: Callable[..., object]


TORCH_KERNELS = Kernels("torch", store_kv_ref, paged_attention_ref)


def select_kernels(kind: Literal["torch", "triton"]) -> Kernels:
    """The kernel set for the platform's decision (``PlatformDecisions.kernels``).

    Triton is imported only here, so platforms without it never load it.
    """
    if kind == "torch":
        return TORCH_KERNELS
    from .triton_attention import paged_attention_triton
    from .triton_store import store_kv_triton

    log.debug("kernels.selected", kernels="triton")
    return Kernels("triton", store_kv_triton, paged_attention_triton)
