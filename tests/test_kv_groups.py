"""Models whose KV layers differ in shape or are read by later layers (Gemma 4: sliding
layers of one head size, global ones of another with fewer KV heads, the last layers
reading earlier layers' K and V, per-layer embeddings) against transformers: logits and
greedy tokens through the contiguous stores and the paged pool, batched and in chunks;
the pool's groups and their size; what refuses them; and their GGUF twins as llama.cpp's
converter writes them (tests/test_models.py compares the twins' logits)."""

import dataclasses
import shutil

import jinja2
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFValueType
from helpers import PROMPT, SHARED_PREFIX_PROMPTS, engine_internals, engine_logits, model_logits
from model_file_mutations import parse_gguf, with_value, without_key, write_gguf_bytes
from safetensors.torch import load_file, save_file
from tiny_models import KV_GROUP_ARCHITECTURES

from spnl_backend import BackendSettings, load_backend
from spnl_backend.distributed.sharding import check_shardable
from spnl_backend.errors import ModelFileError, SettingsError
from spnl_backend.memory import kv_bytes_per_token
from spnl_backend.models.arch import family

PAGED_F32 = BackendSettings(device="cpu", paged_attn=True, paged_cache_type="f32")
CONTIGUOUS = BackendSettings(device="cpu", paged_attn=False, paged_cache_type="f32")


@pytest.fixture(scope="module", params=KV_GROUP_ARCHITECTURES)
def arch(request):
    return request.param


def _load(tiny, arch, settings):
    return load_backend(str(tiny.hf(arch).path), settings=settings)


def _expected_logits(tiny, arch, ids):
    with torch.no_grad():
        return tiny.hf(arch).hf(torch.tensor([ids])).logits[0]


def _expected_tokens(tiny, arch, prompt, count):
    model = tiny.hf(arch)
    ids = model.tokenizer(prompt).input_ids
    out = model.hf.generate(torch.tensor([ids]), max_new_tokens=count, do_sample=False)
    return out[0, len(ids) :].tolist()


def test_the_tiny_model_has_every_kind_of_layer(tiny, arch):
    config = tiny.backend(arch).model_config
    shapes = set(config.kv_shapes)
    assert len({dim for _, dim in shapes}) == 2  # both head dims
    assert len({heads for heads, _ in shapes}) == 2  # and KV head counts
    assert {"sliding", "full"} <= set(config.layer_types)
    assert any(spec.mixer.spec.shared_kv for spec in config.layers)
    assert not config.uniform_kv


def test_logits_match_transformers(tiny, arch):
    ids = tiny.hf(arch).tokenizer(PROMPT).input_ids
    expected = _expected_logits(tiny, arch, ids)
    assert expected.std() > 0.5
    torch.testing.assert_close(
        model_logits(tiny.backend(arch), ids), expected, atol=1e-4, rtol=1e-4
    )


@pytest.mark.parametrize("settings", [PAGED_F32, CONTIGUOUS], ids=["paged-f32", "contiguous"])
def test_engine_logits_match_transformers(tiny, arch, settings):
    ids = tiny.hf(arch).tokenizer(PROMPT).input_ids
    with _load(tiny, arch, settings) as backend:
        ours = engine_logits(backend, ids)
    torch.testing.assert_close(ours, _expected_logits(tiny, arch, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("settings", [PAGED_F32, CONTIGUOUS], ids=["paged-f32", "contiguous"])
def test_32_greedy_tokens_match_transformers(tiny, arch, settings):
    with _load(tiny, arch, settings) as backend:
        result = backend.generate(PROMPT, max_tokens=32, temperature=0)
    assert result.token_ids == _expected_tokens(tiny, arch, PROMPT, 32)


@pytest.mark.parametrize("settings", [PAGED_F32, CONTIGUOUS], ids=["paged-f32", "contiguous"])
def test_a_batch_gives_each_prompt_its_own_tokens(tiny, arch, settings):
    """Prompts of several lengths sharing prefixes, run together (prefix hits included)."""
    with _load(tiny, arch, settings) as backend:
        results = backend.generate(SHARED_PREFIX_PROMPTS, max_tokens=16, temperature=0)
    for prompt, result in zip(SHARED_PREFIX_PROMPTS, results, strict=True):
        assert result.token_ids == _expected_tokens(tiny, arch, prompt, 16), prompt


@pytest.mark.parametrize("settings", [PAGED_F32, CONTIGUOUS], ids=["paged-f32", "contiguous"])
def test_chunked_prefill_gives_the_same_tokens(tiny, arch, settings):
    """Prompt chunks of 7 tokens, across the sliding window, the shared layers reading
    what the earlier chunks stored."""
    with _load(tiny, arch, settings) as backend:
        engine_internals(backend).scheduler.max_num_batched_tokens = 7
        result = backend.generate(PROMPT, max_tokens=32, temperature=0)
        assert backend.stats().cache_holders == 0
    assert result.token_ids == _expected_tokens(tiny, arch, PROMPT, 32)


def test_the_default_cpu_pool_gives_transformers_tokens(tiny, arch):
    """The CPU's float16 pool (the default) on the native kernels, every group."""
    result = tiny.backend(arch).generate(PROMPT, max_tokens=32, temperature=0)
    assert result.token_ids == _expected_tokens(tiny, arch, PROMPT, 32)


def test_the_pool_holds_a_tensor_per_shape_and_nothing_for_shared_layers(tiny, arch):
    backend = tiny.backend(arch)
    config = backend.model_config
    pool = engine_internals(backend).cache.cache
    stored = [spec for spec in config.layers if spec.kv_store is not None]
    assert len(pool.layers) == config.num_kv_layers == len(stored) < config.num_layers
    windowed = pool.windowed or [False] * len(pool.layers)  # the sliding layers' own pool
    assert len(pool.parts) == len(set(zip(config.kv_shapes, windowed, strict=True)))
    for place, (keys, values) in enumerate(pool.layers):
        heads, dim = config.kv_shapes[place]
        assert keys.shape[2:] == values.shape[2:] == (heads, dim)
    held = sum(part.numel() * part.element_size() for part in pool.parts)
    info = backend.cache_info()
    window = info.window_bytes_per_token if info.window_blocks is not None else 0
    window_tokens = (info.window_blocks or 0) * info.block_size
    full = (info.bytes_per_token - window) * info.capacity_tokens
    assert held == full + window * window_tokens
    per_layer = sum(2 * heads * dim for heads, dim in config.kv_shapes)
    assert info.bytes_per_token == kv_bytes_per_token(config, torch.float16) == per_layer * 2


def test_an_fp8_pool_calibrates_every_group(tiny, arch):
    settings = BackendSettings(device="cpu", paged_attn=True, paged_cache_type="f8e4m3")
    with _load(tiny, arch, settings) as backend:
        pool = engine_internals(backend).cache.cache
        assert len(pool.k_scale) == backend.model_config.num_kv_layers
        result = backend.generate(PROMPT, max_tokens=8, temperature=0)
    assert len(result.token_ids) == 8


def test_the_native_layer_blocks_leave_it_to_the_per_op_path(tiny, arch, block_runs):
    settings = BackendSettings(device="cpu", isq="Q8_0", paged_cache_type="f32")
    with _load(tiny, arch, settings) as backend:
        backend.generate(PROMPT, max_tokens=4, temperature=0)
    assert block_runs[0] == 0


@pytest.mark.parametrize(
    "setting", [{"kv_cache_compression": "int8"}], ids=lambda s: next(iter(s.values()))
)
def test_what_sees_the_pool_as_one_shape_is_refused(tiny, arch, setting):
    with pytest.raises(SettingsError, match="differ in shape"):
        _load(tiny, arch, BackendSettings(device="cpu", **setting))


def test_pic_and_tensor_parallelism_are_refused(tiny, arch):
    backend = tiny.backend(arch)
    assert "differ in shape" in engine_internals(backend).pic_refusal()
    with pytest.raises(SettingsError, match="Gemma 4"):
        check_shardable(backend.model_config, 2)


def test_the_chat_template_is_gemma_4s(arch):
    """Where a file carries none: Gemma 4's turns, a system turn of its own."""
    template = jinja2.Template(family(arch).chat_template)
    messages = [
        {"role": "system", "content": "Be brief. "},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
    ]
    text = template.render(messages=messages, bos_token="<bos>", add_generation_prompt=True)
    assert text == (
        "<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\nHi<turn|>\n"
        "<|turn>model\nHello<turn|>\n<|turn>user\nBye<turn|>\n"
        "<|turn>model\n<|channel>thought\n<channel|>"
    )


def test_embeddings_read_the_shared_layers_kv(tiny, arch):
    """The cache-free pass of /v1/embeddings: each text's last hidden state, normalized,
    the shared layers reading their source layers' K and V of that pass."""
    model = tiny.hf(arch)
    texts = ["The quick brown fox", PROMPT]
    vectors = tiny.backend(arch).embed(texts).vectors
    for text, vector in zip(texts, vectors, strict=True):
        ids = torch.tensor([model.tokenizer(text).input_ids])
        with torch.no_grad():
            state = model.hf(ids, output_hidden_states=True).hidden_states[-1][0, -1]
        expected = torch.nn.functional.normalize(state, dim=0)
        torch.testing.assert_close(vector, expected, atol=2e-5, rtol=0)


def _gguf_twin(tiny, arch, settings=PAGED_F32):
    return load_backend(str(tiny.gguf(arch, GGMLQuantizationType.F32)), settings=settings)


def test_the_gguf_twin_is_the_safetensors_model(tiny, arch):
    """The same description from llama.cpp's keys (the global layers' head size and KV
    heads, both ropes, the shared layers, the doubled MLPs, PLE; the proportional rope
    from the converter's divisors, its still pairs at 0 Hz exactly), all but what GGUF
    stores otherwise (the epsilon as a float32)."""
    original = tiny.backend(arch).model_config
    with _gguf_twin(tiny, arch) as twin:
        config = twin.model_config
        assert config.layers == original.layers
        kept = dict(rms_norm_eps=original.rms_norm_eps, dtype=original.dtype)
        assert dataclasses.replace(config, **kept) == original
        assert config.rms_norm_eps == pytest.approx(original.rms_norm_eps)
        result = twin.generate(PROMPT, max_tokens=32, temperature=0)
    assert result.token_ids == _expected_tokens(tiny, arch, PROMPT, 32)


def _with_per_layer_kv_heads(parts, arch):
    counts = parts.entry(f"{arch}.attention.head_count_kv").value
    counts = [*counts[:3], counts[3] - 1, *counts[4:]]  # a sliding layer with fewer
    return with_value(
        parts, f"{arch}.attention.head_count_kv", GGUFValueType.ARRAY, counts, GGUFValueType.INT32
    )


_REFUSED = {
    "kv heads per layer": (
        _with_per_layer_kv_heads,
        r"head_count_kv' gives layer 3 1 K/V heads; .* has 2 there",
    ),
    "shared layers llama.cpp reads otherwise": (
        lambda parts, arch: with_value(
            parts, f"{arch}.attention.shared_kv_layers", GGUFValueType.UINT32, 1
        ),
        r"shared_kv_layers. is 1 \(int\); expected a count leaving a sliding then a global layer",
    ),
    "no sliding pattern": (
        lambda parts, arch: without_key(parts, f"{arch}.attention.sliding_window_pattern"),
        r"sliding_window_pattern' is missing",
    ),
}


@pytest.mark.parametrize("case", sorted(_REFUSED))
def test_a_gguf_describing_another_model_is_refused_by_key(tiny, arch, tmp_path, case):
    mutate, message = _REFUSED[case]
    parts = parse_gguf(tiny.gguf(arch, GGMLQuantizationType.F32).read_bytes())
    path = tmp_path / "mutated.gguf"
    path.write_bytes(write_gguf_bytes(mutate(parts, arch)))
    with pytest.raises(ModelFileError, match=message):
        load_backend(str(path), settings=PAGED_F32)


def test_checkpoints_shared_layers_k_and_v_weights_are_left_unused(tiny, arch, tmp_path):
    """Published checkpoints (and llama.cpp's GGUFs of them) keep k/v projections and
    norms for the shared layers, which read earlier layers' K and V: loaded, they change
    nothing (transformers skips them too)."""
    source = tiny.hf(arch).path
    copy = shutil.copytree(source, tmp_path / "with-shared-kv")
    weights = load_file(copy / "model.safetensors")
    config = tiny.backend(arch).model_config
    for layer in range(config.num_layers - config.num_kv_shared_layers, config.num_layers):
        rows, dim = config.layer_kv_heads(layer) * config.layer_head_dim(layer), config.hidden_size
        stem = f"model.layers.{layer}.self_attn."
        weights[stem + "k_proj.weight"] = torch.randn(rows, dim)
        weights[stem + "v_proj.weight"] = torch.randn(rows, dim)
        weights[stem + "k_norm.weight"] = torch.randn(config.layer_head_dim(layer))
    save_file(weights, copy / "model.safetensors", metadata={"format": "pt"})
    ids = tiny.hf(arch).tokenizer(PROMPT).input_ids
    with load_backend(str(copy), settings=PAGED_F32) as backend:
        ours = model_logits(backend, ids)
    torch.testing.assert_close(ours, model_logits(tiny.backend(arch), ids), atol=0, rtol=0)
