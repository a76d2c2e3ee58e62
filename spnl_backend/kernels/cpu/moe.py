"""A mixture-of-experts layer on the native kernels (``moe.c``): routing, the experts'
grouped products and their weighted sum in one call, prepared once per layer.

Its twin is the grouped torch path of `models.moe.SparseMoE` (a float32 softmax, top-k,
each expert's rows through its projections, summed in expert order): the two agree to
rounding (the exponentials and the sums' order differ), and the layer calls this one
wherever it runs, per-op or inside the native layer blocks, so both give the same bits.
"""

import threading
from dataclasses import dataclass

import torch

from .abi import MoeArgs, ProductsArgs
from .checks import KernelArgumentError, check_status, require
from .wrappers import CpuKernels, Products

# The most experts one layer may have here (moe.c's MAX_EXPERTS: a grouped call takes the
# gate and up of each).
MAX_EXPERTS = 256

# One projection of one expert: (GGML type id, its blocks [rows, row bytes], rows).
Weight = tuple[int, torch.Tensor, int]
ALIGN = 64  # what moe.c asks of its scratch
_held = threading.local()  # each thread's scratch


def scratch(nbytes: int) -> tuple[int, int]:
    """This thread's working memory for the MoE layers, at least ``nbytes``: (its aligned
    address, its bytes). Kept between calls, as a fresh block per layer would be a new
    mapping faulted in page by page (a prefill chunk's tens of MB, every layer)."""
    held = getattr(_held, "tensor", None)
    if held is None or held.numel() < nbytes + ALIGN:
        held = _held.tensor = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    address = held.data_ptr()
    skip = -address % ALIGN
    return address + skip, held.numel() - skip


@dataclass(frozen=True)
class Biases:
    """A layer's biases, float32: the router's ``[experts]``, each expert's gate and up
    ``[experts, 2 inner]`` (gate's, then up's) and down ``[experts, hidden]`` (gpt-oss's)."""

    router: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


class NativeMoe:
    """A layer's router (float32 ``[experts, hidden]``) and its experts' quantized ``(gate,
    up, down)``, prepared for ``spnl_moe``: each token's ``top_k`` experts by softmax, their
    weights renormalised over the k where ``renormalize``, SiLU-gated, or with ``clamped =
    (alpha, limit)`` gated by gpt-oss's clamped SwiGLU; ``biases`` where the layer has them."""

    def __init__(
        self,
        kernels: CpuKernels,
        router: torch.Tensor,
        experts: list[tuple[Weight, Weight, Weight]],
        top_k: int,
        renormalize: bool,
        biases: Biases | None = None,
        clamped: tuple[float, float] | None = None,
    ) -> None:
        require(router, torch.float32, "moe: router", dims=2)
        count, hidden = router.shape
        if not (0 < count == len(experts) <= MAX_EXPERTS and 0 < top_k <= count):
            raise KernelArgumentError(
                f"moe: a router of {count} experts for {len(experts)}, top {top_k}; at most "
                f"{MAX_EXPERTS} experts"
            )
        inner = experts[0][0][2]
        self.kernels, self.router, self.hidden = kernels, router, hidden
        self.gate_up = [kernels.products([gate, up]) for gate, up, _ in experts]
        self.down = [kernels.products([down]) for _, _, down in experts]
        if any(call.widths != [inner, inner] for call in self.gate_up) or any(
            call.widths != [hidden] for call in self.down
        ):
            raise KernelArgumentError("moe: experts of different shapes")
        for products, k_in in ((self.gate_up, hidden), (self.down, inner)):
            for call in products:
                for qtype, row_bytes in call.row_bytes:
                    kernels.check_row_bytes(qtype, k_in, row_bytes, "moe: expert")
        self._arrays = [_array(self.gate_up), _array(self.down)]  # what args points into
        self.biases = _checked(biases, count, hidden, inner)
        alpha, limit = clamped if clamped is not None else (0.0, 0.0)
        self.args = MoeArgs(
            router.data_ptr(),
            *self._arrays,
            count,
            top_k,
            hidden,
            inner,
            int(renormalize),
            *_pointers(self.biases),
            int(clamped is not None),
            alpha,
            limit,
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x [tokens, hidden]`` (float32) → the layer's output ``[tokens, hidden]``."""
        x = x.contiguous()
        require(x, torch.float32, "moe: x", dims=2)
        if x.shape[1] != self.hidden:
            raise KernelArgumentError(f"moe: x of {x.shape[1]} columns, not {self.hidden}")
        out = torch.empty_like(x)
        if not len(x):
            return out
        check_status(
            self.kernels.library.spnl_moe(
                self.args,
                x.data_ptr(),
                x.shape[0],
                out.data_ptr(),
                *scratch(self.scratch_bytes(x.shape[0])),
                self.kernels.threads,
                self.kernels.exact,
            ),
            "moe",
        )
        return out

    def scratch_bytes(self, tokens: int) -> int:
        """The working memory a call for ``tokens`` tokens takes."""
        nbytes = self.kernels.library.spnl_moe_scratch_bytes(self.args, tokens)
        if nbytes < 0:
            raise KernelArgumentError(f"moe: a call for {tokens} tokens")
        return nbytes


def _checked(biases: Biases | None, experts: int, hidden: int, inner: int) -> Biases | None:
    """The biases, each float32, contiguous and of its layer's shape (else refused)."""
    if biases is None:
        return None
    shapes = {"router": (experts,), "gate_up": (experts, 2 * inner), "down": (experts, hidden)}
    for name, shape in shapes.items():
        tensor = getattr(biases, name)
        require(tensor, torch.float32, f"moe: {name} bias", dims=len(shape))
        if tuple(tensor.shape) != shape or not tensor.is_contiguous():
            raise KernelArgumentError(
                f"moe: a {name} bias of shape {tuple(tensor.shape)}; contiguous {shape} expected"
            )
    return biases


def _pointers(biases: Biases | None) -> tuple[int | None, int | None, int | None]:
    if biases is None:
        return None, None, None
    return biases.router.data_ptr(), biases.gate_up.data_ptr(), biases.down.data_ptr()


def _array(calls: list[Products]):
    return (ProductsArgs * len(calls))(*(call.args for call in calls))
