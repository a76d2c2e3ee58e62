"""DeepSeek-V2 and V3 (multi-head latent attention, DeepSeek's routing) beyond
tests/test_models.py's comparisons with transformers: the absorbed attention against the
expanded one, variants of both versions against transformers, the routing rules alone,
the latent pool (its size, batches of several lengths, prefix hits, the contiguous
stores), what refuses them, and their GGUF twins as llama.cpp's own converter writes
them."""

import shutil
from pathlib import Path

import pytest
import torch
from helpers import CPU, PROMPT, SHARED_PREFIX_PROMPTS, engine_internals, model_logits
from llama_cpp_converter import convert_one
from safetensors.torch import load_file, save_file
from tiny_models import MLA_ARCHITECTURES, build_hf_model

from spnl_backend import BackendSettings, load_backend
from spnl_backend.distributed.sharding import check_shardable
from spnl_backend.engine.embed import SelfAttention
from spnl_backend.engine.kv_cache import ContiguousStep, SequenceKV, StepSlice
from spnl_backend.errors import SettingsError, UnsupportedArchitectureError
from spnl_backend.memory import kv_bytes_per_token
from spnl_backend.models.components import MoeConfig
from spnl_backend.models.moe import grouped_route
from spnl_backend.quant.linear import QuantEmbedding, QuantLinear

PAGED_F32 = BackendSettings(device="cpu", paged_attn=True, paged_cache_type="f32")
CONTIGUOUS = BackendSettings(device="cpu", paged_attn=False, paged_cache_type="f32")
LONG_PROMPT = " ".join([PROMPT] * 3)  # several blocks


@pytest.fixture(scope="module", params=MLA_ARCHITECTURES)
def arch(request):
    return request.param


def _transformers_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model.hf(torch.tensor([ids])).logits[0]


# ---- the attention ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_absorbed_attention_equals_the_expanded_form(tiny, arch, dtype):
    """Scores against the latents (q through each head's key projection) and outputs
    through the value projections after the sum: the same numbers as keys and values
    expanded per head first, as the checkpoint's kv_b_proj makes them."""
    backend = tiny.backend(arch)
    layer = backend.model.model.layers[1].self_attn.to(dtype)
    try:
        torch.manual_seed(1)
        tokens = 23
        x = torch.randn(tokens, backend.model_config.hidden_size, dtype=dtype)
        rotary = backend.model.model.rotary(torch.arange(tokens), dtype)
        with torch.inference_mode():
            absorbed = layer(x, rotary, SelfAttention([tokens]))
            expanded = layer.expanded(x, rotary)
    finally:
        layer.float()
    tolerance = 1e-5 if dtype is torch.float32 else 1e-12
    assert absorbed.abs().max() > 0.1
    torch.testing.assert_close(absorbed, expanded, atol=tolerance, rtol=tolerance)


# ---- variants against transformers -----------------------------------------------------

VARIANTS = {
    # DeepSeek-V2 (not Lite): queries through a bottleneck, routing limited to the groups
    # whose best expert scores highest, a routed scale.
    "v2-group-limited": (
        "deepseek_v2",
        {
            "q_lora_rank": 48,
            "topk_method": "group_limited_greedy",
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 16.0,
        },
    ),
    # V3 whose checkpoint keeps its rotated dims in halves already.
    "v3-rope-halves": ("deepseek_v3", {"rope_interleave": False}),
    # mscale unlike mscale_all_dim: the rotation itself scaled, beside the softmax's scale.
    "v3-attention-factor": (
        "deepseek_v3",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
                "mscale": 1.0,
                "mscale_all_dim": 0.5,
            }
        },
    ),
    # V3 without groups, its weights as they come.
    "v3-one-group": ("deepseek_v3", {"n_group": 1, "topk_group": 1, "norm_topk_prob": False}),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_variants_match_transformers(tmp_path, variant):
    arch, overrides = VARIANTS[variant]
    model = build_hf_model(arch, tmp_path / "hf", seed=4, overrides=overrides)
    ids = model.tokenizer(PROMPT).input_ids
    backend = load_backend(str(model.path), settings=CPU)
    torch.testing.assert_close(
        model_logits(backend, ids), _transformers_logits(model, ids), atol=1e-4, rtol=1e-4
    )
    expected = model.hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
    result = backend.generate(PROMPT, max_tokens=16, temperature=0)
    assert result.token_ids == expected[0, len(ids) :].tolist()


# ---- routing ---------------------------------------------------------------------------


def _router(arch: str, **config):
    from transformers import AutoConfig
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as v2
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3

    hf = AutoConfig.for_model(arch, hidden_size=16, num_attention_heads=4, **config)
    router = (v3.DeepseekV3TopkRouter if arch == "deepseek_v3" else v2.DeepseekV2TopkRouter)(hf)
    torch.manual_seed(5)
    with torch.no_grad():
        router.weight.normal_()
        if arch == "deepseek_v3":
            router.e_score_correction_bias.normal_(0.0, 0.3)
    return router


ROUTINGS = {
    "v2-greedy": (
        "deepseek_v2",
        dict(n_routed_experts=16, num_experts_per_tok=4, topk_method="greedy"),
        MoeConfig(16, 4, 8, renormalize=False, routed_scale=1.0),
    ),
    "v2-group-limited": (
        "deepseek_v2",
        dict(
            n_routed_experts=16,
            num_experts_per_tok=3,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=16.0,
        ),
        MoeConfig(16, 3, 8, renormalize=False, routed_scale=16.0, n_group=4, topk_group=2),
    ),
    "v3": (
        "deepseek_v3",
        dict(
            n_routed_experts=16,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
        ),
        MoeConfig(
            16,
            4,
            8,
            renormalize=True,
            routed_scale=2.5,
            scoring="sigmoid",
            score_bias=True,
            n_group=4,
            topk_group=2,
            group_rule="top2",
        ),
    ),
}


@pytest.mark.parametrize("routing", ROUTINGS)
def test_routing_matches_transformers_router(routing):
    arch, config, moe = ROUTINGS[routing]
    router = _router(arch, **config)
    x = torch.randn(200, 16)
    with torch.no_grad():
        logits, weights, experts = router(x)
    bias = getattr(router, "e_score_correction_bias", None)
    ours, our_weights = grouped_route(logits.float(), moe, bias)
    expected_experts, expected_weights = _by_expert(experts, weights)
    found_experts, found_weights = _by_expert(ours, our_weights)
    assert torch.equal(found_experts, expected_experts)
    torch.testing.assert_close(found_weights, expected_weights)


def _by_expert(experts: torch.Tensor, weights: torch.Tensor):
    """Each token's experts in id order, and their weights in that order."""
    order = experts.argsort(-1)
    return experts.gather(1, order), weights.float().gather(1, order)


def test_v3_bias_moves_the_choice_but_not_the_weights():
    """The score bias decides which experts; their weights are the unbiased scores."""
    moe = MoeConfig(8, 2, 8, renormalize=False, scoring="sigmoid", score_bias=True)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 5.0])
    experts, weights = grouped_route(logits, moe, bias)
    assert sorted(experts[0].tolist()) == [0, 7]
    chosen = dict(zip(experts[0].tolist(), weights[0].tolist(), strict=True))
    assert chosen[7] == pytest.approx(torch.sigmoid(torch.tensor(-5.0)).item())


# ---- the latent pool -------------------------------------------------------------------


def test_the_pool_holds_one_latent_plane_per_layer(tiny, arch):
    with load_backend(str(tiny.hf(arch).path), settings=PAGED_F32) as backend:
        config = backend.model_config
        mla = config.mla
        pool = engine_internals(backend).cache.cache
        (part,) = pool.parts
        info = backend.cache_info()
        assert info.latent_kv
        assert not info.uniform_kv
    assert part.shape[:2] == (config.num_layers, 1)
    assert part.shape[4:] == (1, mla.kv_lora_rank + mla.qk_rope_head_dim)
    width = config.num_layers * (mla.kv_lora_rank + mla.qk_rope_head_dim)
    assert info.bytes_per_token == kv_bytes_per_token(config, torch.float32) == width * 4
    assert part.numel() * part.element_size() == info.bytes_per_token * info.capacity_tokens


@pytest.mark.parametrize("settings", [PAGED_F32, CONTIGUOUS], ids=["paged", "contiguous"])
def test_a_batch_of_several_lengths_gives_each_its_tokens_alone(tiny, arch, settings):
    with load_backend(str(tiny.hf(arch).path), settings=settings) as backend:
        together = backend.generate(SHARED_PREFIX_PROMPTS, max_tokens=10, temperature=0)
        alone = [
            backend.generate(prompt, max_tokens=10, temperature=0)
            for prompt in SHARED_PREFIX_PROMPTS
        ]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    model = tiny.hf(arch)
    ids = model.tokenizer(PROMPT).input_ids
    expected = model.hf.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False)
    assert together[0].token_ids == expected[0, len(ids) :].tolist()


def test_a_prefix_hit_gives_the_same_tokens(tiny, arch):
    with load_backend(str(tiny.hf(arch).path), settings=PAGED_F32) as backend:
        first = backend.generate(LONG_PROMPT, max_tokens=12, temperature=0)
        again = backend.generate(LONG_PROMPT + " And again", max_tokens=12, temperature=0)
        hit = backend.generate(LONG_PROMPT, max_tokens=12, temperature=0)
        block = backend.cache_info().block_size
    assert again.usage.cached_tokens >= block
    assert hit.usage.cached_tokens >= block
    assert first.usage.cached_tokens == 0
    assert hit.token_ids == first.token_ids


@pytest.mark.slow
def test_speculative_ngram_drafts_roll_back_exactly(tiny, arch):
    settings = BackendSettings(device="cpu", speculative_method="ngram", speculative_gamma=4)
    with load_backend(str(tiny.hf(arch).path), settings=settings) as backend:
        drafted = backend.generate(PROMPT, max_tokens=24, temperature=0)
    plain = tiny.backend(arch).generate(PROMPT, max_tokens=24, temperature=0)
    assert drafted.token_ids == plain.token_ids


def test_the_native_layer_blocks_leave_it_to_the_per_op_path(tiny, arch, block_runs):
    settings = BackendSettings(device="cpu", isq="Q8_0", paged_cache_type="f32")
    with load_backend(str(tiny.hf(arch).path), settings=settings) as backend:
        result = backend.generate(PROMPT, max_tokens=4, temperature=0)
    assert block_runs[0] == 0
    assert len(result.token_ids) == 4


def test_embeddings_are_the_last_hidden_state_through_the_latent_layers(tiny, arch):
    """A cache-free pass (`engine.embed`) attends over the latents it makes itself."""
    backend = tiny.backend(arch)
    texts = [PROMPT, "The capital of France is"]
    vectors = backend.embed(texts).vectors
    for text, vector in zip(texts, vectors, strict=True):
        ids = backend.tokenizer.encode(text)
        config = backend.model_config
        planes = config.kv_planes
        kv = SequenceKV(config.kv_shapes, torch.float32, torch.device("cpu"), planes=planes)
        kv.reserve(len(ids), used=0)
        with torch.inference_mode():
            step = ContiguousStep([StepSlice(kv, 0, len(ids))])
            hidden = backend.model(torch.tensor(ids), torch.arange(len(ids)), step)[-1]
        expected = torch.nn.functional.normalize(hidden.float(), dim=-1)
        torch.testing.assert_close(vector, expected, atol=1e-5, rtol=1e-5)


def test_v3s_multi_token_prediction_layer_is_left_unread(tiny, tmp_path):
    """DeepSeek-V3's checkpoints keep it as one more ``model.layers.N``
    (``num_nextn_predict_layers``); the decoder is the same model without it."""
    source = tiny.hf("deepseek_v3").path
    shutil.copytree(source, tmp_path / "hf")
    weights = load_file(source / "model.safetensors")
    layers = tiny.hf("deepseek_v3").hf.config.num_hidden_layers
    assert tiny.hf("deepseek_v3").hf.config.num_nextn_predict_layers == 1
    last = f"model.layers.{layers - 1}."
    extra = {
        f"model.layers.{layers}." + name.removeprefix(last): tensor.clone()
        for name, tensor in weights.items()
        if name.startswith(last)
    }
    save_file({**weights, **extra}, tmp_path / "hf" / "model.safetensors")
    with_mtp = load_backend(str(tmp_path / "hf"), settings=CPU)
    ids = with_mtp.tokenizer.encode(PROMPT)
    assert with_mtp.model_config.num_layers == layers
    torch.testing.assert_close(
        model_logits(with_mtp, ids), model_logits(tiny.backend("deepseek_v3"), ids)
    )


# ---- what refuses it -------------------------------------------------------------------


@pytest.mark.parametrize(
    "setting",
    [{"kv_cache_compression": "int8"}, {"paged_cache_type": "f8e4m3"}],
    ids=lambda s: next(iter(s.values())),
)
def test_what_takes_k_and_v_per_head_is_refused(tiny, arch, setting):
    with pytest.raises(SettingsError, match="one latent per token"):
        load_backend(str(tiny.hf(arch).path), settings=BackendSettings(device="cpu", **setting))


def test_pic_and_tensor_parallelism_are_refused(tiny, arch):
    backend = tiny.backend(arch)
    assert "latent" in engine_internals(backend).pic_refusal()
    with pytest.raises(SettingsError, match="latent attention"):
        check_shardable(backend.model_config, 2)


@pytest.mark.parametrize(
    "arch_and_keys",
    [
        ("deepseek_v2", {"norm_topk_prob": True}),
        ("deepseek_v3", {"attention_bias": True}),
        ("deepseek_v3", {"scoring_func": "softmax"}),
    ],
    ids=lambda a: next(iter(a[1])),
)
def test_what_it_does_not_implement_is_refused(tmp_path, arch_and_keys):
    arch, keys = arch_and_keys
    model = build_hf_model(arch, tmp_path / "hf", overrides=keys)
    with pytest.raises(UnsupportedArchitectureError, match=next(iter(keys))):
        load_backend(str(model.path), settings=CPU)


# ---- GGUF, as llama.cpp's converter writes it ------------------------------------------


def _converted(tiny, arch: str, outtype: str) -> Path:
    path = tiny.hf(arch).path.parent / f"converted-{outtype}.gguf"
    return convert_one(tiny.hf(arch).path, path, outtype)


@pytest.mark.slow
def test_converted_gguf_has_the_same_logits_and_tokenizer(tiny, arch):
    twin = load_backend(str(_converted(tiny, arch, "f32")), settings=CPU)
    original = tiny.backend(arch)
    ids = original.tokenizer.encode(PROMPT)
    assert twin.tokenizer.encode(PROMPT) == ids
    torch.testing.assert_close(
        model_logits(twin, ids), model_logits(original, ids), atol=1e-4, rtol=1e-4
    )
    assert twin.generate(PROMPT, max_tokens=16, temperature=0).token_ids == (
        original.generate(PROMPT, max_tokens=16, temperature=0).token_ids
    )


@pytest.mark.slow
def test_converted_q8_0_gguf_holds_the_weights_within_quantization_error(tiny, arch):
    """Every matrix (the q rows regrouped as quantized blocks, the per-head k_b and v_b)
    as the original's, to 8-bit precision. (The logits are not compared: a few tokens'
    experts change under 8-bit weights, most under V3's biased sigmoid routing.)"""
    twin = _matrices(load_backend(str(_converted(tiny, arch, "q8_0")), settings=CPU))
    original = _matrices(tiny.backend(arch))
    assert twin.keys() == original.keys()
    for name, reference in original.items():
        error = (twin[name] - reference).norm() / reference.norm()
        assert error < 0.01, name


def _matrices(backend) -> dict[str, torch.Tensor]:
    """The model's weights of two dims or more, in float32, quantized ones dequantized."""
    found = {}
    for name, module in backend.model.named_modules():
        if isinstance(module, QuantLinear | QuantEmbedding):
            found[f"{name}.weight"] = module.weight_q.dequantize().float()
            continue
        for key, tensor in module.named_parameters(recurse=False):
            if tensor.dim() > 1:
                found[f"{name}.{key}"] = tensor.detach().float()
    return found
