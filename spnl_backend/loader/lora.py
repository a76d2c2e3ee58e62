"""LoRA adapters read and checked against the base model they are to run on: PEFT
directories (``adapter_config.json`` + ``adapter_model.safetensors``) and GGUF adapter
files as llama.cpp's ``convert_lora_to_gguf.py`` writes them.

What runs: plain LoRA on the attention and dense MLP projections (``q_proj`` ... ``down_proj``,
or ``all-linear``), with ``lora_alpha / r`` or, with ``use_rslora``, ``lora_alpha /
sqrt(r)`` as the scale. Everything else an adapter may carry (DoRA, trained biases,
modules saved whole, embedding or head targets, per-layer ranks or alphas) is refused by
name: running it without its effect would give wrong output silently.
"""

import functools
import hashlib
import json
import math
import re
from collections.abc import Callable
from pathlib import Path

import torch

from ..errors import ModelFileError
from ..kernels.lora_ref import LoraPair
from ..log import get_logger
from ..models.arch import family, family_of_gguf
from ..models.config import ModelConfig
from ..models.linear import Linear
from ..models.lora import LoraAdapter
from ..models.transformer import CausalLM
from ..quant.linear import QuantLinear
from .gguf_config import hf_name
from .gguf_file import GGUFFile, describe_value
from .resolve import unreadable
from .weights import check_finite, read_checked, unpermute_rows

log = get_logger()

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# Our projections an adapter may target, by the name PEFT matches.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Fused projections of checkpoints (Phi-3) that the model keeps apart: their parts, in
# the order of their output rows. An adapter's lora_B is split the same way; lora_A is
# shared by the parts.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# The name a module's lora_A ("A") or lora_B ("B") has in the adapter's file.
Label = Callable[[str, str], str]
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
    """The adapter at ``path`` (a PEFT directory, or a GGUF adapter file), its matrices
    float32 on their projections' devices; a `ModelFileError` naming the file and field or
    tensor where it does not fit ``model`` or asks for what is not run."""
    directory = Path(path).expanduser()
    if directory.is_file():
        if directory.name in (CONFIG_FILE, WEIGHTS_FILE):
            raise ModelFileError(
                f"{directory}: a PEFT adapter is read from its directory ({CONFIG_FILE} "
                f"beside {WEIGHTS_FILE}): give {directory.parent}"
            )
        return _read_gguf(name, directory, model)
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
    tensors = read_checked(path)
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
    return _checked_pairs(path, model, found, _peft_label, lambda _: scale, rank, layers)


def _peft_label(module: str, side: str) -> str:
    return f"base_model.model.{module}.lora_{side}.weight"


def _checked_pairs(
    path: Path,
    model: CausalLM,
    found: dict[str, dict[str, torch.Tensor]],
    label: Label,
    scale_of: Callable[[int], float],
    rank: int | None,
    layers: object = None,
) -> dict[str, LoraPair]:
    """Each module's (A, B) checked against the projection it adapts (a fused one's parts
    apart); ``rank`` None takes each pair's own from its lora_A (GGUF)."""
    if not found:
        raise ModelFileError(f"{path}: holds no LoRA matrices")
    pairs: dict[str, LoraPair] = {}
    for module, sides in found.items():
        named = functools.partial(label, module)
        for part, part_sides in _unfused(path, model, module, sides, named):
            if part in pairs:
                raise ModelFileError(f"{path}: {part} is adapted twice (fused and apart)")
            pairs[part] = _pair(path, model, part, part_sides, rank, scale_of, layers, named)
    return pairs


def _unfused(
    path: Path,
    model: CausalLM,
    module: str,
    sides: dict[str, torch.Tensor],
    named: Callable[[str], str],
) -> list[tuple[str, dict[str, torch.Tensor]]]:
    """``module``'s matrices, or for a fused projection each part's: the same lora_A,
    and the rows of lora_B that give that part's outputs."""
    stem, _, fused = module.rpartition(".")
    if fused not in FUSED:
        return [(module, sides)]
    if "A" not in sides or "B" not in sides:
        return [(module, sides)]  # `_pair` names the missing half
    names = [f"{stem}.{part}" for part in FUSED[fused]]
    rows = [_features(model, name, _projection(path, model, name))[1] for name in names]
    b = sides["B"]
    if b.shape[0] != sum(rows):
        raise ModelFileError(
            f"{path}: tensor {named('B')} has {b.shape[0]} rows; "
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


def _pair(
    path: Path,
    model: CausalLM,
    module: str,
    sides: dict[str, torch.Tensor],
    rank: int | None,
    scale_of: Callable[[int], float],
    layers: object,
    named: Callable[[str], str],
) -> LoraPair:
    for side in "AB":
        if side not in sides:
            raise ModelFileError(f"{path}: {module} has no {named(side)}")
    layer = int(module.split(".")[2])
    if isinstance(layers, list) and layer not in layers:
        raise ModelFileError(
            f"{path}: {module} adapts layer {layer}, which layers_to_transform leaves out"
        )
    target = _projection(path, model, module)
    a, b = sides["A"], sides["B"]
    if rank is None:  # the file's own (GGUF): lora_A's rows
        rank = a.shape[0] if a.dim() == 2 else 0
        if rank < 1:
            raise ModelFileError(
                f"{path}: tensor {named('A')} has shape {tuple(a.shape)}; expected "
                "[rank >= 1, inputs]"
            )
    inputs, outputs = _features(model, module, target)
    want_a, want_b = (rank, inputs), (outputs, rank)
    for side, tensor, want in (("A", a, want_a), ("B", b, want_b)):
        if tuple(tensor.shape) != want:
            raise ModelFileError(
                f"{path}: tensor {named(side)} has shape "
                f"{tuple(tensor.shape)}; r = {rank} and the base model's projection needs {want}"
            )
    device = _device_of(target)
    config = _whole_config(model)
    b = family(config.architecture).projection_rows(f"{module}.weight", b, config)
    return LoraPair(a.float().to(device), b.float().to(device), scale_of(rank))


def _whole_config(model: CausalLM) -> ModelConfig:
    """The whole model's config (under tensor parallelism ``model`` is one rank's share:
    an adapter is read whole, and each rank takes its share as it attaches)."""
    return model.config if model.tp is None else model.tp.whole_config


def _features(model: CausalLM, module: str, target: Linear | QuantLinear) -> tuple[int, int]:
    """The whole model's (inputs, outputs) of projection ``module``."""
    if model.tp is None:
        return target.in_features, target.out_features
    return model.tp.whole_features(module, target.in_features, target.out_features)


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


def _read_gguf(name: str, path: Path, model: CausalLM) -> LoraAdapter:
    """A GGUF LoRA adapter (``general.type = adapter``, ``adapter.type = lora``): each
    projection's ``<tensor>.lora_a [r, in]`` and ``.lora_b [out, r]``, scaled as llama.cpp
    scales them (``adapter.lora.alpha / r``, or 1 where alpha is 0 or absent). llama.cpp's
    q/k row order is undone on lora_b, as on a GGUF base's q and k."""
    gguf = GGUFFile(path)
    alpha = _gguf_header(gguf, model)
    arch = gguf.architecture
    permuted = getattr(family_of_gguf(arch), "gguf_permuted_qk", False)
    found: dict[str, dict[str, torch.Tensor]] = {}
    stems: dict[str, str] = {}
    for gguf_name, info in gguf.tensors.items():
        stem, _, side = gguf_name.rpartition(".")
        if side not in ("lora_a", "lora_b"):
            raise ModelFileError(
                f"{path}: tensor {gguf_name!r} is not a LoRA matrix (<tensor>.lora_a or "
                ".lora_b); norms or other tensors merged into an adapter are not run"
            )
        module = _gguf_module(path, model, gguf_name, stem, arch)
        if len(info.shape) != 2:
            raise ModelFileError(
                f"{path}: tensor {gguf_name!r} has shape {info.shape}; expected a matrix "
                "(experts' stacked adapters are not run)"
            )
        tensor = gguf.load(gguf_name)
        check_finite(tensor, path, gguf_name)
        if permuted and side == "lora_b" and module.endswith(("q_proj", "k_proj")):
            config = _whole_config(model)
            heads = config.num_heads if module.endswith("q_proj") else config.num_kv_heads
            if tensor.shape[0] != heads * config.head_dim:
                raise ModelFileError(
                    f"{path}: tensor {gguf_name!r} has shape {tuple(tensor.shape)}; the base "
                    f"model's {module} has {heads * config.head_dim} rows"
                )
            tensor = unpermute_rows(tensor, heads)
        found.setdefault(module, {})["A" if side == "lora_a" else "B"] = tensor
        stems[module] = stem

    def label(module: str, side: str) -> str:
        return f"{stems[module]}.lora_{side.lower()}"

    def scale_of(rank: int) -> float:
        return alpha / rank if alpha else 1.0

    pairs = _checked_pairs(path, model, found, label, scale_of, None)
    rank = max(p.a.shape[0] for p in pairs.values())
    log.info("lora.loaded", adapter=name, path=str(path), rank=rank, modules=len(pairs))
    return LoraAdapter(name, str(path), rank, scale_of(rank), _root(path, alpha), pairs)


def _gguf_header(gguf: GGUFFile, model: CausalLM) -> float:
    """The file's LoRA alpha, once its type and architecture are checked against ``model``."""
    path, meta = gguf.path, gguf.metadata
    kind, adapter_type = meta.get("general.type"), meta.get("adapter.type")
    if not isinstance(kind, str) or kind != "adapter":
        raise ModelFileError(
            f"{path}: general.type is {describe_value(kind)}; a LoRA adapter file has "
            "'adapter' (a model file is loaded as the model, not as an adapter)"
        )
    if not isinstance(adapter_type, str) or adapter_type != "lora":
        raise ModelFileError(
            f"{path}: adapter.type is {describe_value(adapter_type)}; only 'lora' adapters run"
        )
    if meta.get("adapter.alora_invocation_tokens") is not None:
        raise ModelFileError(
            f"{path}: adapter.alora_invocation_tokens is set: activated LoRA (applied only "
            "after its invocation tokens) is not run"
        )
    base = model.config.architecture
    if gguf.architecture not in family(base).gguf_archs:
        raise ModelFileError(
            f"{path}: general.architecture is {gguf.architecture!r}; the base model is a "
            f"{base} model ({', '.join(family(base).gguf_archs) or 'no GGUF architecture'}): "
            "the adapter is for another base model"
        )
    alpha = meta.get("adapter.lora.alpha", 0.0)
    if type(alpha) not in (int, float) or not math.isfinite(alpha):
        raise ModelFileError(f"{path}: adapter.lora.alpha = {alpha!r}; expected a finite number")
    return float(alpha)


def _gguf_module(path: Path, model: CausalLM, gguf_name: str, stem: str, arch: str) -> str:
    """Our projection that a GGUF adapter tensor adapts, checked to be one adapters run on."""
    ours = hf_name(stem, arch, path)
    target = (ours or "").removesuffix(".weight").rpartition(".")[2]
    if ours is None or not ours.endswith(".weight") or target not in (*TARGETS, *FUSED):
        raise ModelFileError(
            f"{path}: tensor {gguf_name!r} adapts {ours or stem}, which is not adapted here; "
            f"accepted: the projections {', '.join((*TARGETS, *FUSED))} (embeddings, the "
            "output head and experts are not)"
        )
    module = ours.removesuffix(".weight")
    layer = int(module.split(".")[2])
    if layer >= model.config.num_layers:
        raise ModelFileError(
            f"{path}: tensor {gguf_name!r} adapts layer {layer}; the base model has "
            f"{model.config.num_layers} layers: the adapter is for another base model"
        )
    return module
