"""Weights into a model built on the meta device: renamed, split, checked, placed.

Text models read safetensors shards one tensor at a time; GGUF models read their
tensors from the memory-mapped file and dequantize them. Either way every tensor
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
from .gguf_config import hf_name
from .gguf_file import GGUFFile
from .progress import Progress

NamedTensors = Iterator[tuple[str, torch.Tensor]]
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
    names = list(gguf.tensors)
    for done, gguf_name in enumerate(names):
        progress("weights", done, len(names))
        name = hf_name(gguf_name, gguf.architecture)
        if name is None:
            continue
        tensor = gguf.load(gguf_name)
        if gguf.architecture == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_heads if "q_proj" in name else config.num_kv_heads
            tensor = unpermute_rows(tensor, heads)
        yield name, tensor
    progress("weights", len(names), len(names))


def unpermute_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order (pairs interleaved) back to rotate-half order."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:])
        .transpose(1, 2)
        .reshape(weight.shape)
    )


def split_fused(tensors: NamedTensors, config: ModelConfig) -> NamedTensors:
    """Phi-3 stores q/k/v and gate/up fused; the model keeps them apart."""
    q_size = config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    for name, tensor in tensors:
        if ".qkv_proj." in name:
            parts = torch.split(tensor, [q_size, kv_size, kv_size])
            for part, proj in zip(parts, ("q_proj", "k_proj", "v_proj"), strict=True):
                yield name.replace("qkv_proj", proj), part
        elif ".gate_up_proj." in name:
            gate, up = tensor.chunk(2)
            yield name.replace("gate_up_proj", "gate_proj"), gate
            yield name.replace("gate_up_proj", "up_proj"), up
        else:
            yield name, tensor


def load_into(
    model: nn.Module,
    tensors: NamedTensors,
    *,
    dtype: torch.dtype,
    device: torch.device,
    source: Path,
) -> None:
    """Fill every parameter of ``model`` (built on the meta device) from ``tensors``."""
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
        if tensor.shape != expected:
            raise ModelFileError(
                f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"the model expects {tuple(expected)}"
            )
        _set_parameter(model, name, tensor.to(device=device, dtype=dtype))
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ModelFileError(
            f"{source}: {len(missing)} weights are missing, e.g. " + ", ".join(missing[:5])
        )


def _set_parameter(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    setattr(module, attr, nn.Parameter(tensor, requires_grad=False))
