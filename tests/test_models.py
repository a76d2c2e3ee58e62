"""Every architecture against transformers' implementation of the same tiny model, and each
model's GGUF twin against its safetensors original."""

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter
from helpers import CPU, PROMPT, engine_internals, model_logits
from tiny_models import (
    ARCHITECTURES,
    CHAT_TURNS,
    CONVERTED,
    CONVERTIBLE,
    HYBRID_ARCHITECTURES,
    KV_GROUP_ARCHITECTURES,
    MLA_ARCHITECTURES,
    MOE_ARCHITECTURES,
    hf_config,
)

from spnl_backend import load_backend
from spnl_backend.models.arch import FAMILIES

# Q8_0 keeps ~8 bits per weight: over these random models the logits move by a few percent
# of their spread, more with depth (measured, relative L2 error: 0.4-1.3% at 3 layers,
# 5.3-6.0% at 4, Llama and SmolLM3 alike); 8% bounds it with room (a misread tensor: ~100%).
Q8_0_RELATIVE_L2 = 0.08
# The families whose tiny model's GGUF twin these tests compare (those with experts or
# state layers: tests/test_moe.py, tests/test_hybrid.py), where llama.cpp converts them.
GGUF_TWINS = tuple(a for a in (*ARCHITECTURES, *KV_GROUP_ARCHITECTURES) if a in CONVERTIBLE)
# The families compared with transformers here: the dense ones and those with latent
# attention (DeepSeek; their other tests are tests/test_mla.py).
COMPARED = (*ARCHITECTURES, *MLA_ARCHITECTURES)


@pytest.mark.parametrize("arch", COMPARED)
def test_logits_match_transformers(tiny, arch):
    model = tiny.hf(arch)
    ids = model.tokenizer(PROMPT).input_ids
    with torch.no_grad():
        expected = model.hf(torch.tensor([ids])).logits[0]
    ours = model_logits(tiny.backend(arch), ids)
    assert expected.std() > 0.5  # peaked enough that the comparison means something
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", COMPARED)
def test_32_greedy_tokens_match_transformers(tiny, arch):
    model = tiny.hf(arch)
    ids = model.tokenizer(PROMPT).input_ids
    expected = model.hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)
    result = tiny.backend(arch).generate(PROMPT, max_tokens=32, temperature=0)
    assert result.token_ids == expected[0, len(ids) :].tolist()


@pytest.mark.parametrize("arch", GGUF_TWINS)
def test_gguf_f32_twin_has_the_same_logits(tiny, arch):
    ids = tiny.hf(arch).tokenizer(PROMPT).input_ids
    twin = load_backend(str(tiny.gguf(arch, Q.F32)), settings=CPU)
    torch.testing.assert_close(
        model_logits(twin, ids), model_logits(tiny.backend(arch), ids), atol=1e-4, rtol=1e-4
    )


@pytest.mark.parametrize("arch", GGUF_TWINS)
def test_gguf_q8_0_twin_is_within_quantization_error(tiny, arch):
    ids = tiny.hf(arch).tokenizer(PROMPT).input_ids
    twin = load_backend(str(tiny.gguf(arch, Q.Q8_0)), settings=CPU)
    reference = model_logits(tiny.backend(arch), ids)
    error = (model_logits(twin, ids) - reference).norm() / reference.norm()
    assert error < Q8_0_RELATIVE_L2


@pytest.mark.parametrize("arch", [a for a in GGUF_TWINS if a != "gemma3"])
def test_gguf_tokenizer_matches_the_original(tiny, arch):
    """Built from the GGUF's own vocabulary (the tiny Gemma's byte-level vocabulary is not
    the sentencepiece kind a Gemma GGUF carries, so it is left out)."""
    twin = load_backend(str(tiny.gguf(arch, Q.F32)), settings=CPU)
    original = tiny.backend(arch).tokenizer
    for text in (PROMPT, "def add(a, b):\n    return a + b", "  spaces  and\ttabs "):
        assert twin.tokenizer.encode(text) == original.encode(text)
        assert twin.tokenizer.decode(original.encode(text)) == text


def test_gguf_chat_template_survives_the_tokenizer_cache(tiny, tmp_path):
    """The converted tokenizer is cached; the cached copy keeps the file's chat template."""
    source = tiny.gguf("llama", Q.F32)
    reader = GGUFReader(source)
    path = tmp_path / "templated.gguf"
    writer = GGUFWriter(path, "llama")
    for field in reader.fields.values():
        if not field.name.startswith("GGUF.") and field.name != "general.architecture":
            writer.add_key_value(field.name, field.contents(), field.types[0], field.types[-1])
    writer.add_chat_template("{% for m in messages %}<{{ m['content'] }}>{% endfor %}")
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for _ in range(2):  # the conversion, then the cached copy
        backend = load_backend(str(path), settings=CPU)
        ids = backend.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
        assert backend.tokenizer.decode(ids) == "<hi>"


# (Phi-2's, StarCoder2's and GPT-NeoX's checkpoints carry no chat template)
@pytest.mark.parametrize("arch", sorted(CONVERTED & CHAT_TURNS.keys()))
def test_a_converted_gguf_keeps_the_checkpoints_chat_template(tiny, arch):
    """llama.cpp's converter copies the checkpoint's template (`tiny_models.CHAT_TURNS`)
    into the file; the GGUF twin renders a chat as transformers renders it from the
    checkpoint."""
    reference = tiny.hf(arch)
    twin = load_backend(str(tiny.gguf(arch, Q.F32)), settings=CPU)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    expected = reference.tokenizer.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=False
    )
    assert twin.tokenizer.render_chat(chat, True) == expected
    assert expected.endswith(CHAT_TURNS[arch][1])
    assert "Hi there" in expected


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_chunked_prefill_gives_the_same_tokens(tiny, arch):
    """Splitting a prompt into prefill chunks (across the sliding window) changes nothing."""
    backend = tiny.backend(arch)
    whole = backend.generate(PROMPT, max_tokens=12, temperature=0)
    scheduler = engine_internals(backend).scheduler  # no setting changes the step budget
    scheduler.max_num_batched_tokens = 7
    try:
        chunked = backend.generate(PROMPT, max_tokens=12, temperature=0)
    finally:
        scheduler.max_num_batched_tokens = 2048
    assert chunked.token_ids == whole.token_ids
    assert backend.stats().cache_holders == 0


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_every_family_has_a_tiny_model(family):
    """Every registry entry brings its tiny test model: what the tests run it through."""
    assert family.tiny, f"{family.name} has no tiny model (Family.tiny)"
    config = hf_config(family.name, 320)
    assert config.model_type in family.model_types
    groups = (
        ARCHITECTURES,
        MOE_ARCHITECTURES,
        HYBRID_ARCHITECTURES,
        KV_GROUP_ARCHITECTURES,
        MLA_ARCHITECTURES,
    )
    assert any(family.name in group for group in groups)  # some test module runs it
