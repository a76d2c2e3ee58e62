"""Hybrid models (state layers beside attention: Qwen3.5's Gated DeltaNet, Granite
4.0-H's Mamba-2, Falcon-H1's Mamba-2 in parallel with attention in every layer, Jamba's
Mamba-1) against transformers, on the paged and the contiguous cache, batched, in chunks
and preempted; the delta rule's, the SSD scan's and the selective scan's two forms
against each other and their definitions; what such a model refuses, and why."""

import json

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType
from helpers import (
    PROMPT,
    SHARED_PREFIX_PROMPTS,
    dequantize_in_place,
    engine_internals,
    engine_logits,
    greedy_with_logits,
)
from model_file_mutations import parse_gguf, with_value, without_key, write_gguf_bytes
from safetensors.torch import save_file
from tiny_models import (
    HYBRID_ARCHITECTURES,
    MOE_HYBRID_ARCHITECTURES,
    build_hf_model,
    write_gguf,
)
from transformers import AutoTokenizer

from spnl_backend import (
    BackendSettings,
    ModelFileError,
    RequestError,
    SettingsError,
    load_backend,
)
from spnl_backend.distributed.sharding import check_shardable
from spnl_backend.kernels import delta_rule, selective_scan, ssd
from spnl_backend.models.arch import family
from spnl_backend.models.native_blocks import LayerBlocks

TOKENS = 24
# Q8_0's relative L2 error in these 4-layer random models' logits (measured: Qwen3.5 4.6%,
# Granite 8.3%, whose embedding, residual and logit multipliers amplify it; Qwen3.5 MoE
# 26%, transformers' own with the same weights dequantized 24%: the embeddings' error
# moves 13 of its 348 token-layer expert picks); a misread tensor gives ~100%.
HYBRID_Q8_0_RELATIVE_L2 = {"qwen3_5_moe": 0.35}
DEFAULT_Q8_0_RELATIVE_L2 = 0.12
# The hybrids llama.cpp reads, whose tiny models are written as its converter writes them.
GGUF_HYBRIDS = tuple(a for a in HYBRID_ARCHITECTURES if family(a).gguf_archs)


def _load(tiny, arch, **settings):
    return load_backend(str(tiny.hf(arch).path), settings=BackendSettings(device="cpu", **settings))


def _prompt_ids(tiny, arch, prompt: str) -> list[int]:
    """The prompt as transformers tokenizes it for the saved model: for Qwen3.5 MoE its
    own tokenizer class (chosen by the model type), which splits digits apart, not the
    tiny tokenizer the model was saved with."""
    return AutoTokenizer.from_pretrained(tiny.hf(arch).path)(prompt).input_ids


def _expected(tiny, arch, prompt: str, tokens: int = TOKENS) -> list[int]:
    ids = _prompt_ids(tiny, arch, prompt)
    out = tiny.hf(arch).hf.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False)
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def expected(tiny):
    return {
        arch: [_expected(tiny, arch, p) for p in SHARED_PREFIX_PROMPTS]
        for arch in HYBRID_ARCHITECTURES
    }


@pytest.mark.parametrize("arch", HYBRID_ARCHITECTURES)
@pytest.mark.parametrize("paged", [True, False])
def test_logits_match_transformers(tiny, arch, paged):
    model = tiny.hf(arch)
    ids = model.tokenizer(PROMPT).input_ids
    with torch.no_grad():
        reference = model.hf(torch.tensor([ids])).logits[0]
    # (a float32 pool: the paged pool's default on the CPU is float16)
    with _load(tiny, arch, paged_attn=paged, paged_cache_type="f32") as backend:
        ours = engine_logits(backend, ids)
    assert reference.std() > 0.5
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("variant", "decodes_alike"),
    [
        ({"num_local_experts": 0}, True),  # the shared MLP is the layer's MLP (4.0-H Micro)
        ({"position_embedding_type": "rope"}, True),  # attention layers that rotate
        # Each dt clamped. transformers clamps in its chunked scan but not in its one-token
        # update (nor does mamba_ssm's step); here both forms clamp, so only the prefill's
        # logits are compared.
        ({"time_step_limit": [0.0, 0.5]}, False),
    ],
)
def test_granite_variants_match_transformers(tmp_path, variant, decodes_alike):
    model = build_hf_model("granitemoehybrid", tmp_path, overrides=variant)
    ids = model.tokenizer(PROMPT).input_ids
    with torch.no_grad():
        reference = model.hf(torch.tensor([ids])).logits[0]
    settings = BackendSettings(device="cpu", paged_cache_type="f32")
    with load_backend(str(tmp_path), settings=settings) as backend:
        ours = engine_logits(backend, ids)
        tokens = backend.generate(PROMPT, max_tokens=8, temperature=0).token_ids
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)
    if decodes_alike:  # decode runs the recurrent form
        out = model.hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
        assert tokens == out[0, len(ids) :].tolist()


@pytest.mark.parametrize(
    "variant",
    [
        {"mamba_rms_norm": True, "mamba_norm_before_gate": True},  # normed, then gated
        {"mamba_rms_norm": True, "mamba_norm_before_gate": False},  # gated, then normed
        # Biases beside the multipliers: an input's multiplier scales the weight alone, an
        # output's (the keys', the projections' own) the bias too.
        {"attention_bias": True, "mamba_proj_bias": True, "projectors_bias": True},
        # The head is the embedding: its multiplier and the logits' apply as they compute.
        {"tie_word_embeddings": True},
    ],
)
def test_falcon_h1_variants_match_transformers(tmp_path, variant):
    model = build_hf_model("falcon_h1", tmp_path, overrides=variant)
    ids = model.tokenizer(PROMPT).input_ids
    with torch.no_grad():
        reference = model.hf(torch.tensor([ids])).logits[0]
    out = model.hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    settings = BackendSettings(device="cpu", paged_cache_type="f32")
    with load_backend(str(tmp_path), settings=settings) as backend:
        ours = engine_logits(backend, ids)
        tokens = backend.generate(PROMPT, max_tokens=8, temperature=0).token_ids
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)
    assert tokens == out[0, len(ids) :].tolist()


def test_every_falcon_h1_layer_keeps_kv_and_a_state(tiny):
    """Attention and a Mamba-2 side by side: each layer has a place in the KV pool and
    one in the state group, and the model's memory counts both."""
    config = tiny.backend("falcon_h1").model_config
    assert [(s.kv_store, s.state_mixer.state) for s in config.layers] == [(0, 0), (1, 1), (2, 2)]
    assert config.num_kv_layers == config.num_state_layers == config.num_layers


def test_the_native_layer_blocks_decline_falcon_h1s_layers(tiny):
    """Each layer has attention the blocks could run, but a Mamba-2 beside it they
    cannot: they decline the layers (nor does the state group's step give them keys)."""
    settings = BackendSettings(device="cpu", isq="Q8_0", paged_cache_type="f32")
    with load_backend(str(tiny.hf("falcon_h1").path), settings=settings) as backend:
        backbone = backend.model.model
        native = backbone.kernels.native
        assert native is not None
        layers = list(backbone.layers)
        assert LayerBlocks.build(native, layers, backbone.norm, frozenset()) is None


def test_falcon_h1_refuses_lora_adapters(tiny, tmp_path):
    """Its multipliers are folded into the projections an adapter would sit beside."""
    settings = BackendSettings(device="cpu", lora_adapters=f"one={tmp_path}")
    with pytest.raises(SettingsError, match="multipliers are folded"):
        load_backend(str(tiny.hf("falcon_h1").path), settings=settings)


@pytest.mark.parametrize("arch", GGUF_HYBRIDS)
def test_the_gguf_twin_has_transformers_logits(tiny, arch):
    """The float GGUF (llama.cpp's names, keys and stored forms) against transformers."""
    model = tiny.hf(arch)
    ids = model.tokenizer(PROMPT).input_ids
    with torch.no_grad():
        reference = model.hf(torch.tensor([ids])).logits[0]
    settings = BackendSettings(device="cpu", paged_cache_type="f32")
    with load_backend(str(tiny.gguf(arch, Q.F32)), settings=settings) as backend:
        ours = engine_logits(backend, ids)
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", GGUF_HYBRIDS)
def test_the_gguf_twin_decodes_transformers_tokens(tiny, expected, arch):
    """Batched prefill and decode from the GGUF: each prompt's greedy tokens (the prompts
    given as transformers' ids: the GGUF's vocabulary, read by the generic tokenizer, does
    not split digits as Qwen3.5 MoE's own tokenizer class does)."""
    settings = BackendSettings(device="cpu")
    ids = [_prompt_ids(tiny, arch, p) for p in SHARED_PREFIX_PROMPTS]
    with load_backend(str(tiny.gguf(arch, Q.F32)), settings=settings) as backend:
        results = backend.generate(prompt_token_ids=ids, max_tokens=TOKENS, temperature=0)
    assert [r.token_ids for r in results] == expected[arch]


@pytest.mark.parametrize("arch", HYBRID_ARCHITECTURES)
@pytest.mark.parametrize("paged", [True, False])
def test_a_batch_gives_each_prompt_transformers_tokens(tiny, expected, arch, paged):
    """Prompts of several lengths decoded together: each sequence's state is its own."""
    with _load(tiny, arch, paged_attn=paged) as backend:
        results = backend.generate(SHARED_PREFIX_PROMPTS, max_tokens=TOKENS, temperature=0)
        assert backend.stats().cache_holders == 0
    assert [r.token_ids for r in results] == expected[arch]


@pytest.mark.parametrize("arch", HYBRID_ARCHITECTURES)
def test_chunked_prefill_carries_the_state(tiny, expected, arch):
    with _load(tiny, arch) as backend:
        engine_internals(backend).scheduler.max_num_batched_tokens = 7
        result = backend.generate(SHARED_PREFIX_PROMPTS[0], max_tokens=TOKENS, temperature=0)
    assert result.token_ids == expected[arch][0]


@pytest.mark.parametrize("arch", HYBRID_ARCHITECTURES)
def test_preempted_sequences_rebuild_their_state(tiny, expected, arch):
    """A pool too small for every sequence at once: the newest are preempted, their
    state dropped with their blocks, and recomputed from their first token."""
    with _load(tiny, arch, paged_attn_context_len=128, paged_attn_block_size=16) as backend:
        results = backend.generate(SHARED_PREFIX_PROMPTS, max_tokens=TOKENS, temperature=0)
        assert backend.stats().preemptions > 0
        assert backend.stats().cache_holders == 0
    assert [r.token_ids for r in results] == expected[arch]


def _torch_form(*args, **kwargs):
    raise AssertionError("a torch form of the recurrence ran beside the C kernel")


@pytest.mark.parametrize("arch", HYBRID_ARCHITECTURES)
def test_a_float32_model_runs_every_piece_on_the_c_kernel(tiny, expected, arch, monkeypatch):
    """On the CPU in float32 the state layers take prefill and decode alike through the
    compiled recurrence (never the chunked form for some pieces: the bits of a prefix hit
    would then depend on where the pieces fall), and give transformers' tokens."""
    for module in (delta_rule, ssd, selective_scan):
        for form in ("recurrent", "chunked"):
            monkeypatch.setattr(module, form, _torch_form)
    with _load(tiny, arch) as backend:
        engine_internals(backend).scheduler.max_num_batched_tokens = 7
        result = backend.generate(SHARED_PREFIX_PROMPTS[0], max_tokens=TOKENS, temperature=0)
    assert result.token_ids == expected[arch][0]


@pytest.mark.parametrize("arch", HYBRID_ARCHITECTURES)
def test_the_torch_forms_give_transformers_tokens(tiny, expected, arch):
    """Without the C kernels (as on a GPU) the scans run in torch, chunked over a prompt's
    pieces and one token at a time in decoding, and give transformers' logits and
    tokens."""
    ids = tiny.hf(arch).tokenizer(PROMPT).input_ids
    with torch.no_grad():
        reference = tiny.hf(arch).hf(torch.tensor([ids])).logits[0]
    with _load(tiny, arch, cpu_kernels="torch", paged_cache_type="f32") as backend:
        torch.testing.assert_close(engine_logits(backend, ids), reference, atol=1e-4, rtol=1e-4)
        result = backend.generate(SHARED_PREFIX_PROMPTS[0], max_tokens=TOKENS, temperature=0)
    assert result.token_ids == expected[arch][0]


LONGER = PROMPT + " The lazy dog sleeps."


@pytest.mark.parametrize("arch", HYBRID_ARCHITECTURES)
@pytest.mark.parametrize(("block_size", "step_tokens"), [(8, 2048), (16, 2048), (8, 21)])
def test_a_prefix_hit_starts_from_a_snapshot_with_the_cold_bits(
    tiny, arch, block_size, step_tokens
):
    """A prompt that extends an earlier one starts from the state the earlier one left at
    a block boundary: the same logits, to the bit, as computing it cold (also when steps
    take the prompts in chunks: they end at block boundaries). A model with experts runs
    them quantized (ISQ), on the native layer that computes each row alone: float experts
    are torch GEMMs over the rows that chose them, rounded by how many did."""
    settings = dict(paged_attn_block_size=block_size, paged_cache_type="f32")
    if arch in MOE_HYBRID_ARCHITECTURES:
        settings["isq"] = "Q8_0"
    with (
        _load(tiny, arch, **settings) as warm,
        _load(tiny, arch, prefix_cache_n=0, **settings) as cold,
    ):
        for backend in (warm, cold):
            engine_internals(backend).scheduler.max_num_batched_tokens = step_tokens
        warm.generate(PROMPT, max_tokens=TOKENS, temperature=0)  # leaves its snapshots
        hit = greedy_with_logits(warm, TOKENS, prompt=LONGER)
        plain = greedy_with_logits(cold, TOKENS, prompt=LONGER)
        assert warm.stats().cache_holders == 0
    tokens, logits, usage = hit
    assert usage.cached_tokens > 0
    assert usage.cached_tokens % block_size == 0
    assert plain[2].cached_tokens == 0
    assert tokens == plain[0]
    assert torch.equal(logits, plain[1])


@pytest.mark.parametrize("arch", HYBRID_ARCHITECTURES)
def test_the_prompt_again_hits_its_own_snapshot(tiny, expected, arch):
    """A finished sequence's blocks and snapshot serve the same prompt again; the hit is
    its last full block before the prompt's last token."""
    with _load(tiny, arch, paged_attn_block_size=8) as backend:
        first = backend.generate(SHARED_PREFIX_PROMPTS[0], max_tokens=TOKENS, temperature=0)
        second = backend.generate(SHARED_PREFIX_PROMPTS[0], max_tokens=TOKENS, temperature=0)
    assert first.usage.cached_tokens == 0
    assert second.usage.cached_tokens > 0
    assert first.token_ids == second.token_ids == expected[arch][0]


@pytest.mark.parametrize("arch", HYBRID_ARCHITECTURES)
def test_snapshots_are_bounded_by_the_prefix_cache_setting(tiny, arch):
    with _load(tiny, arch, paged_attn_block_size=8, prefix_cache_n=2) as backend:
        backend.generate(SHARED_PREFIX_PROMPTS, max_tokens=TOKENS, temperature=0)
        kept = backend._loop.call(lambda engine: len(engine.cache.states.snapshots))
    assert kept == 2


@pytest.mark.parametrize("arch", HYBRID_ARCHITECTURES)
def test_no_prefix_hit_on_the_contiguous_cache(tiny, arch):
    with _load(tiny, arch, paged_attn=False) as backend:
        first = backend.generate(PROMPT, max_tokens=TOKENS, temperature=0)
        second = backend.generate(PROMPT, max_tokens=TOKENS, temperature=0)
    assert second.usage.cached_tokens == 0
    assert second.token_ids == first.token_ids


def test_the_chunked_rule_gives_the_recurrent_values():
    torch.manual_seed(0)
    tokens, heads, dk, dv = 150, 3, 8, 6  # chunks of 64: two whole and one padded
    q = torch.nn.functional.normalize(torch.randn(tokens, heads, dk), dim=-1) * dk**-0.5
    k = torch.nn.functional.normalize(torch.randn(tokens, heads, dk), dim=-1)
    v = torch.randn(tokens, heads, dv)
    g = -torch.rand(tokens, heads)
    beta = torch.rand(tokens, heads)
    start = torch.randn(heads, dk, dv)
    state_a, state_b = start.clone(), start.clone()
    out_a = delta_rule.recurrent(q, k, v, g, beta, state_a)
    out_b = delta_rule.chunked(q, k, v, g, beta, state_b)
    torch.testing.assert_close(out_b, out_a, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state_b, state_a, atol=1e-4, rtol=1e-4)


def test_the_recurrent_rule_is_the_delta_rule():
    """One token by the definition: decay, write the value's unpredicted part, read."""
    torch.manual_seed(1)
    heads, dk, dv = 2, 4, 3
    q, k, v = torch.randn(1, heads, dk), torch.randn(1, heads, dk), torch.randn(1, heads, dv)
    g, beta = -torch.rand(1, heads), torch.rand(1, heads)
    state = torch.randn(heads, dk, dv)
    expected_state = state * g[0].exp()[:, None, None]
    for h in range(heads):
        predicted = expected_state[h].T @ k[0, h]
        expected_state[h] += torch.outer(k[0, h], beta[0, h] * (v[0, h] - predicted))
    expected_out = torch.einsum("hkv,hk->hv", expected_state, q[0])
    out = delta_rule.recurrent(q, k, v, g, beta, state)
    torch.testing.assert_close(state, expected_state)
    torch.testing.assert_close(out[0], expected_out)


def _ssd_inputs(tokens: int, heads: int = 3, dim: int = 5, state: int = 4):
    torch.manual_seed(2)
    x = torch.randn(tokens, heads, dim)
    dt = torch.nn.functional.softplus(torch.randn(tokens, heads))
    a = -torch.rand(heads) - 0.1
    b, c = torch.randn(tokens, heads, state), torch.randn(tokens, heads, state)
    return x, dt, a, b, c, torch.randn(heads, dim, state)


@pytest.mark.parametrize("chunk", [16, 64])
def test_the_chunked_scan_gives_the_recurrent_values(chunk):
    """From a state that is not zero, over whole chunks and a padded last one."""
    x, dt, a, b, c, start = _ssd_inputs(150)
    state_a, state_b = start.clone(), start.clone()
    out_a = ssd.recurrent(x, dt, a, b, c, state_a)
    out_b = ssd.chunked(x, dt, a, b, c, state_b, chunk)
    torch.testing.assert_close(out_b, out_a, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state_b, state_a, atol=1e-4, rtol=1e-4)


def test_the_recurrent_scan_is_the_state_space():
    """One token by the definition: decay by exp(dt A), write dt x B^T, read h C."""
    x, dt, a, b, c, state = _ssd_inputs(1)
    heads = x.shape[1]
    expected_state = state.clone()
    for h in range(heads):
        expected_state[h] *= torch.exp(dt[0, h] * a[h])
        expected_state[h] += dt[0, h] * torch.outer(x[0, h], b[0, h])
    expected_out = torch.einsum("hpn,hn->hp", expected_state, c[0])
    out = ssd.recurrent(x, dt, a, b, c, state)
    torch.testing.assert_close(state, expected_state)
    torch.testing.assert_close(out[0], expected_out)


def _selective_inputs(tokens: int, channels: int = 6, state: int = 4):
    torch.manual_seed(3)
    x = torch.randn(tokens, channels)
    dt = torch.nn.functional.softplus(torch.randn(tokens, channels))
    a = -torch.rand(channels, state) - 0.1
    b, c = torch.randn(tokens, state), torch.randn(tokens, state)
    return x, dt, a, b, c, torch.randn(channels, state)


@pytest.mark.parametrize("chunk", [4, 16])
def test_the_chunked_selective_scan_gives_the_recurrent_values(chunk):
    """From a state that is not zero, over whole chunks and a shorter last one."""
    x, dt, a, b, c, start = _selective_inputs(37)
    state_a, state_b = start.clone(), start.clone()
    out_a = selective_scan.recurrent(x, dt, a, b, c, state_a)
    out_b = selective_scan.chunked(x, dt, a, b, c, state_b, chunk)
    torch.testing.assert_close(out_b, out_a, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state_b, state_a, atol=1e-4, rtol=1e-4)


def test_the_recurrent_selective_scan_is_the_state_space():
    """One token by the definition: each channel's state decays by exp(dt A) at its own
    rates, takes dt B x, and is read by C."""
    x, dt, a, b, c, state = _selective_inputs(1)
    expected_state = state.clone()
    for d in range(x.shape[1]):
        expected_state[d] = expected_state[d] * torch.exp(dt[0, d] * a[d])
        expected_state[d] += dt[0, d] * b[0] * x[0, d]
    out = selective_scan.recurrent(x, dt, a, b, c, state)
    torch.testing.assert_close(state, expected_state)
    torch.testing.assert_close(out[0], expected_state @ c[0])


@pytest.mark.parametrize("arch", HYBRID_ARCHITECTURES)
def test_pic_is_refused_with_the_reason(tiny, arch):
    with (
        _load(tiny, arch) as backend,
        pytest.raises(RequestError, match="state layers"),
    ):
        backend.generate(blocks=[("plus", "Doc one."), ("cross", "Question?")], max_tokens=4)


@pytest.fixture(scope="module")
def other_drafts(tiny, tmp_path_factory):
    """Each hybrid family's tiny model with other weights: a draft often rejected."""
    root = tmp_path_factory.mktemp("drafts")
    return {
        arch: str(build_hf_model(arch, root / arch, seed=1).path) for arch in HYBRID_ARCHITECTURES
    }


@pytest.mark.parametrize("arch", HYBRID_ARCHITECTURES)
@pytest.mark.parametrize("draft", ["itself", "other"])
@pytest.mark.parametrize("paged", [True, False])
def test_speculative_decoding_goes_back_to_the_accepted_tokens_state(
    tiny, expected, other_drafts, arch, draft, paged
):
    """A draft of the same family: the target's and the draft's states go back to where
    the accepted tokens end after each step, so the greedy tokens are transformers'."""
    path = str(tiny.hf(arch).path)
    draft_path = path if draft == "itself" else other_drafts[arch]
    settings = dict(paged_attn=paged, speculative_draft_model=draft_path, speculative_gamma=3)
    with _load(tiny, arch, **settings) as backend:
        results = backend.generate(SHARED_PREFIX_PROMPTS, max_tokens=TOKENS, temperature=0)
        assert backend.stats().cache_holders == 0
    assert [r.token_ids for r in results] == expected[arch]
    drafted = sum(r.usage.draft_tokens for r in results)
    accepted = sum(r.usage.accepted_tokens for r in results)
    assert drafted > 0
    if draft == "itself":
        assert accepted == drafted
    else:
        assert accepted < drafted  # rejections: the states went back


@pytest.mark.parametrize("arch", HYBRID_ARCHITECTURES)
def test_ngram_speculation_goes_back_to_the_accepted_tokens_state(tiny, expected, arch):
    """N-gram proposals, rejected or not, leave the states where the kept tokens end."""
    settings = dict(speculative_method="ngram", speculative_ngram_min=1, speculative_gamma=3)
    with _load(tiny, arch, **settings) as backend:
        results = backend.generate(SHARED_PREFIX_PROMPTS, max_tokens=TOKENS, temperature=0)
    assert [r.token_ids for r in results] == expected[arch]
    assert sum(r.usage.draft_tokens for r in results) > 0


@pytest.mark.parametrize("arch", HYBRID_ARCHITECTURES)
def test_tensor_parallelism_is_refused_with_the_reason(tiny, arch):
    config = tiny.backend(arch).model_config
    with pytest.raises(SettingsError, match="state layers"):
        check_shardable(config, 2)


@pytest.mark.parametrize("arch", HYBRID_ARCHITECTURES)
def test_the_gguf_twin_has_the_same_logits_and_tokens(tiny, arch):
    """Written with llama.cpp's names and layout (value heads tiled, norms as 1 + w, A as
    -exp(A_log), the convolution squeezed), by the tests' writer: llama.cpp's converter
    refuses the tiny model's tokenizer."""
    model = tiny.hf(arch)
    ids = model.tokenizer(PROMPT).input_ids
    settings = BackendSettings(device="cpu", paged_cache_type="f32")
    with (
        load_backend(str(model.path), settings=settings) as original,
        load_backend(str(tiny.gguf(arch, Q.F32)), settings=settings) as twin,
    ):
        torch.testing.assert_close(
            engine_logits(twin, ids), engine_logits(original, ids), atol=1e-4, rtol=1e-4
        )
        assert twin.generate(PROMPT, max_tokens=TOKENS, temperature=0).token_ids == (
            original.generate(PROMPT, max_tokens=TOKENS, temperature=0).token_ids
        )


@pytest.mark.parametrize("arch", HYBRID_ARCHITECTURES)
def test_the_q8_0_gguf_twin_is_within_quantization_error(tiny, arch):
    model = tiny.hf(arch)
    ids = model.tokenizer(PROMPT).input_ids
    settings = BackendSettings(device="cpu", paged_cache_type="f32")
    with (
        load_backend(str(model.path), settings=settings) as original,
        load_backend(str(tiny.gguf(arch, Q.Q8_0)), settings=settings) as twin,
    ):
        reference = engine_logits(original, ids)
        error = (engine_logits(twin, ids) - reference).norm() / reference.norm()
    assert error < HYBRID_Q8_0_RELATIVE_L2.get(arch, DEFAULT_Q8_0_RELATIVE_L2)


@pytest.mark.parametrize("arch", MOE_HYBRID_ARCHITECTURES)
def test_the_q8_0_gguf_twin_computes_what_its_blocks_hold(tiny, arch):
    """With float activations in the products, the Q8_0 twin computes exactly what the
    same file computes with every quantized projection dequantized into a float one: its
    experts, and any shared expert and the shared expert's gate (which llama.cpp's
    quantizer quantizes, unlike the router), run on their blocks as they should."""
    ids = tiny.hf(arch).tokenizer(PROMPT).input_ids
    settings = BackendSettings(device="cpu", paged_cache_type="f32", cpu_matmul="float32")
    path = str(tiny.gguf(arch, Q.Q8_0))
    with (
        load_backend(path, settings=settings) as quantized,
        load_backend(path, settings=settings) as dequantized,
    ):
        dequantize_in_place(dequantized)
        torch.testing.assert_close(
            engine_logits(quantized, ids), engine_logits(dequantized, ids), atol=1e-4, rtol=0
        )


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_a_gguf_with_multi_token_prediction_blocks_runs_its_decoder(tiny, tmp_path, arch):
    """llama.cpp's converter keeps Qwen3.5's multi-token prediction layer as a block after
    the decoder's (``nextn_predict_layers``, its own ``nextn.*`` tensors): left unread,
    the model is the decoder alone, with the plain file's logits."""
    model = tiny.hf(arch)
    path = write_gguf(model, tmp_path / "mtp.gguf", mtp_layers=1)
    ids = model.tokenizer(PROMPT).input_ids
    settings = BackendSettings(device="cpu", paged_cache_type="f32")
    with (
        load_backend(str(path), settings=settings) as with_mtp,
        load_backend(str(tiny.gguf(arch, Q.F32)), settings=settings) as plain,
    ):
        assert with_mtp.model_config == plain.model_config
        assert torch.equal(engine_logits(with_mtp, ids), engine_logits(plain, ids))
    source = parse_gguf(path.read_bytes())
    key = f"{family(arch).gguf_archs[0]}.nextn_predict_layers"
    wrong = tmp_path / "wrong.gguf"
    wrong.write_bytes(write_gguf_bytes(with_value(source, key, GGUFValueType.UINT32, 5)))
    with pytest.raises(ModelFileError, match=r"nextn_predict_layers' is 5 .*from 0 to 4"):
        load_backend(str(wrong), settings=BackendSettings(device="cpu"))


def test_the_shared_experts_size_falls_back_as_llama_cpp_reads_it(tiny, tmp_path):
    """A ``qwen35moe`` file without ``expert_shared_feed_forward_length`` takes the dense
    size (``feed_forward_length``) for it, as llama.cpp does; with neither (its files give
    no dense size) it is refused naming the key."""
    source = parse_gguf(tiny.gguf("qwen3_5_moe", Q.F32).read_bytes())
    unsized = without_key(source, "qwen35moe.expert_shared_feed_forward_length")
    path = tmp_path / "unsized.gguf"
    path.write_bytes(write_gguf_bytes(unsized))
    with pytest.raises(ModelFileError, match=r"'qwen35moe\.feed_forward_length' is missing"):
        load_backend(str(path), settings=BackendSettings(device="cpu"))
    dense = with_value(unsized, "qwen35moe.feed_forward_length", GGUFValueType.UINT32, 48)
    path = tmp_path / "dense.gguf"
    path.write_bytes(write_gguf_bytes(dense))
    with load_backend(str(path), settings=BackendSettings(device="cpu")) as backend:
        moe = backend.model_config.moe
        assert moe.shared_intermediate_size == 48
        assert moe.shared_gate
        assert all(moe.sparse)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_a_multimodal_checkpoint_loads_its_language_model(tiny, tmp_path, arch):
    """Qwen3.5's checkpoints as published: the text config nested in a multimodal one,
    the language model's weights under ``model.language_model.`` (experts stacked, as
    transformers holds them), a vision model and multi-token prediction layers beside
    them (left unread)."""
    model = tiny.hf(arch)
    text = model.hf.config.to_dict()
    wrapper = family(arch).wrapper_types[0]
    config = {"model_type": wrapper, "text_config": text, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    renamed = {
        name.replace("model.", "model.language_model.", 1): tensor.contiguous()
        for name, tensor in model.hf.state_dict().items()
    }
    renamed["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 4)
    renamed["mtp.layers.0.input_layernorm.weight"] = torch.zeros(4)
    save_file(renamed, tmp_path / "model.safetensors")
    model.tokenizer.save_pretrained(tmp_path)
    settings = BackendSettings(device="cpu", paged_cache_type="f32")
    with (
        load_backend(str(tmp_path), settings=settings) as wrapped,
        load_backend(str(model.path), settings=settings) as plain,
    ):
        assert wrapped.model_config == plain.model_config
        ids = model.tokenizer(PROMPT).input_ids
        assert torch.equal(engine_logits(wrapped, ids), engine_logits(plain, ids))


def test_a_jamba_checkpoint_with_experts_one_by_one_loads_the_same_model(tiny, tmp_path):
    """Jamba's first checkpoints store each expert's projections apart, and a dense
    layer's MLP as a single expert: the same model as transformers' stacked experts."""
    model = tiny.hf("jamba")
    tensors = {}
    for name, tensor in model.hf.state_dict().items():
        stem = name.rpartition(".")[0]
        if name.endswith("experts.gate_up_proj"):
            for expert, weight in enumerate(tensor):
                gate, up = weight.chunk(2)
                tensors[f"{stem}.{expert}.gate_proj.weight"] = gate.contiguous()
                tensors[f"{stem}.{expert}.up_proj.weight"] = up.contiguous()
        elif name.endswith("experts.down_proj"):
            for expert, weight in enumerate(tensor):
                tensors[f"{stem}.{expert}.down_proj.weight"] = weight.contiguous()
        elif ".feed_forward." in name and "experts" not in name and "router" not in name:
            tensors[name.replace(".feed_forward.", ".feed_forward.experts.0.")] = tensor
        else:
            tensors[name] = tensor.contiguous()
    save_file(tensors, tmp_path / "model.safetensors")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((model.path / name).read_bytes())
    settings = BackendSettings(device="cpu", paged_cache_type="f32")
    ids = model.tokenizer(PROMPT).input_ids
    with (
        load_backend(str(tmp_path), settings=settings) as apart,
        load_backend(str(model.path), settings=settings) as stacked,
    ):
        assert torch.equal(engine_logits(apart, ids), engine_logits(stacked, ids))


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("ssm_multipliers", [1.0, 2.0], r"'ssm_multipliers' is \[1.0, 2.0\]; expected 5 numbers"),
        ("key_multiplier", float("nan"), "'key_multiplier' is nan; expected finite numbers"),
    ],
)
def test_a_falcon_h1_config_out_of_range_names_its_key(tiny, tmp_path, key, value, message):
    source = tiny.hf("falcon_h1").path
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((source / name).read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config[key] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFileError, match=message):
        load_backend(str(tmp_path), settings=BackendSettings(device="cpu"))


def test_a_config_out_of_range_names_its_key(tiny, tmp_path):
    """A DeltaNet size the layer cannot run (value heads not a multiple of the key heads)
    is refused naming the config.json key it came from."""
    source = tiny.hf("qwen3_5").path
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((source / name).read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config["linear_num_value_heads"] = 3
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFileError, match="'linear_num_value_heads' is 3; expected a multiple"):
        load_backend(str(tmp_path), settings=BackendSettings(device="cpu"))


def test_a_quantized_hybrid_embeds_texts(tiny):
    """Embeddings of a model with state layers whose embedding table is quantized (ISQ here,
    as a GGUF's would be): each text from a fresh state, in the model's dtype."""
    settings = BackendSettings(device="cpu", isq="Q8_0", paged_cache_type="f32")
    with load_backend(str(tiny.hf("falcon_h1").path), settings=settings) as backend:
        assert hasattr(backend.model.model.embed_tokens, "weight_q")
        vectors = backend.embed(["a first text", "and a second"]).vectors
    assert vectors.shape == (2, backend.model_config.hidden_size)
    torch.testing.assert_close(vectors.norm(dim=-1), torch.ones(2))
