"""Tiny random models of every supported architecture, made through transformers, saved as
safetensors and written as GGUF the way llama.cpp's converter writes them."""

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType, quants
from llama_cpp_converter import convert
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

from spnl_backend.models.arch import FAMILIES, family

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time there was a little model that could.",
    "The capital of France is Paris, and the capital of Italy is Rome.",
    "def add(a, b):\n    return a + b\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.",
    "Tokens, tokens everywhere; caches and blocks and prefixes.",
] * 4
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
PAD, EOS, BOS = 0, 1, 2
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS, INNER = 64, 4, 2, 16, 3, 128
MAX_POSITIONS = 512
WINDOW = 8  # small, so 32-token prompts cross it


def build_tokenizer(specials: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """The corpus's byte-level BPE; ``specials``: more special tokens, after its 320."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", BOS)]
    )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    if specials:
        hf.add_special_tokens({"additional_special_tokens": list(specials)})
    return hf


def _common(vocab: int) -> dict:
    return dict(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=INNER,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        tie_word_embeddings=False,
    )


# Config keys whose None is a setting, not a default (DeepSeek-V2-Lite's q_lora_rank: its
# queries projected directly, where transformers' default is a bottleneck).
NONE_MEANT = frozenset({"q_lora_rank"})


def hf_config(arch: str, vocab: int, overrides: dict | None = None):
    """The family's tiny model (`Family.tiny`: its keys beside the common tiny sizes;
    ``overrides``: a variant's keys over them)."""
    found = family(arch)
    keys = {**_common(vocab), **found.tiny, **(overrides or {})}
    # None: left out, but where None itself is the value meant
    keys = {key: value for key, value in keys.items() if value is not None or key in NONE_MEANT}
    if "hidden_size_per_layer_input" in keys:  # Gemma 4's per-layer table: the same ids
        keys.setdefault("vocab_size_per_layer_input", vocab)
    return AutoConfig.for_model(keys.pop("model_type", found.model_types[0]), **keys)


def _has_experts(found) -> bool:
    keys = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
    return any(key in found.tiny for key in keys)


def _has_kv_groups(found) -> bool:
    """KV layers of several shapes or read by later layers (Gemma 4)."""
    return any(key in found.tiny for key in ("global_head_dim", "num_kv_shared_layers"))


def _has_latent_kv(found) -> bool:
    """Multi-head latent attention (DeepSeek): one latent per token in the pool."""
    return "kv_lora_rank" in found.tiny


# Every family of the registry: dense, with experts, hybrids (state layers beside
# attention, which the features that need every layer's K and V refuse), KV groups
# (which the features that see the pool as one shape refuse; tests/test_kv_groups.py),
# and latent attention (tests/test_mla.py; also in tests/test_models.py's comparisons).
ARCHITECTURES = tuple(
    f.name
    for f in FAMILIES
    if not (_has_experts(f) or f.state_layers or _has_kv_groups(f) or _has_latent_kv(f))
)
MLA_ARCHITECTURES = tuple(f.name for f in FAMILIES if _has_latent_kv(f))
KV_GROUP_ARCHITECTURES = tuple(f.name for f in FAMILIES if _has_kv_groups(f))
MOE_ARCHITECTURES = tuple(
    f.name for f in FAMILIES if _has_experts(f) and not (f.state_layers or _has_latent_kv(f))
)
HYBRID_ARCHITECTURES = tuple(f.name for f in FAMILIES if f.state_layers)
MOE_HYBRID_ARCHITECTURES = tuple(f.name for f in FAMILIES if _has_experts(f) and f.state_layers)
# What the native layer blocks leave to the per-op path: qwen2's projections carry biases,
# OLMo 2's layers have no input norm (norms after attention and MLP only), SmolLM3 has a
# layer that does not rotate, gpt-oss's attention has sinks (and its experts biases),
# Gemma 4's layers differ in shape and share K/V; Phi-2, StarCoder2 and GPT-NeoX have
# LayerNorms, plain MLPs and biases (Phi-2 and GPT-NeoX parallel residuals too); Granite
# scales its residuals; Cohere runs attention and MLP side by side from LayerNorms;
# Qwen2-MoE has biases and a gated shared expert; Llama 4 norms q and k after the
# rotation (and has a layer that does not rotate, and a shared expert); seed_oss's and
# GLM's projections carry biases, EXAONE 4's layers have no input norm and some do not
# rotate, Arcee's and Apertus's MLPs have no gate, HunYuan norms q and k after their
# rotation; Nemotron, OLMo and StableLM have LayerNorms.
PER_OP_ONLY = frozenset(
    {"qwen2", "olmo2", "smollm3", "gpt_oss", "gemma4", "phi", "starcoder2", "gpt_neox"}
    | {"granite", "cohere", "cohere2", "qwen2_moe", "llama4"}
    | {"seed_oss", "glm4", "glm", "exaone4", "arcee", "hunyuan_v1_dense", "apertus"}
    | {"nemotron", "olmo", "stablelm"}
    | {"glm4_moe", "ernie4_5_moe"}  # routing by biased scores and groups, not a plain top-k
)
# The families whose GGUF twin is the file llama.cpp's own converter writes
# (`llama_cpp_converter`), rather than `write_gguf`'s; with the pre-tokenizer rule the
# tiny vocabulary is named by (llama.cpp's ``default`` unless said here).
CONVERTED = frozenset(
    {"phi", "starcoder2", "gpt_neox", "granite", "cohere", "cohere2", "qwen2_moe", "olmo"}
    | {"nemotron", "glm4_moe", "ernie4_5_moe"}
)
# (Nemotron's converter reads a SentencePiece vocabulary alone, GLM-4 MoE's and ERNIE 4.5
# MoE's insist on GLM's special tokens and a SentencePiece model: their plain BPE step
# reads the tiny vocabulary)
CONVERTED_PRE = {
    "phi": "gpt-2",
    "starcoder2": "gpt-2",
    "gpt_neox": "gpt-2",
    "nemotron": "plain-bpe",
    "glm4_moe": "plain-bpe",
    "ernie4_5_moe": "plain-bpe",
}
# The families whose converter-written GGUF is checked in a test module of their own.
GGUF_CONVERTER_TESTS = frozenset({"deepseek_v2", "deepseek_v3", "llama4"})
# Their tiny tokenizers' chat templates: each family's turns (its checkpoints' template cut
# to plain turns; ``{role}`` upper-cased for Cohere's USER_TOKEN, SYSTEM_TOKEN), then the
# prompt of the assistant's turn (``{Role}`` capitalized, for Nemotron's).
CHAT_TURNS = {
    "cohere": (
        "<|START_OF_TURN_TOKEN|><|{ROLE}_TOKEN|>{content}<|END_OF_TURN_TOKEN|>",
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
    ),
    "cohere2": (
        "<|START_OF_TURN_TOKEN|><|{ROLE}_TOKEN|>{content}<|END_OF_TURN_TOKEN|>",
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_RESPONSE|>",
    ),
    "granite": (
        "<|start_of_role|>{role}<|end_of_role|>{content}<|end_of_text|>\n",
        "<|start_of_role|>assistant<|end_of_role|>",
    ),
    "qwen2_moe": ("<|im_start|>{role}\n{content}<|im_end|>\n", "<|im_start|>assistant\n"),
    "nemotron": ("<extra_id_1>{Role}\n{content}\n", "<extra_id_1>Assistant\n"),
    "olmo": ("<|{role}|>\n{content}\n", "<|assistant|>\n"),
    "glm4_moe": ("<|{role}|>\n{content}", "<|assistant|>"),
    "ernie4_5_moe": ("{ROLE}: {content}\n", "ASSISTANT: "),
}


def chat_template(arch: str) -> str | None:
    """The tiny tokenizer's chat template, where the family has one here (`CHAT_TURNS`)."""
    if arch not in CHAT_TURNS:
        return None
    turn, prompt = CHAT_TURNS[arch]
    turn = turn.replace("{ROLE}", "{{ m['role'] | upper }}").replace("{role}", "{{ m['role'] }}")
    turn = turn.replace("{Role}", "{{ m['role'] | capitalize }}")
    turn = turn.replace("{content}", "{{ m['content'] }}")
    return (
        "{% for m in messages %}" + turn + "{% endfor %}"
        "{% if add_generation_prompt %}" + prompt + "{% endif %}"
    )


@dataclass
class TinyModel:
    arch: str
    path: Path
    hf: torch.nn.Module
    tokenizer: PreTrainedTokenizerFast


def build_hf_model(
    arch: str,
    path: Path,
    seed: int = 0,
    specials: tuple[str, ...] = (),
    overrides: dict | None = None,
) -> TinyModel:
    tokenizer = build_tokenizer(specials)
    tokenizer.chat_template = chat_template(arch)
    config = hf_config(arch, len(tokenizer), overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.float32
    ).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            # Peaked distributions, so greedy choices are not near-ties.
            if "norm" in name and name.endswith("weight"):  # Gemma scales by 1 + w, others by w
                center = 0.0 if arch in OFFSET_NORMS else 1.0
                param.copy_(center + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.15)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):  # Gemma 4's per-layer output scale
                buffer.copy_(0.5 + torch.rand_like(buffer))
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's: it moves choices
                buffer.normal_(0.0, 0.3)
    return _save(TinyModel(arch, path, model, tokenizer))


def build_trained_model(path: Path, steps: int = 80) -> TinyModel:
    """A Llama wide enough for every ISQ type (256-value blocks), trained for a second or
    two on the corpus: a random model amplifies a 0.5% weight error into 3% of its logits
    and is full of near-ties, where a trained one is confident, as real models are."""
    tokenizer = build_tokenizer()
    wide = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, head_dim=64)
    config = LlamaConfig(**{**_common(len(tokenizer)), **wide})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.float32
    )
    batch = tokenizer(sorted(set(CORPUS)), padding=True, return_tensors="pt")
    labels = batch.input_ids.masked_fill(batch.attention_mask == 0, -100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        loss = model(**batch, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return _save(TinyModel("llama", path, model.eval(), tokenizer))


def _save(tiny: TinyModel) -> TinyModel:
    tiny.hf.generation_config.pad_token_id = PAD
    tiny.hf.save_pretrained(tiny.path, safe_serialization=True)
    tiny.tokenizer.save_pretrained(tiny.path)
    return tiny


# ---- GGUF, as llama.cpp's converter writes it ----------------------------------------------

_GGUF_ARCH = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "gemma2": "gemma2",
    "gemma3": "gemma3",
    "olmo2": "olmo2",
    "smollm3": "smollm3",
    "qwen3_5": "qwen35",
    "qwen3_5_moe": "qwen35moe",
    "qwen3_moe": "qwen3moe",
    "mixtral": "llama",
    "olmoe": "olmoe",
    "gpt_oss": "gpt-oss",
    "granitemoehybrid": "granitehybrid",
    "falcon_h1": "falcon-h1",
    "jamba": "jamba",
    "gemma4": "gemma4",
    "seed_oss": "seed_oss",
    "ernie4_5": "ernie4_5",
    "glm4": "glm4",
    "glm": "chatglm",
    "exaone4": "exaone4",
    "arcee": "arcee",
    "hunyuan_v1_dense": "hunyuan-dense",
    "apertus": "apertus",
    "gemma": "gemma",
    "stablelm": "stablelm",
}
# The families llama.cpp's converter writes (a ``ministral`` checkpoint it cannot read):
# those written here and those it writes itself.
CONVERTIBLE = frozenset(_GGUF_ARCH) | CONVERTED
# The dense families whose GGUF twin is the writer's, checked once against the converter's
# file too (`tests/test_llama_cpp_converter.py`). Left out: gemma3 (its tiny model keeps
# the attn_logit_softcapping the converter asserts absent), mistral (a llama file carries no
# sliding window: the windowed tiny model converts to another model), stablelm (its
# converter drops the per-head q/k norms of the tiny model's qk_layernorm, then fails).
WRITER_CHECKED = tuple(
    a
    for a in ARCHITECTURES
    if a in CONVERTIBLE and a not in CONVERTED and a not in ("gemma3", "mistral", "stablelm")
)
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.query_layernorm": "attn_q_norm",  # HunYuan's
    "self_attn.key_layernorm": "attn_k_norm",
    "attention_layernorm": "attn_norm",  # Apertus's
    "feedforward_layernorm": "ffn_norm",
    "self_attn.qkv_proj": "attn_qkv",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate": "ffn_gate_inp",
    "mlp.router": "ffn_gate_inp",
}
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


_GEMMA4_LAYER_NAMES = {
    **_GEMMA_LAYER_NAMES,
    "per_layer_input_gate": "inp_gate",
    "per_layer_projection": "proj",
    "post_per_layer_input_norm": "post_norm",
}
_GEMMA4_TOP_NAMES = {
    "model.embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
    "model.per_layer_model_projection.weight": "per_layer_model_proj.weight",
    "model.per_layer_projection_norm.weight": "per_layer_proj_norm.weight",
}
_OLMO2_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_layernorm": "post_attention_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
# The norm before the MLP under llama.cpp's ATTN_POST_NORM name (no FFN_NORM in the arch).
_ATTN_POST_NORM_NAMES = {**_LAYER_NAMES, "post_attention_layernorm": "post_attention_norm"}
_GPT_OSS_LAYER_NAMES = _ATTN_POST_NORM_NAMES
_GLM4_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_self_attn_layernorm": "post_attention_norm",
    "post_attention_layernorm": "ffn_norm",
    "post_mlp_layernorm": "post_ffw_norm",
}
GEMMAS = ("gemma", "gemma2", "gemma3")  # norms scaled by (1 + w), which the converter stores
# norms scaled by (1 + w): their weights centred on 0
OFFSET_NORMS = (*GEMMAS, "qwen3_5", "qwen3_5_moe")
# llama.cpp's converter permutes q and k rows of these (NORM rope), as Llama's.
_PERMUTED = ("llama", "mistral", "mixtral", "smollm3", "granitemoehybrid", "arcee")


def _gguf_name(name: str, arch: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "model.norm.bias": "output_norm.bias",
        "lm_head.weight": "output.weight",
    }
    if arch == "gemma4":
        top |= _GEMMA4_TOP_NAMES
    if name in top:
        return top[name]
    _, _, index, rest = name.split(".", 3)
    if rest == "layer_scalar":  # the converter adds the suffix
        return f"blk.{index}.layer_output_scale.weight"
    module, _, kind = rest.rpartition(".")
    names = {
        "gemma2": _GEMMA_LAYER_NAMES,
        "gemma3": _GEMMA_LAYER_NAMES,
        "gemma4": _GEMMA4_LAYER_NAMES,
    }.get(arch, _LAYER_NAMES)
    if arch in ("olmo2", "exaone4"):
        names = _OLMO2_LAYER_NAMES
    if arch == "seed_oss":
        names = _ATTN_POST_NORM_NAMES
    if arch == "glm4":
        names = _GLM4_LAYER_NAMES
    if arch == "gpt-oss":
        names = _GPT_OSS_LAYER_NAMES
        if rest == "self_attn.sinks":  # the converter adds the suffix
            return f"blk.{index}.attn_sinks.weight"
    return f"blk.{index}.{names[module]}.{kind}"


_QWEN35_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "linear_attn.in_proj_qkv": "attn_qkv",
    "linear_attn.in_proj_z": "attn_gate",
    "linear_attn.conv1d": "ssm_conv1d",
    "linear_attn.in_proj_b": "ssm_beta",
    "linear_attn.in_proj_a": "ssm_alpha",
    "linear_attn.norm": "ssm_norm",
    "linear_attn.out_proj": "ssm_out",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}


def _qwen35_tensors(state: dict, config):
    """Qwen3.5's tensors as llama.cpp's converter writes them: names, norms as 1 + w (the
    DeltaNet's own excepted), ``-exp(A_log)``, the convolution squeezed, and the value
    heads reordered from grouped by key head to tiled wherever they appear."""
    k_heads, v_heads = config.linear_num_key_heads, config.linear_num_value_heads
    k_dim, v_dim = config.linear_key_head_dim, config.linear_value_head_dim

    def tiled(t: torch.Tensor, dim: int, head: int) -> torch.Tensor:
        shape = list(t.shape)
        grouped = t.reshape(*shape[:dim], k_heads, v_heads // k_heads, head, *shape[dim + 1 :])
        return grouped.transpose(dim, dim + 1).reshape(shape)

    for name, tensor in state.items():
        if not name.startswith("model.layers."):
            yield name, tensor + 1.0 if name == "model.norm.weight" else tensor
            continue
        _, _, index, rest = name.split(".", 3)
        stem = f"blk.{index}"
        t = tensor.float()
        if ".mlp.experts." in name:  # stacked, as `_stacked_experts` writes them
            yield name, t
            continue
        if rest.endswith("A_log"):
            yield f"{stem}.ssm_a", tiled(-t.exp()[:, None], 0, 1)[:, 0]
            continue
        if rest.endswith("dt_bias"):
            yield f"{stem}.ssm_dt.bias", tiled(t[:, None], 0, 1)[:, 0]
            continue
        module, _, kind = rest.rpartition(".")
        if module.endswith("norm") and module != "linear_attn.norm":
            t = t + 1.0
        if module == "linear_attn.in_proj_qkv":
            qk = 2 * k_heads * k_dim
            t = torch.cat([t[:qk], tiled(t[qk:], 0, v_dim)])
        elif module == "linear_attn.conv1d":
            qk = 2 * k_heads * k_dim
            t = t.squeeze(1)
            t = torch.cat([t[:qk], tiled(t[qk:], 0, v_dim)])
        elif module == "linear_attn.in_proj_z":
            t = tiled(t, 0, v_dim)
        elif module in ("linear_attn.in_proj_b", "linear_attn.in_proj_a"):
            t = tiled(t, 0, 1)
        elif module == "linear_attn.out_proj":
            t = tiled(t, 1, v_dim)
        yield f"{stem}.{_QWEN35_NAMES[module]}.{kind}", t


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    rows = weight.shape[0]
    return (
        weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_gguf(
    tiny: TinyModel,
    path: Path,
    qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
    mtp_layers: int = 0,
) -> Path:
    """``mtp_layers``: multi-token prediction blocks after the decoder's, as llama.cpp's
    converter keeps Qwen3.5's (``nextn_predict_layers``): each a copy of the last layer
    beside its own ``nextn.*`` tensors. The `CONVERTED` families' by the converter itself."""
    if tiny.arch in CONVERTED and not mtp_layers:
        return convert(tiny.path, path, qtype.name, CONVERTED_PRE.get(tiny.arch, "default"))
    arch = _GGUF_ARCH[tiny.arch]
    config = tiny.hf.config
    writer = GGUFWriter(path, arch)
    _write_metadata(writer, tiny, config, mtp_layers)
    state = tiny.hf.state_dict()
    if arch in ("qwen35", "qwen35moe"):
        state = dict(_qwen35_tensors(state, config))
    tensors = _stacked_experts(state, arch)
    if tiny.arch == "granitemoehybrid":
        tensors = _granite_tensors(state, config.mamba_n_groups)
    if tiny.arch == "falcon_h1":
        tensors = _falcon_h1_tensors(state, config)
    if tiny.arch == "jamba":
        tensors = _jamba_tensors(state)
    if tiny.arch == "stablelm":
        tensors = _stablelm_tensors(state)
    for name, tensor in tensors:
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if ".mlp.act_fn." in name:  # xIELU's scalars: metadata (`_write_xielu_metadata`)
            continue
        if name.startswith("blk."):  # already GGUF's: stacked experts
            _add_tensor(writer, name, tensor.float().numpy(), qtype)
            continue
        data = tensor.float().numpy()
        # Of these architectures llama.cpp's converter permutes q and k for its llama files
        # (NORM rope) only; the others, OLMoE's included (NEOX rope), keep their rows.
        if tiny.arch in _PERMUTED and name.endswith(("q_proj.weight", "k_proj.weight")):
            data = _permute(data, HEADS if "q_proj" in name else KV_HEADS)
        if arch in GEMMAS and name.endswith("norm.weight"):
            data = data + 1.0
        _add_tensor(writer, _gguf_name(name, arch), data, qtype)
    for block in range(config.num_hidden_layers, config.num_hidden_layers + mtp_layers):
        _write_mtp_block(writer, _written(writer), block, qtype)
    _write_rope_tensors(writer, tiny)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _written(writer: GGUFWriter) -> dict[str, np.ndarray]:
    """The float tensors added to ``writer`` so far, by name."""
    return {
        name: info.tensor
        for shard in writer.tensors
        for name, info in shard.items()
        if info.tensor is not None and info.tensor.dtype == np.float32
    }


def _write_mtp_block(
    writer: GGUFWriter, written: dict[str, np.ndarray], block: int, qtype: GGMLQuantizationType
) -> None:
    """An MTP block: the last decoder block's tensors again, and the ``nextn`` ones."""
    last = f"blk.{block - 1}."
    for name, data in written.items():
        if name.startswith(last):
            _add_tensor(writer, f"blk.{block}." + name.removeprefix(last), data, qtype)
    rng = np.random.default_rng(block)
    for name, shape in (("eh_proj", (HIDDEN, 2 * HIDDEN)), ("enorm", (HIDDEN,))):
        data = rng.normal(0.0, 0.15, shape).astype(np.float32)
        _add_tensor(writer, f"blk.{block}.nextn.{name}.weight", data, qtype)


def _stacked_experts(state: dict[str, torch.Tensor], arch: str):
    """transformers' fused experts (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``)
    as llama.cpp stores them: ``ffn_gate_exps``, ``ffn_up_exps`` ``[E, I, H]`` and
    ``ffn_down_exps``; gpt-oss's as its converter splits them."""
    for name, tensor in state.items():
        if arch == "gpt-oss" and ".mlp.experts." in name:
            yield from _gpt_oss_experts(name, tensor)
            continue
        if name.endswith(".mlp.experts.gate_up_proj"):
            index = name.split(".")[2]
            gate, up = tensor.chunk(2, dim=1)
            yield f"blk.{index}.ffn_gate_exps.weight", gate
            yield f"blk.{index}.ffn_up_exps.weight", up
        elif name.endswith(".mlp.experts.down_proj"):
            yield f"blk.{name.split('.')[2]}.ffn_down_exps.weight", tensor
        else:
            yield name, tensor


def _gpt_oss_experts(name: str, tensor: torch.Tensor):
    """gpt-oss's experts (``gate_up_proj [E, H, 2I]``, gate and up interleaved by column,
    ``down_proj [E, I, H]``, stacked biases) split and transposed as llama.cpp's converter
    writes them."""
    index = name.split(".")[2]
    if name.endswith("gate_up_proj"):
        yield f"blk.{index}.ffn_gate_exps.weight", tensor[..., ::2].transpose(1, 2).contiguous()
        yield f"blk.{index}.ffn_up_exps.weight", tensor[..., 1::2].transpose(1, 2).contiguous()
    elif name.endswith("gate_up_proj_bias"):
        yield f"blk.{index}.ffn_gate_exps.bias", tensor[..., ::2].contiguous()
        yield f"blk.{index}.ffn_up_exps.bias", tensor[..., 1::2].contiguous()
    elif name.endswith("down_proj"):
        yield f"blk.{index}.ffn_down_exps.weight", tensor.transpose(1, 2).contiguous()
    else:
        yield f"blk.{index}.ffn_down_exps.bias", tensor


# Granite 4.0-H's layer tensors that llama.cpp's converter renames without a change.
_GRANITE_NAMES = {
    "mamba.in_proj.weight": "ssm_in.weight",
    "mamba.conv1d.bias": "ssm_conv1d.bias",
    "mamba.dt_bias": "ssm_dt.bias",
    "mamba.out_proj.weight": "ssm_out.weight",
    "block_sparse_moe.router.weight": "ffn_gate_inp.weight",
    "shared_mlp.output_linear.weight": "ffn_down_shexp.weight",
}


def _granite_tensors(state: dict[str, torch.Tensor], groups: int):
    """Granite 4.0-H's tensors as llama.cpp's converter writes them: the experts stacked
    by projection, the shared MLP's gate and up apart, the conv taps ``[channels,
    kernel]``, A as ``-exp(A_log)`` and D as columns, the SSM norm a row per group; the
    rest (attention, norms, embeddings) under the common names."""
    for name, tensor in state.items():
        if not name.startswith("model.layers."):
            yield name, tensor
            continue
        _, _, index, rest = name.split(".", 3)
        block = f"blk.{index}."
        if rest == "block_sparse_moe.experts.gate_up_proj":
            gate, up = tensor.chunk(2, dim=1)
            yield block + "ffn_gate_exps.weight", gate
            yield block + "ffn_up_exps.weight", up
        elif rest == "block_sparse_moe.experts.down_proj":
            yield block + "ffn_down_exps.weight", tensor
        elif rest == "shared_mlp.input_linear.weight":
            gate, up = tensor.chunk(2, dim=0)
            yield block + "ffn_gate_shexp.weight", gate
            yield block + "ffn_up_shexp.weight", up
        elif rest == "mamba.conv1d.weight":
            yield block + "ssm_conv1d.weight", tensor.squeeze(1)
        elif rest == "mamba.A_log":
            yield block + "ssm_a", -torch.exp(tensor).reshape(-1, 1)
        elif rest == "mamba.D":
            yield block + "ssm_d", tensor.reshape(-1, 1)
        elif rest == "mamba.norm.weight":
            yield block + "ssm_norm.weight", tensor.reshape(groups, -1)
        elif rest in _GRANITE_NAMES:
            yield block + _GRANITE_NAMES[rest], tensor
        else:
            yield name, tensor


# Falcon-H1's layer tensors that llama.cpp's converter renames, each with the multipliers
# it folds in (config.json keys; a list's entry by index).
_FALCON_H1_NAMES = {
    "input_layernorm.weight": ("attn_norm.weight", ()),
    "pre_ff_layernorm.weight": ("ffn_norm", ()),  # (the converter adds no suffix)
    "feed_forward.gate_proj.weight": ("ffn_gate.weight", (("mlp_multipliers", 0),)),
    "feed_forward.up_proj.weight": ("ffn_up.weight", ()),
    "feed_forward.down_proj.weight": ("ffn_down.weight", (("mlp_multipliers", 1),)),
    "self_attn.q_proj.weight": ("attn_q.weight", ("attention_in_multiplier",)),
    "self_attn.k_proj.weight": (
        "attn_k.weight",
        ("key_multiplier", "attention_in_multiplier"),
    ),
    "self_attn.v_proj.weight": ("attn_v.weight", ("attention_in_multiplier",)),
    "self_attn.o_proj.weight": ("attn_output.weight", ("attention_out_multiplier",)),
    "mamba.in_proj.weight": ("ssm_in.weight", ("ssm_in_multiplier",)),
    "mamba.out_proj.weight": ("ssm_out.weight", ("ssm_out_multiplier",)),
    "mamba.conv1d.bias": ("ssm_conv1d.bias", ()),
    "mamba.dt_bias": ("ssm_dt.bias", ()),
}


def _falcon_h1_tensors(state: dict[str, torch.Tensor], config):
    """Falcon-H1's tensors as llama.cpp's converter writes them: its multipliers folded
    into the weights they scale (the embedding's and the head's too), the Mamba-2's
    projection scaled part by part, the conv taps ``[channels, kernel]``, A as
    ``-exp(A_log)`` and D as columns, the SSM norm a row per group. (The tiny model's
    file matched the converter's own, its tokenizer check bypassed, tensor for tensor and
    key for key.)"""
    hp = config.to_dict()
    inner, groups = hp["mamba_d_ssm"], hp["mamba_n_groups"] * hp["mamba_d_state"]
    sizes = (inner, inner, groups, groups, hp["mamba_n_heads"])
    parts = zip(sizes, hp["ssm_multipliers"], strict=True)
    segments = torch.cat([torch.full((n,), s) for n, s in parts])
    for name, tensor in state.items():
        tensor = tensor.float()
        if name == "model.embed_tokens.weight":
            yield name, tensor * hp["embedding_multiplier"]
            continue
        if name == "lm_head.weight":
            yield name, tensor * hp["lm_head_multiplier"]
            continue
        if name == "model.final_layernorm.weight":
            yield "model.norm.weight", tensor
            continue
        _, _, index, rest = name.split(".", 3)
        block = f"blk.{index}."
        if rest == "mamba.conv1d.weight":
            yield block + "ssm_conv1d.weight", tensor.squeeze(1)
        elif rest == "mamba.A_log":
            yield block + "ssm_a", -torch.exp(tensor).reshape(-1, 1)
        elif rest == "mamba.D":
            yield block + "ssm_d", tensor.reshape(-1, 1)
        elif rest == "mamba.norm.weight":
            yield block + "ssm_norm.weight", tensor.reshape(hp["mamba_n_groups"], -1)
        else:
            gguf_name, multipliers = _FALCON_H1_NAMES[rest]
            for key in multipliers:
                tensor = tensor * (hp[key[0]][key[1]] if isinstance(key, tuple) else hp[key])
            if rest == "mamba.in_proj.weight":
                tensor = tensor * segments[:, None]
            yield block + gguf_name, tensor


# Jamba's layer tensors that llama.cpp's converter renames without a change.
_JAMBA_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "pre_ff_layernorm.weight": "ffn_norm.weight",
    "feed_forward.gate_proj.weight": "ffn_gate.weight",
    "feed_forward.up_proj.weight": "ffn_up.weight",
    "feed_forward.down_proj.weight": "ffn_down.weight",
    "feed_forward.router.weight": "ffn_gate_inp.weight",
    "feed_forward.experts.down_proj": "ffn_down_exps.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mamba.D": "ssm_d",
    "mamba.conv1d.bias": "ssm_conv1d.bias",
    "mamba.in_proj.weight": "ssm_in.weight",
    "mamba.x_proj.weight": "ssm_x.weight",
    "mamba.dt_proj.weight": "ssm_dt.weight",
    "mamba.dt_proj.bias": "ssm_dt.bias",
    "mamba.out_proj.weight": "ssm_out.weight",
    "mamba.dt_layernorm.weight": "ssm_dt_norm.weight",
    "mamba.b_layernorm.weight": "ssm_b_norm.weight",
    "mamba.c_layernorm.weight": "ssm_c_norm.weight",
}


def _jamba_tensors(state: dict[str, torch.Tensor]):
    """Jamba's tensors as llama.cpp's converter writes them: the experts stacked by
    projection, the conv taps ``[channels, kernel]``, A as ``-exp(A_log)``. (The tiny
    model's file matched the converter's own, its tokenizer readers bypassed, tensor for
    tensor and key for key.)"""
    for name, tensor in state.items():
        if name == "model.final_layernorm.weight":
            yield "model.norm.weight", tensor
            continue
        if not name.startswith("model.layers."):
            yield name, tensor
            continue
        _, _, index, rest = name.split(".", 3)
        block = f"blk.{index}."
        if rest == "feed_forward.experts.gate_up_proj":
            gate, up = tensor.chunk(2, dim=1)
            yield block + "ffn_gate_exps.weight", gate
            yield block + "ffn_up_exps.weight", up
        elif rest == "mamba.conv1d.weight":
            yield block + "ssm_conv1d.weight", tensor.squeeze(1)
        elif rest == "mamba.A_log":
            yield block + "ssm_a", -torch.exp(tensor)
        else:
            yield block + _JAMBA_NAMES[rest], tensor


def _stablelm_tensors(state: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """StableLM's per-head q and k norms (``q_layernorm.norms.{h}``) stacked, a row per
    head, under the names ours map from: as llama.cpp's converter stores them."""
    heads: dict[str, list[torch.Tensor]] = {}
    for name, tensor in state.items():
        for theirs, ours in (("q_layernorm", "q_norm"), ("k_layernorm", "k_norm")):
            if f".self_attn.{theirs}.norms." in name:
                layer = name.partition(f".{theirs}.norms.")[0]
                heads.setdefault(f"{layer}.{ours}.weight", []).append(tensor)
                break
        else:
            yield name, tensor
    for name, rows in heads.items():  # (state dicts keep the heads in order)
        yield name, torch.stack(rows)


def _add_tensor(
    writer: GGUFWriter, name: str, data: np.ndarray, qtype: GGMLQuantizationType
) -> None:
    # llama.cpp's quantizer keeps the router (ffn_gate_inp), norms and biases in float.
    kept = name.endswith(("ffn_gate_inp.weight", "norm.weight")) or not name.endswith(".weight")
    if qtype == GGMLQuantizationType.F32 or data.ndim == 1 or data.shape[-1] % 32 or kept:
        writer.add_tensor(name, data.astype(np.float32))
    else:
        writer.add_tensor(name, quants.quantize(data, qtype), raw_dtype=qtype)


def _write_metadata(writer: GGUFWriter, tiny: TinyModel, config, mtp_layers: int = 0) -> None:
    if tiny.arch == "gemma4":
        _write_gemma4_metadata(writer, config)
        _write_tokenizer(writer, tiny.tokenizer)
        return
    writer.add_context_length(MAX_POSITIONS)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(config.num_hidden_layers + mtp_layers)
    if mtp_layers:
        writer.add_nextn_predict_layers(mtp_layers)
    if getattr(config, "intermediate_size", None):  # (none where every layer has experts)
        writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(HEADS)
    if tiny.arch == "granitemoehybrid":
        _write_granite_metadata(writer, config)
    elif tiny.arch == "jamba":
        _write_jamba_metadata(writer, config)
        _write_tokenizer(writer, tiny.tokenizer)
        return
    else:
        writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    if tiny.arch == "stablelm":  # LayerNorms: their eps under llama.cpp's key for them
        writer.add_layer_norm_eps(config.layer_norm_eps)
        writer.add_parallel_residual(config.use_parallel_residual)
    else:
        # (llama.cpp's converter writes 1e-5 for every OLMoE: the tiny one's own value)
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = config.rope_parameters.get("full_attention", config.rope_parameters)
    if rope["rope_type"] == "dynamic":  # HunYuan's NTK-alpha: the converter raises the base
        writer.add_rope_freq_base(rope["rope_theta"] * rope["alpha"] ** (HEAD_DIM / (HEAD_DIM - 2)))
    else:
        writer.add_rope_freq_base(rope["rope_theta"])
    if tiny.arch != "falcon_h1":  # (its converter leaves it to the head size)
        writer.add_rope_dimension_count(int(HEAD_DIM * rope.get("partial_rotary_factor", 1.0)))
    if rope["rope_type"] == "linear":
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if rope["rope_type"] == "yarn":
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if rope["rope_type"] == "longrope":
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        if getattr(config, "moe_intermediate_size", None):
            writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        if tiny.arch == "gpt_oss":  # its experts' size is intermediate_size
            writer.add_expert_feed_forward_length(config.intermediate_size)
    if getattr(config, "clip_qkv", None):
        # llama.cpp's converter writes this key for OLMo but not for OLMoE (whose graph does
        # not clamp); written here so that the tiny OLMoE's twin is the same model.
        writer.add_clamp_kqv(config.clip_qkv)
    if tiny.arch == "apertus":
        _write_xielu_metadata(writer, tiny.hf)
    if tiny.arch in ("qwen3_5", "qwen3_5_moe"):
        _write_qwen35_metadata(writer, _GGUF_ARCH[tiny.arch], config, mtp_layers)
    if tiny.arch == "falcon_h1":
        writer.add_vocab_size(config.vocab_size)
        writer.add_ssm_conv_kernel(config.mamba_d_conv)
        writer.add_ssm_inner_size(config.mamba_d_ssm)
        writer.add_ssm_state_size(config.mamba_d_state)
        writer.add_ssm_time_step_rank(config.mamba_n_heads)
        writer.add_ssm_group_count(config.mamba_n_groups)
    if getattr(config, "shared_expert_intermediate_size", None):
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    # (Gemma 2's alternation is llama.cpp's default)
    if tiny.arch in ("gemma3", "olmo2", "exaone4"):
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in config.layer_types])
    if tiny.arch in ("gemma2", "gemma3"):  # (Gemma 1 has no softcaps)
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    _write_tokenizer(writer, tiny.tokenizer)


def _write_gemma4_metadata(writer: GGUFWriter, config) -> None:
    """The keys llama.cpp's converter writes for Gemma 4 from ``config.json`` (each with
    its last value where it writes one twice): the global layers' head size as key_length
    and the sliding layers' as key_length_swa, K/V heads per layer where the global
    layers' count is given, MLP widths per layer where the shared layers' is doubled,
    both rope bases, the global rope's full width (its still pairs: tensor rope_freqs)."""
    hp = config.to_dict()
    sliding = [t == "sliding_attention" for t in hp["layer_types"]]
    layers, shared = hp["num_hidden_layers"], hp["num_kv_shared_layers"]
    local_dim, global_dim = hp["head_dim"], _gemma4_global(hp, "global_head_dim", "head_dim")
    writer.add_block_count(layers)
    writer.add_context_length(hp["max_position_embeddings"])
    writer.add_embedding_length(hp["hidden_size"])
    inner = hp["intermediate_size"]
    if hp["use_double_wide_mlp"]:
        writer.add_feed_forward_length(
            [inner if i < layers - shared else 2 * inner for i in range(layers)]
        )
    else:
        writer.add_feed_forward_length(inner)
    writer.add_head_count(hp["num_attention_heads"])
    kv_local = hp["num_key_value_heads"]
    kv_global = _gemma4_global(hp, "num_global_key_value_heads", "num_key_value_heads")
    if kv_global is not None:
        writer.add_head_count_kv([kv_local if s else kv_global for s in sliding])
    else:
        writer.add_head_count_kv(kv_local)
    writer.add_rope_freq_base(hp["rope_parameters"]["full_attention"]["rope_theta"])
    writer.add_rope_freq_base_swa(hp["rope_parameters"]["sliding_attention"]["rope_theta"])
    writer.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    writer.add_key_length(global_dim)
    writer.add_value_length(global_dim)
    writer.add_key_length_swa(local_dim)
    writer.add_value_length_swa(local_dim)
    writer.add_final_logit_softcapping(hp["final_logit_softcapping"])
    writer.add_sliding_window(hp["sliding_window"])
    writer.add_shared_kv_layers(shared)
    writer.add_embedding_length_per_layer_input(hp["hidden_size_per_layer_input"])
    writer.add_sliding_window_pattern(sliding)
    writer.add_rope_dimension_count(global_dim)
    writer.add_rope_dimension_count_swa(local_dim)


def _gemma4_global(hp: dict, key: str, layer_key: str):
    """A global layer's value as the converter finds it: the config's key, else the
    first full layer's entry in ``per_layer_config``."""
    if hp.get(key) is not None:
        return hp[key]
    full = [i for i, t in enumerate(hp["layer_types"]) if t == "full_attention"]
    layer = (hp.get("per_layer_config") or {}).get(str(full[0]), {}) if full else {}
    return layer.get(layer_key)


def _gemma4_rope_freqs(config) -> np.ndarray:
    """The converter's divisors of the global rope's frequencies: 1 for the pairs that
    turn, 1e30 for those that stand still."""
    hp = config.to_dict()
    global_dim = _gemma4_global(hp, "global_head_dim", "head_dim")
    share = hp["rope_parameters"]["full_attention"]["partial_rotary_factor"]
    turning = int(global_dim * share / 2)
    return np.array([1.0] * turning + [1e30] * (global_dim // 2 - turning), dtype=np.float32)


def _write_xielu_metadata(writer: GGUFWriter, model: torch.nn.Module) -> None:
    """Apertus's xIELU scalars, one per layer, as its checkpoint stores them (the keys
    carry no architecture prefix)."""
    layers = model.model.layers
    for name in ("alpha_p", "alpha_n", "beta", "eps"):
        values = [float(getattr(layer.mlp.act_fn, name).detach().flatten()[0]) for layer in layers]
        writer.add_array(f"xielu.{name}", values)


def _write_qwen35_metadata(writer: GGUFWriter, arch: str, config, mtp_layers: int) -> None:
    """The keys llama.cpp's converter writes for a Qwen3.5's DeltaNet layers (an MTP
    block's flag false: it attends)."""
    writer.add_uint32(f"{arch}.ssm.conv_kernel", config.linear_conv_kernel_dim)
    writer.add_uint32(f"{arch}.ssm.state_size", config.linear_key_head_dim)
    writer.add_uint32(f"{arch}.ssm.group_count", config.linear_num_key_heads)
    writer.add_uint32(f"{arch}.ssm.time_step_rank", config.linear_num_value_heads)
    inner = config.linear_value_head_dim * config.linear_num_value_heads
    writer.add_uint32(f"{arch}.ssm.inner_size", inner)
    recurrent = [t == "linear_attention" for t in config.layer_types] + [False] * mtp_layers
    writer.add_array(f"{arch}.attention.recurrent_layers", recurrent)
    writer.add_uint32(f"{arch}.full_attention_interval", 4)


def _write_granite_metadata(writer: GGUFWriter, config) -> None:
    """What llama.cpp's converter writes for Granite 4.0-H beside the common keys: K/V
    heads per layer (0: a Mamba-2 layer), the SSM's sizes, the multipliers, rope off."""
    attention = [t == "full_attention" for t in config.layer_types]
    writer.add_head_count_kv([KV_HEADS if a else 0 for a in attention])
    writer.add_ssm_conv_kernel(config.mamba_d_conv)
    writer.add_ssm_inner_size(config.mamba_n_heads * config.mamba_d_head)
    writer.add_ssm_state_size(config.mamba_d_state)
    writer.add_ssm_time_step_rank(config.mamba_n_heads)
    writer.add_ssm_group_count(config.mamba_n_groups)
    writer.add_attention_scale(config.attention_multiplier)
    writer.add_embedding_scale(config.embedding_multiplier)
    writer.add_residual_scale(config.residual_multiplier)
    writer.add_logit_scale(config.logits_scaling)
    writer.add_rope_scaling_finetuned(config.position_embedding_type == "rope")
    writer.add_expert_shared_feed_forward_length(config.shared_intermediate_size)


def _write_jamba_metadata(writer: GGUFWriter, config) -> None:
    """What llama.cpp's converter writes for Jamba beside the common sizes: K/V heads per
    layer (0: a Mamba layer), the SSM's sizes, the experts; no head size, no rope."""
    attention = [t == "full_attention" for t in config.layer_types]
    writer.add_head_count_kv([KV_HEADS if a else 0 for a in attention])
    writer.add_ssm_conv_kernel(config.mamba_d_conv)
    writer.add_ssm_inner_size(config.mamba_expand * config.hidden_size)
    writer.add_ssm_state_size(config.mamba_d_state)
    writer.add_ssm_time_step_rank(config.mamba_dt_rank)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_expert_count(config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)


def _write_rope_tensors(writer: GGUFWriter, tiny: TinyModel) -> None:
    if tiny.arch == "jamba":  # its attention does not rotate
        return
    rope = tiny.hf.config.rope_parameters
    if tiny.arch == "gemma4":
        writer.add_tensor("rope_freqs.weight", _gemma4_rope_freqs(tiny.hf.config))
    if rope.get("rope_type") == "llama3":
        # llama.cpp stores Llama 3's scaling as per-dimension divisors of the frequencies.
        rotary = tiny.hf.model.rotary_emb
        dim = HEAD_DIM
        base = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim))
        writer.add_tensor("rope_freqs.weight", (base / rotary.inv_freq).numpy())
    if rope.get("rope_type") == "longrope":
        writer.add_tensor(
            "rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32)
        )
        writer.add_tensor(
            "rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32)
        )


def _write_tokenizer(writer: GGUFWriter, tokenizer: PreTrainedTokenizerFast) -> None:
    vocab = tokenizer.get_vocab()
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    writer.add_bos_token_id(BOS)
    writer.add_eos_token_id(EOS)
    writer.add_pad_token_id(PAD)
    writer.add_add_bos_token(True)


# ---- gpt-oss as OpenAI's checkpoints store it: experts in MXFP4 ---------------------------

E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def mxfp4_microscaling(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., rows, cols]`` floats as OpenAI's MXFP4 tensors: blocks ``[..., rows, cols /
    32, 16]`` (values 2i and 2i + 1 in the low and high nibble of byte i) and E8M0 scales
    ``[..., rows, cols / 32]``: each group of 32 under the smallest power of two that
    brings its largest value within E2M1's 6, each value rounded to the nearest E2M1."""
    groups = weight.float().unflatten(-1, (-1, 32))
    largest = groups.abs().amax(-1, keepdim=True).clamp_min(2.0**-126)
    exponent = torch.ceil(torch.log2(largest / 6)).clamp(-127, 127)
    codes = ((groups / 2.0**exponent).unsqueeze(-1) - E2M1).abs().argmin(-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent.squeeze(-1) + 127).to(torch.uint8)


def write_mxfp4_gpt_oss(tiny: TinyModel, path: Path) -> dict[str, torch.Tensor]:
    """``tiny`` (a gpt-oss) as OpenAI's checkpoints store it, at ``path``: its experts
    quantized to MXFP4 blocks and scales (stored ``[experts, out, in]``: transformers' float
    layout transposed), the ``quantization_config`` in config.json. Returns the experts
    dequantized in transformers' float layout (by transformers' own converter)."""
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    path.mkdir(parents=True)
    tiny.tokenizer.save_pretrained(path)
    tiny.hf.generation_config.save_pretrained(path)
    config = tiny.hf.config.to_dict()
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    tensors, dequantized = {}, {}
    for name, param in tiny.hf.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = mxfp4_microscaling(param.transpose(1, 2))
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
            dequantized[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        else:
            tensors[name] = param.contiguous()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return dequantized


# ---- LoRA adapters ----------------------------------------------------------------------

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(
    path: Path,
    hf: torch.nn.Module,
    seed: int,
    rank: int = 4,
    alpha: float = 8.0,
    targets: tuple[str, ...] = LORA_TARGETS,
    **config,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A random adapter over every projection, in PEFT's files; its (A, B) by module."""
    gen = torch.Generator().manual_seed(seed)
    pairs, tensors = {}, {}
    for name, module in hf.named_modules():
        if name.split(".")[-1] in targets and isinstance(module, torch.nn.Linear):
            a = torch.randn(rank, module.in_features, generator=gen) * 0.3
            b = torch.randn(module.out_features, rank, generator=gen) * 0.3
            pairs[name] = (a, b)
            tensors[f"base_model.model.{name}.lora_A.weight"] = a
            tensors[f"base_model.model.{name}.lora_B.weight"] = b
    path.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    save_file(tensors, path / "adapter_model.safetensors")
    fields = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": list(targets),
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "lora_dropout": 0.0,
        **config,
    }
    (path / "adapter_config.json").write_text(json.dumps(fields))
    return pairs


def write_gguf_adapter(
    path: Path, arch: str, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], alpha: float
) -> Path:
    """``pairs`` (from `write_adapter`) as a GGUF LoRA adapter in llama.cpp's layout: each
    projection's ``lora_a [r, in]`` and ``lora_b [out, r]``, q and k rows permuted for the
    architectures llama.cpp permutes."""
    gguf_arch = _GGUF_ARCH[arch]
    writer = GGUFWriter(path, gguf_arch)
    writer.add_type("adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", alpha)
    writer.add_quantization_version(2)  # as llama.cpp's converter writes it
    for name, (a, b) in pairs.items():
        lora_b = b.float().numpy()
        if arch in _PERMUTED and name.endswith(("q_proj", "k_proj")):
            lora_b = _permute(lora_b, HEADS if name.endswith("q_proj") else KV_HEADS)
        stem = _gguf_name(f"{name}.weight", gguf_arch)
        writer.add_tensor(f"{stem}.lora_a", a.float().numpy())
        writer.add_tensor(f"{stem}.lora_b", np.ascontiguousarray(lora_b))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
