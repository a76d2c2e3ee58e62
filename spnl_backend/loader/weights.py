"""Weights into a model built on the meta device: renamed, split, checked, placed.

Text models read safetensors shards one tensor at a time (quantized as they stream past
with ISQ); GGUF models keep their quantized matrices as the file's blocks, mapped from
disk, and dequantize only their float tensors. Either way every tensor
is checked against the parameter it fills, and a missing, unexpected or
misshapen one is an error naming the file and the tensor.
"""

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from ..errors import ModelFileError
from ..models.config import ModelConfig
from ..quant.ggml import FLOAT_TYPES
from ..quant.linear import (
    Matmuls,
    QuantEmbedding,
    QuantizedWeight,
    QuantLinear,
    quantized_matmuls,
)
from .gguf_config import hf_name
from .gguf_file import GGUFFile
from .progress import Progress

NamedTensors = Iterator[tuple[str, "torch.Tensor | QuantizedWeight"]]
# Checkpoint tensors a text-only run does not use.
_SKIPPED_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)
_RENAMED_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    return sorted(model_dir.glob("*.safetensors"))


def read_safetensors(files: list[Path], progress: Progress) -> NamedTensors:
    for number, path in enumerate(files, 1):
        try:
            with safe_open(path, framework="pt") as f:
                names = list(f.keys())
                for done, name in enumerate(names):
                    progress(f"weights {number}/{len(files)}", done, len(names))
                    yield _renamed(name), _read_tensor(f, path, name)
                progress(f"weights {number}/{len(files)}", len(names), len(names))
        except SafetensorError as exc:
            raise ModelFileError(f"{path}: truncated or corrupt safetensors file: {exc}") from None


def _read_tensor(f: object, path: Path, name: str) -> torch.Tensor:
    try:
        return f.get_tensor(name)  # type: ignore[attr-defined]
    except SafetensorError as exc:
        raise ModelFileError(f"{path}: cannot read tensor {name!r}: {exc}") from None


def _renamed(name: str) -> str:
    for old, new in _RENAMED_PREFIXES:
        if name.startswith(old):
            return new + name.removeprefix(old)
    return name


def read_gguf(gguf: GGUFFile, config: ModelConfig, progress: Progress) -> NamedTensors:
    """The file's tensors under our names: float ones dequantized, quantized matrices kept
    as their blocks (views of the mapped file, no copy)."""
    names = list(gguf.tensors)
    for done, gguf_name in enumerate(names):
        progress("weights", done, len(names))
        name = hf_name(gguf_name, gguf.architecture)
        if name is None:
            continue
        info = gguf.tensors[gguf_name]
        tensor: torch.Tensor | QuantizedWeight
        if info.qtype in FLOAT_TYPES or len(info.shape) != 2:
            tensor = gguf.load(gguf_name)
        else:
            tensor = QuantizedWeight(
                gguf.raw(gguf_name).view(info.shape[0], -1), info.qtype, info.shape
            )
        if gguf.architecture == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_heads if "q_proj" in name else config.num_kv_heads
            tensor = unpermute_rows(tensor, heads)
        yield name, tensor
    progress("weights", len(names), len(names))


def unpermute_rows(
    weight: torch.Tensor | QuantizedWeight, heads: int
) -> torch.Tensor | QuantizedWeight:
    """Undo llama.cpp's q/k row order (pairs interleaved) back to rotate-half order; a
    quantized matrix moves whole rows of blocks."""
    data = weight.data if isinstance(weight, QuantizedWeight) else weight
    rows = data.shape[0]
    data = (
        data.reshape(heads, rows // heads // 2, 2, *data.shape[1:])
        .transpose(1, 2)
        .reshape(data.shape)
    )
    if isinstance(weight, QuantizedWeight):
        return QuantizedWeight(data, weight.qtype, weight.shape)
    return data


def split_fused(tensors: NamedTensors, config: ModelConfig) -> NamedTensors:
    """Phi-3 stores q/k/v and gate/up fused; the model keeps them apart."""
    q_size = config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    for name, tensor in tensors:
        if ".qkv_proj." in name:
            bounds = (0, q_size, q_size + kv_size, q_size + 2 * kv_size)
            for proj, start, end in zip(
                ("q_proj", "k_proj", "v_proj"), bounds, bounds[1:], strict=False
            ):
                yield name.replace("qkv_proj", proj), _rows(tensor, start, end)
        elif ".gate_up_proj." in name:
            half = tensor.shape[0] // 2
            yield name.replace("gate_up_proj", "gate_proj"), _rows(tensor, 0, half)
            yield name.replace("gate_up_proj", "up_proj"), _rows(tensor, half, 2 * half)
        else:
            yield name, tensor


def _rows(
    tensor: torch.Tensor | QuantizedWeight, start: int, end: int
) -> torch.Tensor | QuantizedWeight:
    return (
        tensor.rows(slice(start, end)) if isinstance(tensor, QuantizedWeight) else tensor[start:end]
    )


def load_into(
    model: nn.Module,
    tensors: NamedTensors,
    *,
    dtype: torch.dtype,
    device: torch.device,
    source: Path,
    matmuls: Matmuls = quantized_matmuls,
) -> None:
    """Fill every parameter of ``model`` (built on the meta device) from ``tensors``;
    quantized ones replace their layer with one that computes by ``matmuls``."""
    params = dict(model.named_parameters())
    tied = getattr(model.config, "tie_word_embeddings", False)
    for name, tensor in tensors:
        if name.startswith(_SKIPPED_PREFIXES) or name.endswith("rotary_emb.inv_freq"):
            continue
        if name == "lm_head.weight" and tied:
            continue
        if name not in params:
            raise ModelFileError(
                f"{source}: unexpected tensor {name!r}: the "
                f"{model.config.architecture} model has no such parameter"
            )
        expected = params[name].shape
        if tuple(tensor.shape) != tuple(expected):
            raise ModelFileError(
                f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"the model expects {tuple(expected)}"
            )
        if isinstance(tensor, QuantizedWeight):
            _set_quantized(model, name, tensor.to(device), dtype, source, matmuls)
        else:
            _set_parameter(model, name, tensor.to(device=device, dtype=dtype))
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ModelFileError(
            f"{source}: {len(missing)} weights are missing, e.g. " + ", ".join(missing[:5])
        )


def _set_quantized(
    model: nn.Module,
    name: str,
    weight: QuantizedWeight,
    dtype: torch.dtype,
    source: Path,
    matmuls: Matmuls,
) -> None:
    """Swap the float layer that ``name`` belongs to for its quantized counterpart."""
    module_name = name.removesuffix(".weight")
    module = model.get_submodule(module_name)
    if isinstance(module, nn.Embedding):
        replacement: nn.Module = QuantEmbedding(weight, dtype, matmuls)
    elif isinstance(module, nn.Linear):
        replacement = QuantLinear(weight, matmuls=matmuls)
        replacement.bias = module.bias  # filled in by its own tensor, if it has one
    else:
        raise ModelFileError(
            f"{source}: tensor {name!r} is quantized ({weight.qtype.name}) "
            "but belongs to neither a projection nor an embedding"
        )
    parent, _, attr = module_name.rpartition(".")
    setattr(model.get_submodule(parent), attr, replacement)


def _set_parameter(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    setattr(module, attr, nn.Parameter(tensor, requires_grad=False))
