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
    """The kernel set for the platform's decision (``PlatformDecisions.kernels``)."""
    if kind == "triton":
        log.warning(
            "kernels.triton_unavailable",
            reason="the Triton kernels are not in this version yet; torch kernels run",
        )
    return TORCH_KERNELS
