"""What the C code relies on, checked before every call: a tensor's dtype, device,
contiguity and extents, a pool pair's shape, a step's key tables, a call's status."""

import torch
from gguf import GGMLQuantizationType

from ...errors import EngineError
from .abi import STATUS, TILED_FORMATS


class KernelArgumentError(EngineError):
    """A native kernel was about to be called with arguments that break its invariants
    (shapes, dtypes, strides, indices): the call is refused instead of reading or writing
    memory it does not own."""


def require(
    tensor: torch.Tensor,
    dtype: torch.dtype,
    what: str,
    *,
    dims: int | None = None,
    numel: int | None = None,
) -> None:
    """A tensor the C code may read as a flat array of ``dtype``: on the CPU, contiguous,
    of the expected dimensions and size (checked on every call, so kept cheap)."""
    if (
        tensor.dtype is dtype
        and tensor.is_cpu
        and tensor.is_contiguous()
        and (dims is None or tensor.dim() == dims)
        and (numel is None or tensor.numel() == numel)
    ):
        return
    raise KernelArgumentError(f"{what} is {_problem(tensor, dtype, dims, numel)}")


def _problem(tensor: torch.Tensor, dtype: torch.dtype, dims: int | None, numel: int | None) -> str:
    if not tensor.is_cpu:
        problem = f"on {tensor.device}"
    elif tensor.dtype is not dtype:
        problem = f"of {tensor.dtype}, not {dtype}"
    elif not tensor.is_contiguous():
        problem = "not contiguous"
    elif dims is not None and tensor.dim() != dims:
        problem = f"{tensor.dim()}-D, not {dims}-D"
    else:
        problem = f"of {tensor.numel()} elements, not {numel}"
    return f"{problem} (shape {tuple(tensor.shape)})"


def block_type(fmt: int) -> GGMLQuantizationType:
    """The GGML type whose blocks the kernels' format number ``fmt`` holds (a ValueError
    where none does)."""
    rows = {tiled: ggml for ggml, tiled in TILED_FORMATS.items()}
    return GGMLQuantizationType(rows.get(fmt, fmt))


def qtype_name(qtype: int) -> str:
    """A format number's name: GGML's, or its tiles'."""
    try:
        name = block_type(qtype).name
    except ValueError:
        return f"number {qtype} (unknown)"
    return f"{name} tiles" if qtype in TILED_FORMATS.values() else name


# The dtypes a float pool may hold: read back exactly, computed in float32.
POOL_DTYPES = (torch.float32, torch.float16)


def pool_row(key_cache: torch.Tensor, value_cache: torch.Tensor, what: str) -> int:
    """Elements per slot of a ``[blocks, block_size, kv_heads, head_dim]`` pool pair of
    float32 or float16."""
    dtype = key_cache.dtype if key_cache.dtype in POOL_DTYPES else torch.float32
    for tensor, name in ((key_cache, "key"), (value_cache, "value")):
        require(tensor, dtype, f"{what}: {name} cache", dims=4)
    if key_cache.shape != value_cache.shape:
        raise KernelArgumentError(f"{what}: key and value caches differ in shape")
    if key_cache.shape[-2] == 0 or key_cache.shape[-1] == 0:
        raise KernelArgumentError(f"{what}: caches of shape {tuple(key_cache.shape)} hold no key")
    return key_cache.shape[-2] * key_cache.shape[-1]


def check_keys(
    slots: torch.Tensor,
    lens: torch.Tensor,
    seqs: int,
    what: str,
    firsts: torch.Tensor | None = None,
) -> None:
    """The slot table ``[seqs, width]`` (rows contiguous), the lengths ``[seqs]`` and, where
    given, the first keys ``[seqs]`` (each checked against its length in C)."""
    if slots.dtype != torch.int64 or slots.dim() != 2 or slots.shape[0] != seqs:
        raise KernelArgumentError(f"{what}: slots of {slots.dtype} {tuple(slots.shape)}")
    if slots.device.type != "cpu" or slots.stride(1) != 1:
        raise KernelArgumentError(f"{what}: slots must be CPU rows of consecutive int64")
    require(lens, torch.int64, f"{what}: lengths", numel=seqs)
    if firsts is not None:
        require(firsts, torch.int64, f"{what}: first keys", numel=seqs)


def check_status(status: int, name: str) -> None:
    if status != 0:
        what = STATUS.get(status, f"failed with status {status}")
        raise KernelArgumentError(f"the CPU kernel {name} {what}")
