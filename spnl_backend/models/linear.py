"""The projection layers' type, several projections of one input at once, and the token
embeddings (which a tied model's output projection reuses)."""

import torch
from torch import nn

from ..kernels.lora_ref import LoraSite
from ..quant.linear import QuantLinear


class Linear(nn.Linear):
    """The projection layers' type: the seam where quantized layers replace float ones,
    and where LoRA adapters attach (``lora``: their products, added row by row)."""

    lora: LoraSite | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out if self.lora is None else self.lora.add(x, out)


def project(x: torch.Tensor, *layers: nn.Module) -> list[torch.Tensor]:
    """Several projections of the same input; quantized ones share one pass over it."""
    if all(isinstance(layer, QuantLinear) for layer in layers):
        return QuantLinear.apply_many(x, list(layers))
    return [layer(x) for layer in layers]


class Embedding(nn.Embedding):
    """Token embeddings that can also serve as the output projection (tied models)."""

    def reset_parameters(self) -> None:
        """Nothing to initialise: the weights always come from the checkpoint (and the
        random init, run on the meta device, would import torch._dynamo: 1.6 s)."""

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden, self.weight)
