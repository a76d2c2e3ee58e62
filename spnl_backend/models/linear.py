"""The projection layers' type, and several projections of one input at once."""

import torch
from torch import nn

from ..quant.linear import QuantLinear


class Linear(nn.Linear):
    """The projection layers' type: the seam where quantized layers replace float ones."""


def project(x: torch.Tensor, *layers: nn.Module) -> list[torch.Tensor]:
    """Several projections of the same input; quantized ones share one pass over it."""
    if all(isinstance(layer, QuantLinear) for layer in layers):
        return QuantLinear.apply_many(x, list(layers))
    return [layer(x) for layer in layers]
