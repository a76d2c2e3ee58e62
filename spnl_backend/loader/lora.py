"""PEFT LoRA adapter directories (``adapter_config.json`` + ``adapter_model.safetensors``)
read and checked against the base model they are to run on.

What runs: plain LoRA on the attention and dense MLP projections (``q_proj`` ... ``down_proj``,
or ``all-linear``), with ``lora_alpha / r`` or, with ``use_rslora``, ``lora_alpha /
sqrt(r)`` as the scale. Everything else an adapter may carry (DoRA, trained biases,
modules saved whole, embedding or head targets, per-layer ranks or alphas) is refused by
name: running it without its effect would give wrong output silently.
"""

import hashlib
import json
import math
import re
from pathlib import Path

import torch

from ..errors import ModelFileError
from ..kernels.lora_ref import LoraPair
from ..log import get_logger
from ..models.arch import family
from ..models.linear import Linear
from ..models.lora import LoraAdapter
from ..models.transformer import CausalLM
from ..quant.linear import QuantLinear
from .resolve import unreadable
from .weights import _checked, _layout, _opened, _read_tensor

log = get_logger()

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# Our projections an adapter may target, by the name PEFT matches.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Fused projections of checkpoints (Phi-3) that the model keeps apart: their parts, in
# the order of their output rows. An adapter's lora_B is split the same way; lora_A is
# shared by the parts.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_TENSOR = re.compile(r"base_model\.model\.(model\.layers\.\d+\.\w+\.(\w+))\.lora_([AB])\.weight")
# Fields that change what the adapter computes and that this does not run: (field, what
# is accepted) where set to anything but off/empty.
_REFUSED = {
    "use_dora": "false (DoRA's magnitude vectors are not run)",
    "modules_to_save": "null or [] (modules saved whole are not loaded)",
    "rank_pattern": "{} (one rank for every module)",
    "alpha_pattern": "{} (one lora_alpha for every module)",
    "layers_pattern": "null",
    "layer_replication": "null",
    "lora_bias": "false (trained biases on lora_B are not run)",
    "trainable_token_indices": "null",
    "target_parameters": "null or [] (expert parameters are not adapted)",
    "use_qalora": "false",
}


def read_adapter(name: str, path: str | Path, model: CausalLM) -> LoraAdapter:
    """The adapter in directory ``path``, its matrices float32 on their projections'
    devices; a `ModelFileError` naming the file and field or tensor where it does not fit
    ``model`` or asks for what is not run."""
    directory = Path(path).expanduser()
    config = _read_config(directory / CONFIG_FILE)
    rank, scale = _rank_and_scale(config, directory / CONFIG_FILE)
    targets = _targets(config, directory / CONFIG_FILE)
    weights = directory / WEIGHTS_FILE
    pairs = _pairs(weights, model, rank, scale, targets, config.get("layers_to_transform"))
    root = _root(weights, scale)
    log.info("lora.loaded", adapter=name, path=str(directory), rank=rank, modules=len(pairs))
    return LoraAdapter(name, str(directory), rank, scale, root, pairs)


def _read_config(path: Path) -> dict:
    try:
        config = json.loads(path.read_text())
    except OSError as exc:
        raise unreadable(path, exc) from None
    except ValueError as exc:
        raise ModelFileError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ModelFileError(f"{path}: expected a JSON object")
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise ModelFileError(f"{path}: peft_type is {kind!r}; only 'LORA' adapters run")
    for key, accepted in _REFUSED.items():
        if config.get(key):
            raise ModelFileError(
                f"{path}: {key} = {config[key]!r} is not supported; accepted: {accepted}"
            )
    if config.get("bias", "none") != "none":
        raise ModelFileError(
            f"{path}: bias = {config['bias']!r} is not supported; accepted: 'none'"
        )
    # fan_in_fan_out only says how PEFT merges into a transposed base weight: lora_A and
    # lora_B are stored as [r, in] and [out, r] either way, so the product is the same.
    if not isinstance(config.get("fan_in_fan_out", False), bool):
        raise ModelFileError(f"{path}: fan_in_fan_out must be true or false")
    return config


def _rank_and_scale(config: dict, path: Path) -> tuple[int, float]:
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if type(rank) is not int or rank < 1:
        raise ModelFileError(f"{path}: r = {rank!r}; expected an integer >= 1")
    if type(alpha) not in (int, float) or not math.isfinite(alpha):
        raise ModelFileError(f"{path}: lora_alpha = {alpha!r}; expected a finite number")
    rslora = config.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise ModelFileError(f"{path}: use_rslora = {rslora!r}; expected true or false")
    return rank, alpha / (math.sqrt(rank) if rslora else rank)


def _targets(config: dict, path: Path) -> frozenset[str]:
    """The projection names the adapter may hold tensors for."""
    targets, known = config.get("target_modules"), (*TARGETS, *FUSED)
    if targets == "all-linear":
        return frozenset(known)
    if isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets):
        unknown = sorted(set(targets) - set(known))
        if unknown:
            raise ModelFileError(
                f"{path}: target_modules names {', '.join(unknown)}, which are not adapted "
                f"here; accepted: {', '.join(known)} or 'all-linear' (embeddings and the LM "
                "head are not)"
            )
        return frozenset(targets)
    raise ModelFileError(
        f"{path}: target_modules = {targets!r}; expected a list of module names "
        f"({', '.join(known)}) or 'all-linear' (a regular expression is not accepted)"
    )


def _pairs(
    path: Path,
    model: CausalLM,
    rank: int,
    scale: float,
    targets: frozenset[str],
    layers: object,
) -> dict[str, LoraPair]:
    tensors = _read_tensors(path)
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _TENSOR.fullmatch(key)
        if match is None:
            raise ModelFileError(
                f"{path}: tensor {key!r} is not a LoRA matrix of a projection "
                "(base_model.model.model.layers.N.<self_attn|mlp>.<proj>.lora_A|lora_B.weight); "
                "embeddings, the LM head, DoRA magnitudes and biases are not run"
            )
        module, target, side = match.groups()
        if target not in targets:
            raise ModelFileError(
                f"{path}: tensor {key!r} adapts {target}, which target_modules does not name"
            )
        found.setdefault(module, {})[side] = tensor
    if not found:
        raise ModelFileError(f"{path}: holds no LoRA matrices")
    pairs: dict[str, LoraPair] = {}
    for module, sides in found.items():
        for part, part_sides in _unfused(path, model, module, sides):
            if part in pairs:
                raise ModelFileError(f"{path}: {part} is adapted twice (fused and apart)")
            pairs[part] = _pair(path, model, part, part_sides, rank, scale, layers)
    return pairs


def _unfused(
    path: Path, model: CausalLM, module: str, sides: dict[str, torch.Tensor]
) -> list[tuple[str, dict[str, torch.Tensor]]]:
    """``module``'s matrices, or for a fused projection each part's: the same lora_A,
    and the rows of lora_B that give that part's outputs."""
    stem, _, fused = module.rpartition(".")
    if fused not in FUSED:
        return [(module, sides)]
    if "A" not in sides or "B" not in sides:
        return [(module, sides)]  # `_pair` names the missing half
    names = [f"{stem}.{part}" for part in FUSED[fused]]
    rows = [getattr(_projection(path, model, name), "out_features", 0) for name in names]
    b = sides["B"]
    if b.shape[0] != sum(rows):
        raise ModelFileError(
            f"{path}: tensor base_model.model.{module}.lora_B.weight has {b.shape[0]} rows; "
            f"the base model's {', '.join(FUSED[fused])} have {' + '.join(map(str, rows))}"
        )
    parts, start = [], 0
    for name, count in zip(names, rows, strict=True):
        parts.append((name, {"A": sides["A"], "B": b[start : start + count]}))
        start += count
    return parts


def _projection(path: Path, model: CausalLM, module: str) -> Linear | QuantLinear:
    try:
        target = model.get_submodule(module)
    except AttributeError:
        target = None
    if not isinstance(target, (Linear, QuantLinear)):
        raise ModelFileError(
            f"{path}: {module} is not a projection of the {model.config.architecture} model "
            f"({model.config.num_layers} layers); the adapter is for another base model"
        )
    return target


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    with _opened(path) as f:
        names = list(f.keys())
    layout = _layout(path)
    tensors = {}
    for name in names:
        tensors[name] = _read_tensor(path, layout, name)
        _checked(tensors[name], path, name)  # float and finite
    return tensors


def _pair(
    path: Path,
    model: CausalLM,
    module: str,
    sides: dict[str, torch.Tensor],
    rank: int,
    scale: float,
    layers: object,
) -> LoraPair:
    for side in "AB":
        if side not in sides:
            raise ModelFileError(f"{path}: {module} has no lora_{side}.weight")
    layer = int(module.split(".")[2])
    if isinstance(layers, list) and layer not in layers:
        raise ModelFileError(
            f"{path}: {module} adapts layer {layer}, which layers_to_transform leaves out"
        )
    target = _projection(path, model, module)
    a, b = sides["A"], sides["B"]
    want_a, want_b = (rank, target.in_features), (target.out_features, rank)
    for side, tensor, want in (("A", a, want_a), ("B", b, want_b)):
        if tuple(tensor.shape) != want:
            raise ModelFileError(
                f"{path}: tensor base_model.model.{module}.lora_{side}.weight has shape "
                f"{tuple(tensor.shape)}; r = {rank} and the base model's projection needs {want}"
            )
    device = _device_of(target)
    b = family(model.config.architecture).projection_rows(f"{module}.weight", b, model.config)
    return LoraPair(a.float().to(device), b.float().to(device), scale)


def _device_of(module: torch.nn.Module) -> torch.device:
    if isinstance(module, QuantLinear):
        return module.weight_q.data.device
    return module.weight.device


def _root(path: Path, scale: float) -> int:
    """The adapter's prefix-cache root: its weights' bytes and its scale, so a changed
    file or scale never reads K/V computed with another."""
    digest = hashlib.blake2b(digest_size=8, person=b"spnl-lora")
    try:
        with path.open("rb") as file:
            while chunk := file.read(1 << 20):
                digest.update(chunk)
    except OSError as exc:
        raise unreadable(path, exc) from None
    digest.update(repr(scale).encode())
    return int.from_bytes(digest.digest(), "little") or 1
