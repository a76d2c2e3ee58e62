"""Weights into a model built on the meta device: renamed, split, checked, placed.

Text models read safetensors shards one tensor at a time (quantized as they stream past
with ISQ); GGUF models keep their quantized matrices as the file's blocks, read into
memory of their own, and dequantize only their float tensors. Either way every tensor
is checked against the parameter it fills, and a missing, unexpected or
misshapen one is an error naming the file and the tensor. So is a weight holding NaN or
infinity: such a model can only produce NaN logits, so it is refused at load.
"""

import json
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from ..errors import ModelFileError
from ..kernels.dispatch import KernelChoice
from ..memory import host_tensor
from ..models.arch import checkpoint_prefixes, family_of_gguf
from ..models.arch.family import pairs_to_halves
from ..models.config import ModelConfig
from ..models.transformer import CausalLM
from ..quant.ggml import FLOAT_TYPES, nonfinite_scales
from ..quant.linear import QuantEmbedding, QuantizedWeight, QuantLinear
from .gguf_config import hf_name
from .gguf_file import GGUFFile
from .progress import Progress
from .resolve import unreadable

NamedTensors = Iterator[tuple[str, "torch.Tensor | QuantizedWeight"]]
# Checkpoint tensors a text-only run does not use.
_SKIPPED_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
    "model.visual.",  # Qwen3.5's vision model
    "vision_model.",  # Llama 4's
    "mtp.",  # Qwen3.5's multi-token prediction layers
)
_RENAMED_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_MIXTRAL_EXPERT = re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.(.+)")
_MIXTRAL_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_STACKED_EXPERTS = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(gate|up|down)_proj\.weight")


def safetensors_files(model_dir: Path) -> list[Path]:
    """The shards: those the index names (each must exist), else every ``*.safetensors``."""
    index = model_dir / "model.safetensors.index.json"
    if not index.exists():
        return sorted(model_dir.glob("*.safetensors"))
    shards = sorted(set(_weight_map(index).values()))
    missing = [name for name in shards if not (model_dir / name).is_file()]
    if missing:
        raise ModelFileError(
            f"{index}: names {len(missing)} shard(s) that are not in the directory: "
            + ", ".join(missing[:5])
        )
    return [model_dir / name for name in shards]


def _weight_map(index: Path) -> dict[str, str]:
    try:
        content: Any = json.loads(index.read_bytes())
    except OSError as exc:
        raise unreadable(index, exc) from None
    except (ValueError, RecursionError) as exc:  # JSON and UTF-8 errors; absurd nesting
        raise ModelFileError(f"{index}: not valid JSON: {exc}") from None
    weight_map = content.get("weight_map") if isinstance(content, dict) else None
    if not (
        isinstance(weight_map, dict)
        and weight_map
        and all(isinstance(v, str) and v for v in weight_map.values())
    ):
        raise ModelFileError(
            f"{index}: expected an object whose 'weight_map' maps each tensor name to a "
            "shard file name in this directory"
        )
    return weight_map


def safetensors_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Every tensor's name (as the model calls it) and shape, from the shards' headers."""
    shapes = {}
    for path in files:
        with open_safetensors(path) as f:
            for name in list(f.keys()):
                shapes[_renamed(name)] = tuple(f.get_slice(name).get_shape())
    return shapes


def layer_indices(names: Iterable[str]) -> set[int]:
    """The decoder layers that ``names`` (our parameter names) hold tensors for."""
    return {int(m[1]) for name in names if (m := _LAYER.match(name))}


def read_safetensors(
    files: list[Path],
    progress: Progress,
    packed: tuple[str, ...] = (),
    unused: tuple[str, ...] = (),
    rename: bool = True,
) -> NamedTensors:
    """Every tensor the model uses, checked: a float type, and finite; those whose names end
    with one of ``packed`` (a quantized checkpoint's blocks and scales,
    `Family.quant_methods`) as stored, for the family to check and unpack; those ending
    with one of ``unused`` (`Family.hf_unused`) left unread. The data is read
    into tensors of their own, not mapped: a file truncated under the process would
    otherwise kill it (SIGBUS) at the next read of a weight. ``rename``: multimodal and
    Mixtral names made ours (False: as stored, for transformers' own modules)."""
    for number, path in enumerate(files, 1):
        with open_safetensors(path) as f:  # safetensors checks the header's layout
            names = list(f.keys())
            if rename:
                names = [n for n in names if not _skipped(_renamed(n), unused)]
        layout = safetensors_layout(path)
        for done, name in enumerate(names):
            progress(f"weights {number}/{len(files)}", done, len(names))
            tensor = read_tensor(path, layout, name)
            if not (packed and name.endswith(packed)):
                check_float(tensor, path, name)
            yield _renamed(name) if rename else name, tensor
        progress(f"weights {number}/{len(files)}", len(names), len(names))


@contextmanager
def open_safetensors(path: Path) -> Iterator[Any]:
    """``safe_open`` whose failures name the file: the OS's reason where it cannot be read
    (safetensors reports every open failure as "No such file"), else what is corrupt."""
    try:
        with path.open("rb"):
            pass
        handle = safe_open(path, framework="pt")
    except OSError as exc:
        raise unreadable(path, exc) from None
    except SafetensorError as exc:
        raise ModelFileError(f"{path}: truncated or corrupt safetensors file: {exc}") from None
    with handle as f:
        yield f


_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def safetensors_layout(path: Path) -> tuple[int, dict[str, Any]]:
    """Where the data starts, and the header's entry of each tensor (already checked by
    safetensors itself: dtypes, shapes and offsets that agree)."""
    try:
        with path.open("rb") as file:
            length = int.from_bytes(file.read(8), "little")
            header = json.loads(file.read(length))
    except OSError as exc:
        raise unreadable(path, exc) from None
    except (ValueError, RecursionError) as exc:
        raise ModelFileError(f"{path}: corrupt safetensors header: {exc}") from None
    return 8 + length, header


def read_tensor(path: Path, layout: tuple[int, dict[str, Any]], name: str) -> torch.Tensor:
    """Tensor ``name`` of the safetensors file ``path`` (its `safetensors_layout`), read
    into memory of its own; a short read names the file and the tensor."""
    start, header = layout
    entry = header[name]
    dtype = _DTYPES.get(entry["dtype"])
    if dtype is None:
        raise ModelFileError(
            f"{path}: tensor {name!r} is stored as {entry['dtype']}; expected a floating-point type"
        )
    begin, end = entry["data_offsets"]
    tensor = host_tensor(tuple(entry["shape"]), dtype)
    target = tensor.reshape(-1).view(torch.uint8).numpy()
    try:
        with path.open("rb") as file:
            file.seek(start + begin)
            got = file.readinto(memoryview(target))
    except OSError as exc:
        raise unreadable(path, exc) from None
    if got != end - begin or target.nbytes != end - begin:
        raise ModelFileError(
            f"{path}: tensor {name!r}: read {got:,} of {end - begin:,} bytes; the file was "
            "truncated or changed while loading"
        )
    return tensor


def read_checked(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file (an adapter's), each checked: float and finite."""
    with open_safetensors(path) as f:
        names = list(f.keys())
    layout = safetensors_layout(path)
    tensors = {}
    for name in names:
        tensors[name] = read_tensor(path, layout, name)
        check_float(tensors[name], path, name)
    return tensors


def check_float(tensor: torch.Tensor, path: Path, name: str) -> None:
    """Refuse a weight that is not floating-point or not finite, naming file and tensor."""
    if not tensor.dtype.is_floating_point:
        raise ModelFileError(
            f"{path}: tensor {name!r} is stored as {str(tensor.dtype).removeprefix('torch.')}; "
            "expected a floating-point type"
        )
    check_finite(tensor, path, name)


def check_finite(tensor: torch.Tensor, path: Path, name: str) -> None:
    """Refuse a weight holding NaN or infinity (one vectorised pass; counted only when
    there are some)."""
    if bool(torch.isfinite(tensor).all()):
        return
    bad = int((~torch.isfinite(tensor)).sum())
    raise ModelFileError(
        f"{path}: tensor {name!r} holds {bad:,} non-finite values (NaN or infinity) among "
        f"{tensor.numel():,}; a model with such weights computes NaN, so it is refused"
    )


def _check_finite_blocks(weight: QuantizedWeight, path: Path, name: str) -> None:
    bad = nonfinite_scales(weight.data, weight.qtype)
    if bad:
        raise ModelFileError(
            f"{path}: tensor {name!r} holds {bad:,} non-finite {weight.qtype.name} block "
            "scales (NaN or infinity); a model with such weights computes NaN, so it is refused"
        )


def _skipped(name: str, unused: tuple[str, ...]) -> bool:
    return name.startswith(_SKIPPED_PREFIXES) or name.endswith(unused)


def _renamed(name: str) -> str:
    for old, new in (*_RENAMED_PREFIXES, *checkpoint_prefixes()):
        if name.startswith(old):
            name = new + name.removeprefix(old)
            break
    match = _MIXTRAL_EXPERT.fullmatch(name)
    if match:  # Mixtral's names for the gated MLP's three projections
        layer, rest = match.groups()
        name = f"model.layers.{layer}.mlp.{rest}"
        for old, new in _MIXTRAL_PROJECTIONS.items():
            name = name.replace(f".{old}.", f".{new}.")
    return name


def read_gguf(gguf: GGUFFile, config: ModelConfig, progress: Progress) -> NamedTensors:
    """The file's tensors under our names: float ones dequantized, quantized matrices kept
    as their blocks."""
    names = list(gguf.tensors)
    found = family_of_gguf(gguf.architecture)  # llama.cpp's NORM-rope layout for q and k
    permuted = found is not None and found.gguf_permuted_qk
    for done, gguf_name in enumerate(names):
        progress("weights", done, len(names))
        name = hf_name(gguf_name, gguf.architecture, gguf.path, config.num_layers)
        if name is None:
            continue
        info = gguf.tensors[gguf_name]
        if _STACKED_EXPERTS.fullmatch(name):
            yield from _gguf_experts(gguf, gguf_name, name)
            continue
        tensor: torch.Tensor | QuantizedWeight
        if info.qtype in FLOAT_TYPES or len(info.shape) != 2:
            tensor = gguf.load(gguf_name)
            check_finite(tensor, gguf.path, gguf_name)
        else:
            tensor = QuantizedWeight(
                gguf.raw(gguf_name).view(info.shape[0], -1), info.qtype, info.shape
            )
            _check_finite_blocks(tensor, gguf.path, gguf_name)
        if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_heads if "q_proj" in name else config.num_kv_heads
            _check_rows(tensor, heads * config.head_dim, gguf.path, gguf_name)
            tensor = unpermute_rows(tensor, heads)
        yield name, tensor
    progress("weights", len(names), len(names))


def _gguf_experts(gguf: GGUFFile, gguf_name: str, name: str) -> NamedTensors:
    """A stacked expert tensor ``[E, rows, columns]`` as each expert's projection: the
    quantized ones as their own blocks (each expert's rows are one contiguous run of the
    data), the float ones as slices."""
    info = gguf.tensors[gguf_name]
    if len(info.shape) != 3:
        raise ModelFileError(
            f"{gguf.path}: tensor {gguf_name!r} has shape {info.shape}; expected "
            "[experts, rows, columns]"
        )
    experts, rows, cols = info.shape
    stem, _, proj = name.removesuffix(".weight").rpartition(".")
    if info.qtype in FLOAT_TYPES:
        stacked = gguf.load(gguf_name)
        check_finite(stacked, gguf.path, gguf_name)
        for expert, weight in enumerate(stacked.unbind(0)):
            yield f"{stem}.{expert}.{proj}.weight", weight
        return
    blocks = gguf.raw(gguf_name).view(experts * rows, -1)
    for expert in range(experts):
        weight = QuantizedWeight(
            blocks[expert * rows : (expert + 1) * rows], info.qtype, (rows, cols)
        )
        _check_finite_blocks(weight, gguf.path, gguf_name)
        yield f"{stem}.{expert}.{proj}.weight", weight


def _check_rows(tensor: torch.Tensor | QuantizedWeight, rows: int, path: Path, name: str) -> None:
    """A q/k matrix's rows before they are regrouped by head (which needs them whole)."""
    if len(tensor.shape) != 2 or tensor.shape[0] != rows:
        raise ModelFileError(
            f"{path}: tensor {name!r} has shape {tuple(tensor.shape)}; the model expects "
            f"{rows} rows (heads x head size)"
        )


def unpermute_rows(
    weight: torch.Tensor | QuantizedWeight, heads: int
) -> torch.Tensor | QuantizedWeight:
    """Undo llama.cpp's q/k row order (pairs interleaved) back to rotate-half order; a
    quantized matrix moves whole rows of blocks."""
    return pairs_to_halves(weight, heads)


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
        elif name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            yield from _split_experts(name, tensor)
        else:
            yield name, tensor


def _split_experts(
    name: str, tensor: torch.Tensor | QuantizedWeight
) -> Iterator[tuple[str, torch.Tensor]]:
    """transformers' fused experts (``experts.gate_up_proj [E, 2I, H]``, gate rows first;
    ``experts.down_proj [E, H, I]``) as each expert's own projections."""
    if isinstance(tensor, QuantizedWeight) or tensor.dim() != 3:
        raise ModelFileError(f"tensor {name!r}: expected a float [experts, rows, columns] stack")
    stem = name.rpartition(".")[0]
    for expert, weight in enumerate(tensor.unbind(0)):
        if name.endswith("gate_up_proj"):
            half = weight.shape[0] // 2
            yield f"{stem}.{expert}.gate_proj.weight", weight[:half]
            yield f"{stem}.{expert}.up_proj.weight", weight[half:]
        else:
            yield f"{stem}.{expert}.down_proj.weight", weight


def _rows(
    tensor: torch.Tensor | QuantizedWeight, start: int, end: int
) -> torch.Tensor | QuantizedWeight:
    return (
        tensor.rows(slice(start, end)) if isinstance(tensor, QuantizedWeight) else tensor[start:end]
    )


def load_into(
    model: CausalLM,
    tensors: NamedTensors,
    *,
    dtype: torch.dtype,
    device: torch.device,
    source: Path,
    device_of: Callable[[str], torch.device] | None = None,
) -> None:
    """Fill every parameter of ``model`` (built on the meta device) from ``tensors``;
    quantized ones replace their layer with one that computes on the model's kernels
    (`CausalLM.kernels`). Each goes
    to ``device``, or to ``device_of(name)`` where given (layer mapping)."""
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
        target = device if device_of is None else device_of(name)
        if isinstance(tensor, QuantizedWeight):
            _set_quantized(model, name, tensor.to(target), dtype, source, model.kernels)
        else:
            _set_parameter(model, name, tensor.to(device=target, dtype=dtype))
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
    kernels: KernelChoice,
) -> None:
    """Swap the float layer that ``name`` belongs to for its quantized counterpart."""
    module_name = name.removesuffix(".weight")
    module = model.get_submodule(module_name)
    if isinstance(module, nn.Embedding):
        replacement: nn.Module = QuantEmbedding(weight, dtype, kernels)
    elif isinstance(module, nn.Linear):
        replacement = QuantLinear(weight, matmuls=kernels.matmuls)
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
