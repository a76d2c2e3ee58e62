"""Llama 4 beyond what the registry's MoE tests run (tests/test_moe.py: logits and greedy
tokens against transformers, routing, batches, ISQ): each of its mechanisms moves the
tiny model's logits (so matching transformers checks each), a paged batch across chunk
boundaries with a prefix hit, its multimodal wrapper, a GGUF written by llama.cpp's own
converter, and what the engine refuses for chunked attention."""

import json
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType, GGUFValueType
from helpers import CPU, model_logits
from llama_cpp_converter import convert_one
from model_file_mutations import parse_gguf, with_value, write_gguf_bytes
from safetensors.torch import load_file, save_file
from tiny_models import TinyModel, build_hf_model

from spnl_backend import BackendSettings, ModelFileError, SettingsError, load_backend
from spnl_backend.engine.scheduler import Scheduler
from spnl_backend.quant.linear import QuantLinear

# llama.cpp's tree (its converter and gguf-py); the converter tests skip without it.
PROMPT = "the cat sat on the mat and the dog"
Q8_0_RELATIVE_L2 = 0.08  # tests/test_models.py's bound, measured there at 3 and 4 layers
# The constants llama.cpp's graph uses for every llama4 file, which its files do not keep.
LLAMA_CPP_CONSTANTS = {"attention_chunk_size": 8192, "floor_scale": 8192, "attn_scale": 0.1}


@pytest.fixture(scope="module")
def llama4(tiny) -> tuple[TinyModel, object]:
    return tiny.hf("llama4"), tiny.backend("llama4")


def _logits(model: TinyModel, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model.hf(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize(
    "variant",
    [{"attention_chunk_size": 4096}, {"attn_temperature_tuning": False}, {"use_qk_norm": False}],
    ids=["no-chunks", "no-temperature", "no-qk-norm"],
)
def test_each_mechanism_moves_the_logits_and_each_variant_matches(llama4, tmp_path, variant):
    """The tiny model without one of its mechanisms (the same weights) gives other logits,
    so the tiny model's match with transformers holds each to account; and the variant,
    loaded as its config says, matches transformers too."""
    reference, _ = llama4
    ids = reference.tokenizer(PROMPT).input_ids
    other = build_hf_model("llama4", tmp_path / "variant", overrides=variant)
    moved = (_logits(other, ids) - _logits(reference, ids)).abs().max()
    assert moved > 0.05
    ours = model_logits(load_backend(str(other.path), settings=CPU), ids)
    torch.testing.assert_close(ours, _logits(other, ids), atol=1e-4, rtol=1e-4)


def test_a_paged_batch_across_chunk_boundaries(llama4):
    """Prompts of several lengths, each crossing chunks of 4 (blocks of 8), in one batch and
    in prefill pieces of 7 tokens (ending mid-chunk), then again with their prefix cached:
    each sequence's greedy tokens are transformers' alone."""
    reference, _ = llama4
    settings = BackendSettings(device="cpu", paged_attn=True, paged_attn_block_size=8)
    backend = load_backend(str(reference.path), settings=settings)
    prompts = [PROMPT, "once upon a time there was", "x = 1 + 2 + 3 + 4 + 5 + 6 + 7 + 8"]
    expected = []
    for prompt in prompts:
        ids = reference.tokenizer(prompt).input_ids
        out = reference.hf.generate(
            torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False
        )
        expected.append(out[0, len(ids) :].tolist())
    kwargs = dict(max_tokens=12, temperature=0, ignore_eos=True)
    assert [r.token_ids for r in backend.generate(prompts, **kwargs)] == expected
    scheduler: Scheduler = backend._loop.call(lambda engine: engine.scheduler)
    scheduler.max_num_batched_tokens = 7
    try:
        again = backend.generate(prompts, **kwargs)
    finally:
        scheduler.max_num_batched_tokens = 2048
    assert [r.token_ids for r in again] == expected
    assert any(r.usage.cached_tokens >= 8 for r in again)  # whole blocks, from the first run


def test_the_multimodal_wrapper_loads_its_language_model(llama4, tmp_path):
    """A ``llama4`` checkpoint: the text config under ``text_config``, the language model's
    weights under ``language_model.``, a vision tower beside them (left unread)."""
    reference, backend = llama4
    wrapped = tmp_path / "wrapped"
    wrapped.mkdir()
    text = json.loads((reference.path / "config.json").read_text())
    config = {"model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"]}
    config["text_config"] = text
    (wrapped / "config.json").write_text(json.dumps(config))
    tensors = {
        f"language_model.{k}": v for k, v in load_file(reference.path / "model.safetensors").items()
    }
    tensors["vision_model.patch_embedding.linear.weight"] = torch.ones(4, 4)
    tensors["multi_modal_projector.linear_1.weight"] = torch.ones(4, 4)
    save_file(tensors, wrapped / "model.safetensors")
    reference.tokenizer.save_pretrained(wrapped)
    ids = reference.tokenizer(PROMPT).input_ids
    ours = load_backend(str(wrapped), settings=CPU)
    assert ours.model_config.architecture == "llama4"
    assert torch.equal(model_logits(ours, ids), model_logits(backend, ids))


@pytest.fixture(scope="module")
def converted(tiny, tmp_path_factory) -> tuple[TinyModel, Path]:
    """The tiny model with llama.cpp's constants, and its GGUF as llama.cpp's converter
    writes it (float32)."""
    root = tmp_path_factory.mktemp("llama4-gguf")
    model = build_hf_model("llama4", root / "hf", overrides=LLAMA_CPP_CONSTANTS)
    return model, _convert(model, root / "model-f32.gguf", "f32")


def _convert(model: TinyModel, path: Path, outtype: str) -> Path:
    return convert_one(model.path, path, outtype)


def test_a_gguf_from_llama_cpps_converter_is_the_same_model(converted):
    """q and k rows kept in pairs (no permutation), the experts stacked, the shared expert
    as ``*_shexp``, the dense layers' width as feed_forward_length; the chunk, temperature
    and the layer that does not rotate as llama.cpp's graph fixes them: the logits and
    greedy tokens of transformers' model with those constants, and its tokenizer's ids
    from the file's vocabulary."""
    model, path = converted
    twin = load_backend(str(path), settings=CPU)
    config = twin.model_config
    assert config.layer_types == ("chunked", "chunked", "chunked", "full")
    assert config.rope_layers == (True, True, True, False)
    assert (config.attention_chunk_size, config.qk_norm_unit) == (8192, True)
    assert config.moe.sparse == (False, True, False, True)
    assert config.moe.routing == "sigmoid_input"
    ids = model.tokenizer(PROMPT).input_ids
    torch.testing.assert_close(model_logits(twin, ids), _logits(model, ids), atol=1e-4, rtol=1e-4)
    out = model.hf.generate(
        torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False
    )
    result = twin.generate(prompt_token_ids=ids, max_tokens=16, temperature=0, ignore_eos=True)
    assert result.token_ids == out[0, len(ids) :].tolist()
    for text in (PROMPT, "def add(a, b):\n    return a + b", "  spaces  and\ttabs "):
        assert twin.tokenizer.encode(text) == model.tokenizer(text).input_ids


def test_a_q8_0_gguf_from_the_converter_is_within_quantization_error(converted, tmp_path):
    """Q8_0 q and k matrices reordered a row of blocks at a time: the logits within Q8_0's
    error of the float file's (a misplaced row moves them by about their whole size)."""
    model, path = converted
    quantized = load_backend(str(_convert(model, tmp_path / "q8_0.gguf", "q8_0")), settings=CPU)
    attention = quantized.model.model.layers[0].self_attn
    assert isinstance(attention.q_proj, QuantLinear)
    assert attention.q_proj.weight_q.qtype == GGMLQuantizationType.Q8_0
    ids = model.tokenizer(PROMPT).input_ids
    reference = model_logits(load_backend(str(path), settings=CPU), ids)
    error = (model_logits(quantized, ids) - reference).norm() / reference.norm()
    assert error < Q8_0_RELATIVE_L2


def test_a_gguf_llama_cpp_reads_as_chunk_free_is_refused(converted, tmp_path):
    """``attention.sliding_window`` 0: a model llama.cpp runs without chunks but with its
    last layer unrotated and no temperature, which no checkpoint describes."""
    _, path = converted
    source = parse_gguf(path.read_bytes())
    changed = with_value(source, "llama4.attention.sliding_window", GGUFValueType.UINT32, 0)
    bad = tmp_path / "chunk-free.gguf"
    bad.write_bytes(write_gguf_bytes(changed))
    with pytest.raises(ModelFileError, match=r"'llama4\.attention\.sliding_window' is 0"):
        load_backend(str(bad), settings=CPU)


@pytest.mark.parametrize(
    "asked", [{"kv_cache_compression": "int8"}, {"pic_recompute": 0.5}], ids=["int8", "pic"]
)
def test_compression_and_pic_settings_are_refused_by_name(llama4, asked):
    reference, _ = llama4
    with pytest.raises(SettingsError, match="within chunks of absolute positions"):
        load_backend(str(reference.path), settings=BackendSettings(device="cpu", **asked))


def test_pic_prompts_are_refused_with_the_reason(llama4):
    from spnl_backend import RequestError

    _, backend = llama4
    encode = backend.tokenizer.encode_plain
    pieces = [("cross", encode("a b")), ("plus", encode("c d")), ("cross", encode("e"))]
    with pytest.raises(RequestError, match="chunks of absolute positions"):
        backend.generate(blocks=pieces, max_tokens=2, temperature=0)
