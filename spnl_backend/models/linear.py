"""The projection layers' type, several projections of one input at once, and the token
embeddings (which a tied model's output projection reuses)."""

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


def rows_alone(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` for ``x [T, in]``, each row computed alone (a matrix-vector product):
    a float GEMM rounds differently with its number of rows, and what decides a token's
    path (a router's logits, a gate's) must not depend on what shares its step. A
    quantized layer's rows already are."""
    if isinstance(layer, QuantLinear):
        return layer(x)
    weight, bias = layer.weight, layer.bias
    if not len(x):
        return x @ weight.T
    out = torch.stack([torch.mv(weight, row) for row in x])
    return out if bias is None else out + bias


class Embedding(nn.Embedding):
    """Token embeddings that can also serve as the output projection (tied models)."""

    def reset_parameters(self) -> None:
        """Nothing to initialise: the weights always come from the checkpoint (and the
        random init, run on the meta device, would import torch._dynamo: 1.6 s)."""

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden, self.weight)
