"""Model source + settings + platform decisions → a model with its weights, and a tokenizer."""

from dataclasses import dataclass
from typing import Protocol

import torch

from ..errors import SettingsError
from ..kernels import KernelChoice, choose_kernels
from ..kernels.cpu import CpuKernels, built_before
from ..log import get_logger
from ..memory import release_freed_memory
from ..models.arch import family
from ..models.collectives import Collectives
from ..models.config import ModelConfig
from ..models.transformer import CausalLM, device_of_weight
from ..quant.isq import apply_isq
from ..quant.linear import QuantEmbedding, QuantLinear
from ..settings import PlatformDecisions
from ..settings.topology import LayerMap, even_spans
from ..settings.values import IsqType
from .gguf_config import model_config_from_gguf
from .gguf_file import GGUFFile
from .hf_config import read_text_config
from .progress import Progress, step
from .resolve import ModelSource
from .tiling import tile_projections
from .tokenizer import Tokenizer, converted_before, load_gguf_tokenizer, load_text_tokenizer
from .transformers_path import choose_implementation, load_transformers_model
from .weights import (
    NamedTensors,
    load_into,
    read_gguf,
    read_safetensors,
    safetensors_files,
    split_fused,
)

log = get_logger()


class ModelSplit(Protocol):
    """This rank's share of a tensor-parallel model (`distributed.sharding.RankSplit`): its
    config (its heads, its rows of the MLPs), its part of each weight as they stream in,
    and the group its layers sum over."""

    collectives: Collectives

    def local_config(self, config: ModelConfig) -> ModelConfig: ...
    def weights(self, config: ModelConfig, weights: NamedTensors) -> NamedTensors: ...


@dataclass(frozen=True)
class LoadedModel:
    model: CausalLM
    tokenizer: Tokenizer
    config: ModelConfig
    source: ModelSource
    dtype: torch.dtype
    device: torch.device
    kernels: KernelChoice  # what it runs on, chosen once from the platform decisions
    # Whose code runs it (`loader.transformers_path`): a family module's layers, or
    # transformers' modeling code over the engine's cache; and why.
    implementation: str = "native"
    implementation_why: str = ""

    @property
    def native(self) -> CpuKernels | None:
        """The compiled CPU kernels it runs on, if any."""
        return self.kernels.native


def load_model(
    source: ModelSource,
    isq: IsqType | None,
    decisions: PlatformDecisions,
    progress: Progress,
    *,
    requantize_gguf: bool = False,
    tokenizer: Tokenizer | None = None,
    split: ModelSplit | None = None,
    layer_map: LayerMap | None = None,
    model_impl: str = "auto",
) -> LoadedModel:
    """Load ``source`` with ``isq`` applied to a text model's float weights (and, where
    ``requantize_gguf``, to a GGUF's stored blocks: how a draft is made from a GGUF target).
    ``tokenizer`` reuses one already loaded for the same model; ``split``: this rank's
    share of a tensor-parallel model (its config is then the share's); ``layer_map``:
    consecutive layers on each of several devices; ``model_impl``: whose code runs it
    (``MISTRALRS_MODEL_IMPL``, `transformers_path.choose_implementation`)."""
    place = _Placement(split, layer_map)
    implementation, why = choose_implementation(source, model_impl)
    if implementation == "transformers":
        _refuse_placement(place)
        parts = load_transformers_model(source, isq, decisions, progress, why, tokenizer)
        model, tokenizer, config, dtype, device, kernels = parts
        return LoadedModel(
            model,  # type: ignore[arg-type]  # the interface of CausalLM, not the class
            tokenizer,
            config,
            source,
            dtype,
            device,
            kernels,
            implementation="transformers",
            implementation_why=why,
        )
    if source.kind == "gguf":
        return _load_gguf(source, isq, decisions, progress, requantize_gguf, tokenizer, place)
    return _load_text(source, isq, decisions, progress, tokenizer, place)


@dataclass(frozen=True)
class _Placement:
    """Where a model's weights go beyond one device: a rank's share, or layer mapping."""

    split: ModelSplit | None = None
    layer_map: LayerMap | None = None


def _refuse_placement(place: "_Placement") -> None:
    """transformers' modeling code runs whole on one device, in one process."""
    asked = {
        "tensor parallelism": place.split is not None,
        "layer mapping (MISTRALRS_DEVICE_LAYERS)": place.layer_map is not None,
    }
    for what, is_set in asked.items():
        if is_set:
            raise SettingsError(
                f"{what} does not run on transformers' modeling code "
                "(MISTRALRS_MODEL_IMPL): the model runs whole on one device"
            )


def _load_text(
    source: ModelSource,
    isq: IsqType | None,
    decisions: PlatformDecisions,
    progress: Progress,
    tokenizer: Tokenizer | None,
    place: _Placement,
) -> LoadedModel:
    config, eos = read_text_config(source.path)
    tokenizer = tokenizer or load_text_tokenizer(source.path, eos)
    release_freed_memory()  # the tokenizer's parse, before the weights land on top of it
    found = family(config.architecture)
    packed = found.quant_methods.get(config.quantization, ()) if config.quantization else ()
    files = safetensors_files(source.path)
    stored = read_safetensors(files, progress, packed, found.hf_unused)
    weights = split_fused(found.tensors(stored, config), config)
    if place.split is not None:  # cut before ISQ: each rank quantizes its share alone
        weights = place.split.weights(config, weights)
    if isq is not None:
        log.info(
            "isq.enabled",
            type=isq.value,
            note="projections quantized as they load; embedding and head promoted",
        )
        weights = apply_isq(weights, isq, keep_quantized=True)
    return _build(source, config, tokenizer, weights, decisions, place, progress)


def _load_gguf(
    source: ModelSource,
    isq: IsqType | None,
    decisions: PlatformDecisions,
    progress: Progress,
    requantize: bool,
    tokenizer: Tokenizer | None,
    place: _Placement,
) -> LoadedModel:
    if isq is not None and not requantize:
        log.warning(
            "isq.ignored",
            type=isq.value,
            reason="a GGUF model runs on the quantized types its file stores",
        )
    gguf = GGUFFile(source.path)
    config = model_config_from_gguf(gguf)
    if tokenizer is None:
        fresh = not converted_before(source.path)
        with step(progress, "converting the tokenizer (first load of this file)", fresh):
            tokenizer = load_gguf_tokenizer(source.path, config.architecture, config.eos_token_ids)
    release_freed_memory()  # the tokenizer's parse, before the weights land on top of it
    stored = read_gguf(gguf, config, progress)
    weights = split_fused(family(config.architecture).tensors(stored, config), config)
    if place.split is not None:
        weights = place.split.weights(config, weights)
    if isq is not None and requantize:
        log.info("isq.requantize", type=isq.value, note="the GGUF's blocks, for the draft")
        weights = apply_isq(weights, isq)
    return _build(source, config, tokenizer, weights, decisions, place, progress)


def _build(
    source: ModelSource,
    config: ModelConfig,
    tokenizer: Tokenizer,
    weights: NamedTensors,
    decisions: PlatformDecisions,
    place: _Placement,
    progress: Progress,
) -> LoadedModel:
    dtype = getattr(torch, decisions.resolve_dtype(config.dtype))
    device = torch.device(decisions.device)
    tp = None
    if place.split is not None:
        config, tp = place.split.local_config(config), place.split.collectives
    devices = spans = None
    if place.layer_map is not None:
        layer_map = even_spans(place.layer_map, config.num_layers)
        devices = [torch.device(d) for d in layer_map.layer_devices(config.num_layers)]
        spans = [(torch.device(d), count) for d, count in layer_map.spans]
        device = devices[0]  # where a step's inputs start
    compiles = decisions.kernels == "cpu" and decisions.c_compiler is not None
    compiles = compiles and not built_before(decisions.c_compiler, decisions.native_checks)
    with step(progress, "compiling the CPU kernels (first run on this machine)", compiles):
        kernels = choose_kernels(decisions)
    native = kernels.native
    with torch.device("meta"):
        model = CausalLM(config, tp, kernels)
    load_into(
        model,
        weights,
        dtype=dtype,
        device=device,
        source=source.path,
        device_of=None if devices is None else lambda name: device_of_weight(name, devices),
    )
    if devices is None:
        model.to(device)
    else:
        model.place(spans)
        log.info("layers.mapped", devices=[str(d) for d in devices], why=place.layer_map.why)
    model.eval()
    model.prepare_experts()
    tile_projections(
        model, native, model.model.embed_tokens if config.tie_word_embeddings else None
    )
    quantized = [m for m in model.modules() if isinstance(m, QuantLinear | QuantEmbedding)]
    log.info(
        "model.loaded",
        architecture=config.architecture,
        kind=source.kind,
        layers=config.num_layers,
        dtype=str(dtype).removeprefix("torch."),
        device=str(device),
        quantized_layers=len(quantized),
        quantized_matmul=decisions.kernels if quantized else None,
        cpu_matmul=decisions.cpu_matmul if native else None,
        cpu_gemm=decisions.cpu_gemm if native else None,
        native_checks=native.checks if native else None,
    )
    return LoadedModel(model, tokenizer, config, source, dtype, device, kernels)
