"""Which code runs a model (``MISTRALRS_MODEL_IMPL``), and a safetensors decoder loaded on
transformers' own modeling code (`models.transformers_lm`) where it is transformers'.

A model runs here only where it runs exactly as transformers runs it: every layer an
attention layer that calls transformers' attention interface with nothing this path does
not implement, and a causal-LM head that only projects the last hidden states. What is
checked from the config is refused before anything loads; the rest by one probe pass over
a few tokens once the weights are in (`TransformersCausalLM.probe`), each refusal with its
reason.
"""

from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from ..errors import ModelFileError, SettingsError, UnsupportedArchitectureError
from ..kernels import KernelChoice, choose_kernels
from ..kernels.cpu import built_before
from ..log import get_logger
from ..memory import release_freed_memory
from ..models.arch import family_names, family_of_model_type, family_of_wrapper
from ..models.components import RopeConfig
from ..models.config import ConfigValueError, ModelConfig
from ..models.transformers_lm import (
    ATTENTION_NAME,
    Probe,
    TransformersCausalLM,
    register_attention,
)
from ..quant.isq import linear_type
from ..quant.linear import QuantizedWeight, QuantLinear
from ..settings import PlatformDecisions
from ..settings.values import IsqType
from .hf_config import generation_eos, json_object, token_ids
from .progress import Progress, step
from .resolve import ModelSource
from .tokenizer import Tokenizer, load_text_tokenizer
from .weights import read_safetensors, safetensors_files

if TYPE_CHECKING:
    from transformers import PretrainedConfig

log = get_logger()

Implementation = Literal["native", "transformers"]
PROBE_TOKENS = 4  # the probe pass's length: a few tokens reach every layer
_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
_VARIABLE = "MISTRALRS_MODEL_IMPL"
_LENGTH_DEPENDENT_ROPES = frozenset({"dynamic", "longrope"})


def choose_implementation(source: ModelSource, model_impl: str) -> tuple[Implementation, str]:
    """Whose code runs ``source`` under ``MISTRALRS_MODEL_IMPL=model_impl``, and why; a
    combination that cannot run is refused here, before anything loads."""
    if source.kind == "gguf":
        if model_impl == "transformers":
            raise SettingsError(
                f"{_VARIABLE}=transformers runs safetensors models only; {source.path} is a "
                "GGUF file, which runs on the family modules: set auto or native"
            )
        return "native", "a GGUF file runs on its family module"
    model_type = _model_type(source.path)
    if not isinstance(model_type, str):  # the native loader's checks name what is wrong
        return "native", "config.json names no model type"
    if model_impl == "transformers":
        return "transformers", f"{_VARIABLE}=transformers"
    found = family_of_model_type(model_type) or family_of_wrapper(model_type)
    if found is not None:
        return "native", f"model type {model_type!r} has a family module ({found.name})"
    if model_impl == "native":
        raise UnsupportedArchitectureError(
            f"{source.path / 'config.json'}: model type {model_type!r} has no family module "
            f"(those with one: {', '.join(family_names())}); {_VARIABLE}=native refuses it: "
            "set auto or transformers to run it on transformers' modeling code"
        )
    return "transformers", f"model type {model_type!r} has no family module ({_VARIABLE}=auto)"


def _model_type(model_dir: Path) -> object:
    return json_object(model_dir / "config.json").get("model_type")


def load_transformers_model(
    source: ModelSource,
    isq: IsqType | None,
    decisions: PlatformDecisions,
    progress: Progress,
    why: str,
    tokenizer: Tokenizer | None = None,
) -> tuple[TransformersCausalLM, Tokenizer, ModelConfig, torch.dtype, torch.device, KernelChoice]:
    """``source`` on transformers' modeling code, its projections quantized in situ where
    ``isq`` says, checked by a probe pass (`check_probe`): the model, its tokenizer, its
    config, dtype and device, and the kernels it runs on (`loader.model.LoadedModel`'s)."""
    path = source.path / "config.json"
    hf_config = _hf_config(source.path, path)
    model_class = checked_class(hf_config, path)
    dtype = getattr(torch, decisions.resolve_dtype(_dtype_name(hf_config)))
    device = torch.device(decisions.device)
    compiles = decisions.kernels == "cpu" and decisions.c_compiler is not None
    compiles = compiles and not built_before(decisions.c_compiler, decisions.native_checks)
    with step(progress, "compiling the CPU kernels (first run on this machine)", compiles):
        kernels = choose_kernels(decisions)
    hf = _built(model_class, hf_config, dtype, device)
    _load_weights(hf, source.path, progress, device)
    if isq is not None:
        quantize_linears(hf, isq, kernels)
    model = _probed(TransformersCausalLM(hf.eval(), kernels), hf_config, path, dtype, device)
    config = model.config
    assert config is not None
    tokenizer = tokenizer or load_text_tokenizer(source.path, _eos_ids(config, source.path))
    release_freed_memory()
    log.info(
        "model.loaded",
        architecture=config.architecture,
        implementation="transformers",
        why=why,
        model_class=model_class.__name__,
        layers=config.num_layers,
        dtype=str(dtype).removeprefix("torch."),
        device=str(device),
        quantized_layers=sum(isinstance(m, QuantLinear) for m in hf.modules()),
    )
    return model, tokenizer, config, dtype, device, kernels


def _probed(
    model: TransformersCausalLM,
    hf_config: "PretrainedConfig",
    path: Path,
    dtype: torch.dtype,
    device: torch.device,
) -> TransformersCausalLM:
    """``model`` checked by a probe pass and given what the pass found: its config and
    each attention layer's place in the KV cache, by its ``layer_idx``."""
    probe = model.probe(torch.arange(PROBE_TOKENS, device=device) % hf_config.vocab_size)
    check_probe(probe, hf_config, path)
    model.config = _model_config(hf_config, probe, path, dtype)
    model.specs = {
        call.layer: spec.mixer.spec  # type: ignore[misc, union-attr]
        for call, spec in zip(probe.calls, model.config.layers, strict=True)
    }
    return model


def _eos_ids(config: ModelConfig, model_dir: Path) -> tuple[int, ...]:
    """config.json's end-of-sequence ids and generation_config.json's together."""
    eos = set(config.eos_token_ids)
    generation = model_dir / "generation_config.json"
    if generation.exists():
        eos |= set(generation_eos(model_dir, generation, config.vocab_size))
    return tuple(sorted(eos))


def _hf_config(model_dir: Path, path: Path) -> "PretrainedConfig":
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_dir)
    except Exception as exc:  # its config classes raise whatever their own checks raise
        raise ModelFileError(
            f"{path}: transformers cannot read it: {type(exc).__name__}: {exc}"
        ) from exc


def checked_class(config: "PretrainedConfig", path: Path) -> type:
    """transformers' causal-LM class for ``config``, where its config says nothing this
    path cannot run exactly; else the refusal, with the reason."""
    from transformers import AutoModelForCausalLM

    why = config_refusal(config)
    if why is None:
        model_class = AutoModelForCausalLM._model_mapping.get(type(config), None)
        if model_class is None:
            why = "transformers has no causal-LM class for it"
        elif not model_class.is_backend_compatible():
            why = (
                f"transformers' {model_class.__name__} does not declare its attention "
                "pluggable (_supports_attention_backend)"
            )
    if why is not None:
        raise UnsupportedArchitectureError(
            f"{path}: model type {config.model_type!r} cannot run on transformers' modeling "
            f"code here: {why}"
        )
    return model_class


def config_refusal(config: "PretrainedConfig") -> str | None:
    """What a config says that this path does not run exactly, or None."""
    layer_types = set(getattr(config, "layer_types", None) or ()) - {"full_attention"}
    if layer_types:
        return (
            f"its layers include {', '.join(sorted(map(str, layer_types)))} (only full "
            "attention runs here: no sliding windows, state or convolution layers)"
        )
    checks = {
        "is_encoder_decoder": "an encoder-decoder model",
        "text_config": "a multimodal model (decoder-only text models run here)",
        "quantization_config": "a quantized checkpoint (float weights run here)",
        "num_kv_shared_layers": "layers that share another layer's K and V",
        "attention_chunk_size": "chunked attention",
        "attn_logit_softcapping": "attention softcapping",
        "final_logit_softcapping": "a softcap on the logits",
        "auto_map": "modeling code of its own (trust_remote_code)",
    }
    for key, what in checks.items():
        if getattr(config, key, None):
            return f"{what} ({key} is set)"
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True):
        return f"a sliding window of {window} tokens"
    varying = _rope_types(config) & _LENGTH_DEPENDENT_ROPES
    if varying:
        return (
            f"a {', '.join(sorted(varying))} rope, whose frequencies follow the longest "
            "position of the pass (a step of several sequences would change a sequence's)"
        )
    return None


def _rope_types(config: "PretrainedConfig") -> set[str]:
    """The rope types a config names (a section per layer type included)."""
    found = set()
    for key in ("rope_parameters", "rope_scaling"):
        value = getattr(config, key, None)
        if isinstance(value, dict):
            sections = [value, *(v for v in value.values() if isinstance(v, dict))]
            found |= {str(s.get("rope_type") or s.get("type")) for s in sections}
    return found - {"None"}


def _dtype_name(config: "PretrainedConfig") -> str | None:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.")
    return name if isinstance(getattr(torch, name, None), torch.dtype) else None


def _built(
    model_class: type, config: "PretrainedConfig", dtype: torch.dtype, device: torch.device
) -> torch.nn.Module:
    """transformers' model of ``config`` on ``device``, uninitialized (the weights follow),
    its attention ours."""
    from transformers.initialization import no_init_weights

    register_attention()
    config._attn_implementation = ATTENTION_NAME
    with no_init_weights(), device:
        return model_class._from_config(config, dtype=dtype)


def _load_weights(
    hf: torch.nn.Module, model_dir: Path, progress: Progress, device: torch.device
) -> None:
    """Every parameter of ``hf`` (and persistent buffer the files hold) from the model's
    safetensors, by transformers' own names; a name it has not, or one left unfilled, is an
    error naming it."""
    params = dict(hf.named_parameters())
    buffers = dict(hf.named_buffers())
    tied = {name for name, _ in hf.named_parameters(remove_duplicate=False)} - set(params)
    filled: set[str] = set()
    with torch.no_grad():
        for name, tensor in read_safetensors(safetensors_files(model_dir), progress, rename=False):
            target = params.get(name, buffers.get(name))
            if target is None:
                if name in tied:  # the head of a tied model: the embedding's tensor
                    continue
                raise ModelFileError(
                    f"{model_dir}: unexpected tensor {name!r}: transformers' "
                    f"{type(hf).__name__} has no such parameter (a checkpoint in another "
                    "layout than transformers' own)"
                )
            if tuple(tensor.shape) != tuple(target.shape):
                raise ModelFileError(
                    f"{model_dir}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"transformers' {type(hf).__name__} expects {tuple(target.shape)}"
                )
            target.copy_(tensor.to(device=device, dtype=target.dtype))
            filled.add(name)
    missing = [name for name in params if name not in filled]
    if missing:
        raise ModelFileError(
            f"{model_dir}: {len(missing)} weights are missing, e.g. " + ", ".join(missing[:5])
        )


def quantize_linears(hf: torch.nn.Module, isq: IsqType, kernels: KernelChoice) -> None:
    """Every ``nn.Linear`` of ``hf`` replaced by a quantized one (the output head at the
    promoted type, as on the native path; the embedding stays float). A layer whose rows
    fit no block type stays float, said in the log."""
    head = hf.get_output_embeddings()
    kept = []
    for name, module in list(hf.named_modules()):
        if not isinstance(module, torch.nn.Linear):
            continue
        qtype = linear_type(isq, module.in_features, head=module is head)
        if qtype is None:
            kept.append(name)
            continue
        weight = QuantizedWeight.from_float(module.weight.detach().float(), qtype)
        quantized = QuantLinear(weight.to(module.weight.device), matmuls=kernels.matmuls)
        quantized.bias = module.bias
        parent, _, attr = name.rpartition(".")
        setattr(hf.get_submodule(parent), attr, quantized)
    if kept:
        log.warning("isq.skipped", layers=len(kept), first=kept[0], reason="rows fit no block type")
    others = _float_matrices(hf)
    if others:
        log.warning("isq.skipped", layers=len(others), first=others[0], reason="not an nn.Linear")
    log.info("isq.enabled", type=isq.value, note="transformers' linear layers quantized")


def _float_matrices(hf: torch.nn.Module) -> list[str]:
    """The modules holding a matrix that ISQ left float beside the embeddings: layers other
    than nn.Linear (GPT-2's Conv1D)."""
    return [
        name
        for name, module in hf.named_modules()
        if not isinstance(module, torch.nn.Embedding | QuantLinear)
        and any(param.dim() == 2 for param in module.parameters(recurse=False))
    ]


def check_probe(probe: Probe, config: "PretrainedConfig", path: Path) -> None:
    """The probe pass's calls against what this path runs exactly: each layer once, by its
    own index, attention alone, one K/V shape; a head that only projects. Else refused."""
    layers = getattr(config, "num_hidden_layers", None)
    indices = [call.layer for call in probe.calls]
    why = None
    if not probe.calls:
        why = "no layer calls transformers' attention interface"
    elif layers is not None and len(probe.calls) != layers:
        why = (
            f"only {len(probe.calls)} of its {layers} layers call transformers' attention "
            "interface (the others keep state this path does not carry: a hybrid)"
        )
    elif None in indices or len(set(indices)) != len(indices):
        why = "its attention layers do not each carry an index of their own (layer_idx)"
    elif any(call.unsupported for call in probe.calls):
        first = next(call for call in probe.calls if call.unsupported)
        why = f"layer {first.layer}'s attention asks for {'; '.join(first.unsupported)}"
    elif len({(c.heads, c.kv_heads, c.head_dim, c.value_dim, c.scaling) for c in probe.calls}) > 1:
        why = "its attention layers differ in shape or scale"
    elif probe.calls[0].head_dim != probe.calls[0].value_dim:
        why = "its values have another head size than its keys"
    elif probe.calls[0].heads % probe.calls[0].kv_heads:
        why = "its query heads are not a multiple of its key/value heads"
    elif not probe.head_exact:
        why = "its causal-LM head does more than project the last hidden states"
    if why is not None:
        raise UnsupportedArchitectureError(
            f"{path}: model type {config.model_type!r} cannot run on transformers' modeling "
            f"code here: {why}"
        )


def _model_config(
    config: "PretrainedConfig", probe: Probe, path: Path, dtype: torch.dtype
) -> ModelConfig:
    """What the engine reads of the model: its KV layers as the probe saw them, its
    vocabulary, context and special tokens. The rotary fields stay unused (transformers'
    layers rotate; PIC, which would move rotated keys, is refused on this path)."""
    first = probe.calls[0]
    positions = next((getattr(config, k) for k in _POSITION_KEYS if getattr(config, k, None)), None)
    if positions is None:
        raise ModelFileError(f"{path}: none of {', '.join(_POSITION_KEYS)} gives the context")
    try:
        return ModelConfig(
            architecture=str(config.model_type),
            vocab_size=probe.vocab,
            hidden_size=int(config.hidden_size),
            intermediate_size=0,
            num_layers=len(probe.calls),
            num_heads=first.heads,
            num_kv_heads=first.kv_heads,
            head_dim=first.head_dim,
            rms_norm_eps=1e-6,  # unused: transformers' norms run
            max_position_embeddings=int(positions),
            rope=RopeConfig(theta=10000.0, rotary_dim=first.head_dim),
            attn_scale=first.scaling,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            bos_token_id=getattr(config, "bos_token_id", None),
            eos_token_ids=token_ids(getattr(config, "eos_token_id", None)),
            dtype=str(dtype).removeprefix("torch."),
            implementation="transformers",
        )
    except ConfigValueError as exc:
        raise ModelFileError(f"{path}: {exc}") from None
