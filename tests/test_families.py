"""What particular families read beyond their tiny model (tests/test_models.py runs every
family's): the checkpoints and GGUF architectures that share a family's layers, and what
each refuses by name."""

import json

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType
from helpers import CPU, PROMPT, model_logits
from model_file_mutations import Entry, parse_gguf, with_value, write_gguf_bytes
from safetensors.torch import save_file

from spnl_backend import load_backend
from spnl_backend.errors import ModelFileError, UnsupportedArchitectureError


def _as_arch(raw: bytes, old: str, new: str):
    """A GGUF file's parts with its architecture renamed (its keys moved with it)."""
    parts = parse_gguf(raw)
    for i, e in enumerate(parts.entries):
        if e.key == "general.architecture":
            parts.entries[i] = Entry(e.key, e.vtype, new)
        elif e.key.startswith(f"{old}."):
            parts.entries[i] = Entry(new + e.key.removeprefix(old), e.vtype, e.value, e.item_type)
    return parts


def test_a_mistral3_checkpoint_loads_its_language_model(tiny, tmp_path):
    """Mistral Small 3.1's layout: the text config nested in a ``mistral3`` one, the
    language model's weights under ``model.language_model.``, a vision model beside them
    (left unread)."""
    model = tiny.hf("mistral")
    config = {"model_type": "mistral3", "text_config": model.hf.config.to_dict()}
    (tmp_path / "config.json").write_text(json.dumps(config))
    weights = {
        name.replace("model.", "model.language_model.", 1): tensor.contiguous()
        for name, tensor in model.hf.state_dict().items()
    }
    weights["model.vision_tower.patch_conv.weight"] = torch.zeros(4, 4)
    weights["model.multi_modal_projector.linear_1.weight"] = torch.zeros(4, 4)
    save_file(weights, tmp_path / "model.safetensors")
    model.tokenizer.save_pretrained(tmp_path)
    ids = model.tokenizer(PROMPT).input_ids
    wrapped = load_backend(str(tmp_path), settings=CPU)
    assert wrapped.model_config == tiny.backend("mistral").model_config
    torch.testing.assert_close(
        model_logits(wrapped, ids), model_logits(tiny.backend("mistral"), ids), atol=0, rtol=0
    )


def test_a_ministral3_text_config_is_refused_by_name(tiny, tmp_path):
    model = tiny.hf("mistral")
    (tmp_path / "model.safetensors").write_bytes((model.path / "model.safetensors").read_bytes())
    text = {**model.hf.config.to_dict(), "model_type": "ministral3"}
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "mistral3", "text_config": text})
    )
    with pytest.raises(UnsupportedArchitectureError, match="'ministral3' is not supported"):
        load_backend(str(tmp_path), settings=CPU)


def test_a_mistral3_gguf_is_mistral_and_ministral3s_keys_are_refused(tiny, tmp_path):
    """llama.cpp's ``mistral3`` files: Llama's layout (q and k permuted) under their own
    architecture name; the keys its converter writes for Ministral 3 alone are refused."""
    parts = _as_arch(tiny.gguf("mistral", Q.F32).read_bytes(), "llama", "mistral3")
    path = tmp_path / "mistral3.gguf"
    path.write_bytes(write_gguf_bytes(parts))
    ids = tiny.hf("mistral").tokenizer(PROMPT).input_ids
    torch.testing.assert_close(
        model_logits(load_backend(str(path), settings=CPU), ids),
        model_logits(tiny.backend("mistral"), ids),
        atol=1e-4,
        rtol=1e-4,
    )
    for key in ("attention.temperature_scale", "rope.scaling.yarn_log_multiplier"):
        wrong = tmp_path / f"{key}.gguf"
        mutated = with_value(parts, f"mistral3.{key}", GGUFValueType.FLOAT32, 0.1)
        wrong.write_bytes(write_gguf_bytes(mutated))
        with pytest.raises(UnsupportedArchitectureError, match=key.replace(".", r"\.")):
            load_backend(str(wrong), settings=CPU)


def test_a_chatglm_gguf_with_fused_qkv_is_refused(tiny, tmp_path):
    """The older ChatGLM conversions fuse q, k and v (``attn_qkv``): refused by name."""
    parts = parse_gguf(tiny.gguf("glm", Q.F32).read_bytes())
    for tensor in parts.tensors:
        if tensor.name == "blk.0.attn_q.weight":
            tensor.name = "blk.0.attn_qkv.weight"
    path = tmp_path / "fused.gguf"
    path.write_bytes(write_gguf_bytes(parts))
    with pytest.raises(UnsupportedArchitectureError, match=r"fused q/k/v \(blk\.0\.attn_qkv"):
        load_backend(str(path), settings=CPU)


def test_ernie_with_biased_projections_is_refused(tiny, tmp_path):
    source = tiny.hf("ernie4_5").path
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((source / name).read_bytes())
    config = json.loads((source / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "use_bias": True}))
    with pytest.raises(ModelFileError, match="'use_bias' is True; expected false"):
        load_backend(str(tmp_path), settings=CPU)


def test_apertus_gguf_xielu_scalars_are_checked(tiny, tmp_path):
    """xIELU's per-layer scalars (metadata without an architecture prefix): one per layer
    or one for all; any other count is refused naming the key."""
    parts = parse_gguf(tiny.gguf("apertus", Q.F32).read_bytes())
    ids = tiny.hf("apertus").tokenizer(PROMPT).input_ids
    beta = float(parts.entry("xielu.beta").value[0])
    path = tmp_path / "one.gguf"
    path.write_bytes(write_gguf_bytes(with_value(parts, "xielu.beta", GGUFValueType.FLOAT32, beta)))
    torch.testing.assert_close(  # the tiny model's betas are all alike (transformers' 0.5)
        model_logits(load_backend(str(path), settings=CPU), ids),
        model_logits(tiny.backend("apertus"), ids),
        atol=1e-4,
        rtol=1e-4,
    )
    wrong = with_value(parts, "xielu.beta", GGUFValueType.ARRAY, [beta], GGUFValueType.FLOAT32)
    path = tmp_path / "wrong.gguf"
    path.write_bytes(write_gguf_bytes(wrong))
    with pytest.raises(ModelFileError, match=r"'xielu\.beta' .*3 of them \(one per layer\)"):
        load_backend(str(path), settings=CPU)


def test_a_bidirectional_gemma_is_refused(tiny, tmp_path):
    source = tiny.hf("gemma").path
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((source / name).read_bytes())
    config = json.loads((source / "config.json").read_text())
    (tmp_path / "config.json").write_text(
        json.dumps({**config, "use_bidirectional_attention": True})
    )
    with pytest.raises(ModelFileError, match="'use_bidirectional_attention' is True"):
        load_backend(str(tmp_path), settings=CPU)


def test_a_gguf_sliding_window_of_0_is_none(tiny, tmp_path):
    """llama.cpp's converters write a window of 0 for none (Phi-3 without one)."""
    parts = parse_gguf(tiny.gguf("llama", Q.F32).read_bytes())
    path = tmp_path / "unwindowed.gguf"
    mutated = with_value(parts, "llama.attention.sliding_window", GGUFValueType.UINT32, 0)
    path.write_bytes(write_gguf_bytes(mutated))
    backend = load_backend(str(path), settings=CPU)
    assert backend.model_config.sliding_window is None
    ids = tiny.hf("llama").tokenizer(PROMPT).input_ids
    torch.testing.assert_close(
        model_logits(backend, ids), model_logits(tiny.backend("llama"), ids), atol=1e-4, rtol=1e-4
    )
