"""Mixture-of-experts models (Qwen3-MoE, Mixtral, OLMoE) from safetensors: each against
transformers on the same tiny random model, its routing rule included; and their GGUF
twins, as llama.cpp's converter writes them, against the safetensors models."""

import shutil
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType, GGUFValueType
from helpers import CPU, dequantize_in_place, model_logits
from model_file_mutations import parse_gguf, with_value, without_key, write_gguf_bytes
from tiny_models import MOE_ARCHITECTURES, build_hf_model, hf_config

from spnl_backend import BackendSettings, UnsupportedArchitectureError, load_backend
from spnl_backend.models.mlp import GatedMLP
from spnl_backend.models.moe import SparseMoE
from spnl_backend.quant.linear import QuantLinear

PROMPT = "the cat sat on the mat and the dog"
# experts the native layer refuses: Llama 4's, whose inputs are weighed, GLM-4 MoE's,
# routed by DeepSeek-V3's rules, and ERNIE 4.5 MoE's, whose choice adds a bias to the
# softmax (gpt-oss's biases and clamped SwiGLU are the native layer's too)
TORCH_EXPERTS = ("llama4", "glm4_moe", "ernie4_5_moe")
# The tiny models whose GGUF twin is the same model: a llama4 file keeps neither the chunk
# nor the temperature (llama.cpp hard-codes both; tests/test_llama4.py converts its own).
GGUF_TWINS = tuple(a for a in MOE_ARCHITECTURES if a != "llama4")
TOKENS = 32


@pytest.fixture(scope="module")
def moe(tiny):
    return {arch: (tiny.hf(arch), tiny.backend(arch)) for arch in MOE_ARCHITECTURES}


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_logits_and_greedy_tokens_equal_transformers(moe, arch):
    reference, backend = moe[arch]
    ids = reference.tokenizer(PROMPT).input_ids
    with torch.no_grad():
        expected = reference.hf(torch.tensor([ids])).logits[0]
        greedy = reference.hf.generate(
            torch.tensor([ids]), max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=False
        )[0, len(ids) :]
    assert torch.allclose(model_logits(backend, ids), expected, atol=1e-4)
    result = backend.generate(prompt_token_ids=ids, max_tokens=TOKENS, temperature=0)
    assert result.token_ids == greedy.tolist()[: len(result.token_ids)]
    assert len(result.token_ids) == TOKENS or result.finish_reason == "stop"


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_the_router_chooses_as_transformers_does(moe, arch):
    reference, backend = moe[arch]
    ours = next(m for m in backend.model.modules() if isinstance(m, SparseMoE))
    x = torch.randn(64, reference.hf.config.hidden_size, generator=torch.Generator().manual_seed(1))
    experts, weights = ours.route(x)
    if arch == "llama4":  # its first MoE layer's router: each expert's score (0 unchosen)
        layer = next(lay for lay in reference.hf.model.layers if lay.is_moe_layer)
        with torch.no_grad():
            scores, _ = layer.feed_forward.router(x)
        their_weights, their_experts = scores.topk(ours.top_k)
    else:
        # the first MoE layer's router (GLM-4 MoE's first layer is dense)
        mlp = next(lay.mlp for lay in reference.hf.model.layers if _has_experts(lay))
        theirs = mlp.router if arch == "gpt_oss" else mlp.gate
        with torch.no_grad():
            _, their_weights, their_experts = theirs(x)
    assert torch.equal(experts, their_experts)
    assert torch.allclose(weights.float(), their_weights.float(), atol=1e-6)


def test_qwen3_moe_keeps_its_dense_layers(moe):
    layers = moe["qwen3_moe"][1].model.model.layers
    assert [type(layer.mlp) for layer in layers] == [SparseMoE, GatedMLP, SparseMoE]


def test_qwen2_moe_dense_layers_and_renormalised_weights_are_transformers(tmp_path):
    """Qwen2-MoE's variants beside its tiny model's: a dense layer by ``mlp_only_layers``
    and another off the ``decoder_sparse_step``, the top-k weights renormalised."""
    variant = {"mlp_only_layers": [0], "decoder_sparse_step": 2, "norm_topk_prob": True}
    reference = build_hf_model("qwen2_moe", tmp_path, overrides=variant)
    backend = load_backend(str(tmp_path), settings=CPU)
    layers = backend.model.model.layers
    assert [type(layer.mlp) for layer in layers] == [GatedMLP, SparseMoE, GatedMLP]
    assert layers[1].shared_mlp_gate is not None
    assert layers[1].mlp.renormalize
    ids = reference.tokenizer(PROMPT).input_ids
    with torch.no_grad():
        expected = reference.hf(torch.tensor([ids])).logits[0]
    assert torch.allclose(model_logits(backend, ids), expected, atol=1e-4)


def test_glm4_moe_group_limited_routing_and_its_refusals_are_transformers(tmp_path):
    """GLM-4 MoE beside its tiny model: experts in 4 groups of which 2 are kept, two dense
    layers, no q/k norm nor biases, the weights left as they come; and a scoring function
    other than sigmoid refused by name."""
    variant = {
        "n_group": 4,
        "topk_group": 2,
        "first_k_dense_replace": 2,
        "use_qk_norm": False,
        "attention_bias": False,
        "norm_topk_prob": False,
    }
    reference = build_hf_model("glm4_moe", tmp_path / "groups", overrides=variant)
    backend = load_backend(str(reference.path), settings=CPU)
    layers = backend.model.model.layers
    assert [type(layer.mlp) for layer in layers] == [GatedMLP, GatedMLP, SparseMoE]
    assert (layers[2].mlp.moe.n_group, layers[2].mlp.moe.topk_group) == (4, 2)
    ids = reference.tokenizer(PROMPT).input_ids
    with torch.no_grad():
        expected = reference.hf(torch.tensor([ids])).logits[0]
    assert torch.allclose(model_logits(backend, ids), expected, atol=1e-4)
    softmax = build_hf_model(
        "glm4_moe", tmp_path / "softmax", overrides={"scoring_func": "softmax"}
    )
    with pytest.raises(UnsupportedArchitectureError, match="scoring_func"):
        load_backend(str(softmax.path), settings=CPU)


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_batched_paged_or_not_and_fused_files_give_the_same_tokens(moe, arch, tmp_path):
    reference, backend = moe[arch]
    prompts = [PROMPT, "once upon a time", "x = 1"]
    alone = [backend.generate(p, max_tokens=12, temperature=0).token_ids for p in prompts]
    batched = backend.generate(prompts, max_tokens=12, temperature=0)
    assert [r.token_ids for r in batched] == alone
    plain = load_backend(
        str(reference.path), settings=BackendSettings(device="cpu", paged_attn=False)
    )
    assert [plain.generate(p, max_tokens=12, temperature=0).token_ids for p in prompts] == alone
    fused = tmp_path / "fused"  # transformers' own layout: experts stacked [E, 2I, H]
    reference.hf.save_pretrained(fused, save_original_format=False)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(reference.path / name, fused / name)
    from_fused = load_backend(str(fused), settings=CPU)
    ids = reference.tokenizer(PROMPT).input_ids
    assert torch.equal(model_logits(from_fused, ids), model_logits(backend, ids))


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_isq_quantizes_every_expert_and_computes_with_its_blocks(moe, arch):
    """Float activations in the products, so the quantized model must compute exactly
    what the same model with each block dequantized into a float projection computes."""
    reference, _ = moe[arch]
    settings = BackendSettings(device="cpu", isq="Q8_0", cpu_matmul="float32")
    quantized = load_backend(str(reference.path), settings=settings)
    moe_layer = next(m for m in quantized.model.modules() if isinstance(m, SparseMoE))
    assert all(isinstance(e.gate_proj, QuantLinear) for e in moe_layer.experts)
    assert not isinstance(moe_layer.gate, QuantLinear)  # the router stays in float
    ids = reference.tokenizer(PROMPT).input_ids
    expected = model_logits(quantized, ids)
    dequantized = load_backend(str(reference.path), settings=settings)
    dequantize_in_place(dequantized)
    assert torch.allclose(model_logits(dequantized, ids), expected, atol=1e-4)


def test_speculative_decoding_with_an_moe_target(moe, tiny):
    reference, backend = moe["mixtral"]
    expected = backend.generate(PROMPT, max_tokens=16, temperature=0).token_ids
    for draft in (
        {"speculative_draft_isq": "Q8_0"},
        {"speculative_draft_model": str(tiny.hf("llama").path)},
    ):
        spec = load_backend(
            str(reference.path),
            settings=BackendSettings(device="cpu", speculative_gamma=4, **draft),
        )
        result = spec.generate(PROMPT, max_tokens=16, temperature=0)
        assert result.token_ids == expected
        assert result.usage.draft_tokens > 0


def test_an_unsupported_moe_variant_names_the_supported_ones(tmp_path, tiny):
    import json

    source = tiny.hf("qwen3_moe").path
    other = tmp_path / "phimoe"
    shutil.copytree(source, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "phimoe"}))
    native = CPU.model_copy(update={"model_impl": "native"})  # auto: transformers' code
    with pytest.raises(UnsupportedArchitectureError, match="qwen3_moe, mixtral, olmoe"):
        load_backend(str(other), settings=native)


def test_a_compressed_cache_and_a_constraint_run_an_moe_model(moe):
    reference, _ = moe["olmoe"]
    settings = BackendSettings(device="cpu", kv_cache_compression="int8")
    compressed = load_backend(str(reference.path), settings=settings)
    result = compressed.generate(PROMPT, max_tokens=8, temperature=0, ignore_eos=True)
    assert len(result.token_ids) == 8
    chat = compressed.generate(PROMPT, max_tokens=8, temperature=0, choice=["yes", "no"])
    assert chat.text in ("yes", "no")


@pytest.mark.parametrize("arch", GGUF_TWINS)
def test_gguf_twins_with_stacked_experts(moe, tiny, arch):
    """llama.cpp's layout: ``ffn_gate_inp`` and the experts stacked per projection
    (``ffn_gate_exps`` ...). Float: the same logits as the safetensors model. Q8_0: each
    expert keeps its own blocks (close to its float weights) and the model computes
    exactly what those blocks dequantized compute."""
    reference, backend = moe[arch]
    ids = reference.tokenizer(PROMPT).input_ids
    float_twin = load_backend(str(tiny.gguf(arch, GGMLQuantizationType.F32)), settings=CPU)
    assert float_twin.model_config.architecture == arch
    assert torch.allclose(model_logits(float_twin, ids), model_logits(backend, ids), atol=1e-5)
    settings = BackendSettings(device="cpu", cpu_matmul="float32")
    quantized = load_backend(str(tiny.gguf(arch, GGMLQuantizationType.Q8_0)), settings=settings)
    first = next(i for i, lay in enumerate(reference.hf.model.layers) if _has_experts(lay))
    layer = quantized.model.model.layers[first].mlp
    their = reference.hf.model.layers[first].mlp.experts.gate_up_proj
    gates = _gate_weights(their.detach(), arch)
    for expert, mlp in enumerate(layer.experts):
        blocks = mlp.gate_proj.weight_q.dequantize().float()
        assert torch.allclose(blocks, gates[expert], atol=0.02)
    expected = model_logits(quantized, ids)
    dequantized = load_backend(str(tiny.gguf(arch, GGMLQuantizationType.Q8_0)), settings=settings)
    dequantize_in_place(dequantized)
    assert torch.allclose(model_logits(dequantized, ids), expected, atol=1e-4)


def _has_experts(layer: torch.nn.Module) -> bool:
    """A transformers decoder layer with experts (GLM-4 MoE's first is dense)."""
    return hasattr(layer.mlp, "experts")


def _gate_weights(gate_up: torch.Tensor, arch: str) -> torch.Tensor:
    """Each expert's gate rows ``[E, I, H]`` from transformers' stack: gate rows first,
    or (gpt-oss) transposed with gate and up interleaved by column."""
    if arch == "gpt_oss":
        return gate_up[..., ::2].transpose(1, 2)
    return gate_up[:, : gate_up.shape[1] // 2]


def test_an_olmoe_gguf_generates_and_tokenizes_as_its_safetensors_model(moe, tiny):
    """llama.cpp's OLMoE file: q and k normed over their whole projections and not
    permuted (NEOX rope), the top-k weights as they come, q, k, v clamped by
    ``clamp_kqv``; its vocabulary converted without transformers' model config, which
    does not know the architecture."""
    reference, backend = moe["olmoe"]
    twin = load_backend(str(tiny.gguf("olmoe", GGMLQuantizationType.F32)), settings=CPU)
    config = twin.model_config
    assert (config.qk_norm_full, config.clip_qkv, config.moe.renormalize) == (True, 4.0, False)
    expected = backend.generate(PROMPT, max_tokens=TOKENS, temperature=0, ignore_eos=True)
    result = twin.generate(PROMPT, max_tokens=TOKENS, temperature=0, ignore_eos=True)
    assert result.token_ids == expected.token_ids
    assert len(result.token_ids) == TOKENS
    for text in (PROMPT, "def add(a, b):\n    return a + b", "  spaces  and\ttabs ", "é 中文 😀"):
        ids = reference.tokenizer(text).input_ids
        assert twin.tokenizer.encode(text) == ids
        assert twin.tokenizer.decode(ids) == reference.tokenizer.decode(
            ids, skip_special_tokens=True
        )


def test_a_converted_qwen2_moe_gguf_generates_and_tokenizes_as_its_safetensors_model(moe, tiny):
    """llama.cpp's converter's Qwen2-MoE file: its shared expert and gate, q/k/v biases,
    the top-k weights as they come (llama.cpp's rule), the vocabulary by transformers."""
    reference, backend = moe["qwen2_moe"]
    twin = load_backend(str(tiny.gguf("qwen2_moe", GGMLQuantizationType.F32)), settings=CPU)
    config = twin.model_config
    assert (config.qkv_bias, config.moe.renormalize, config.moe.shared_gate) == (
        True,
        False,
        True,
    )
    expected = backend.generate(PROMPT, max_tokens=TOKENS, temperature=0, ignore_eos=True)
    assert twin.generate(PROMPT, max_tokens=TOKENS, temperature=0, ignore_eos=True).token_ids == (
        expected.token_ids
    )
    for text in (PROMPT, "def add(a, b):\n    return a + b", "é 中文 😀"):
        ids = reference.tokenizer(text).input_ids
        assert twin.tokenizer.encode(text) == ids


@pytest.mark.parametrize("clamp", [None, 1.0])
def test_an_olmoe_gguf_clamps_q_k_v_where_its_clamp_kqv_says(moe, tiny, tmp_path, clamp):
    """At 1.0 the clamp bites (the tiny model's q, k, v reach about 3.9, so its own 4.0
    never does): the same logits as transformers with that ``clip_qkv``. Without the key,
    as llama.cpp's converter writes OLMoE files, nothing is clamped."""
    reference, _ = moe["olmoe"]
    key = "olmoe.attention.clamp_kqv"
    source = parse_gguf(tiny.gguf("olmoe", GGMLQuantizationType.F32).read_bytes())
    if clamp is None:
        source = without_key(source, key)
    else:
        source = with_value(source, key, GGUFValueType.FLOAT32, clamp)
    path = tmp_path / "clamped.gguf"
    path.write_bytes(write_gguf_bytes(source))
    twin = load_backend(str(path), settings=CPU)
    assert twin.model_config.clip_qkv == clamp
    ids = reference.tokenizer(PROMPT).input_ids
    own, reference.hf.config.clip_qkv = reference.hf.config.clip_qkv, clamp
    try:
        with torch.no_grad():
            expected = reference.hf(torch.tensor([ids])).logits[0]
    finally:
        reference.hf.config.clip_qkv = own
    assert torch.allclose(model_logits(twin, ids), expected, atol=1e-4)


def test_an_unsupported_gguf_architecture_names_the_supported_ones(tiny, tmp_path):
    source = parse_gguf(tiny.gguf("olmoe", GGMLQuantizationType.F32).read_bytes())
    path = tmp_path / "dbrx.gguf"
    dbrx = with_value(source, "general.architecture", GGUFValueType.STRING, "dbrx")
    path.write_bytes(write_gguf_bytes(dbrx))
    with pytest.raises(
        UnsupportedArchitectureError,
        match=r"'dbrx' is not supported; supported: llama, .*, qwen3moe, olmoe",
    ):
        load_backend(str(path), settings=CPU)


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_quantized_experts_run_natively_row_by_row_as_their_twin(moe, arch):
    """On the CPU a layer of quantized experts is one native call: each row computed as it
    would be alone (one row, five, or more than one chunk of 256), close to the torch twin
    (`SparseMoE.grouped`), and a sequence's tokens the same alone and in a batch; gpt-oss's
    biases and clamped SwiGLU included."""
    reference, _ = moe[arch]
    quantized = load_backend(
        str(reference.path), settings=BackendSettings(device="cpu", isq="Q8_0")
    )
    layer = next(m for m in quantized.model.modules() if isinstance(m, SparseMoE))
    assert (layer.native_layer() is None) == (arch in TORCH_EXPERTS)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(300, reference.hf.config.hidden_size, generator=gen)
    with torch.inference_mode():
        together = layer(x)
        alone = torch.cat([layer(row[None]) for row in x[:5]])
        twin = layer.grouped(x, *layer.route(x))
    assert torch.equal(alone, together[:5])
    assert torch.equal(layer(x[:5]), together[:5])
    torch.testing.assert_close(together, twin, rtol=1e-4, atol=1e-5)
    prompts = [PROMPT, "once upon a time", "x = 1"]
    singly = [quantized.generate(p, max_tokens=10, temperature=0).token_ids for p in prompts]
    batched = quantized.generate(prompts, max_tokens=10, temperature=0)
    assert [r.token_ids for r in batched] == singly


@pytest.mark.parametrize(
    ("experts", "top_k", "native"), [(36, 33, True), (260, 2, False)], ids=["wide-top-k", "260"]
)
def test_expert_counts_at_the_edges(tmp_path, experts, top_k, native):
    """33 of 36 experts a token runs natively; more experts than the native layer takes
    (256) run on the torch path. Either way a sequence's tokens do not depend on its batch."""
    from tiny_models import _common, build_tokenizer
    from transformers import AutoModelForCausalLM, OlmoeConfig

    tokenizer = build_tokenizer()
    config = OlmoeConfig(**_common(len(tokenizer)), num_experts=experts, num_experts_per_tok=top_k)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    backend = load_backend(str(tmp_path), settings=BackendSettings(device="cpu", isq="Q8_0"))
    layer = next(m for m in backend.model.modules() if isinstance(m, SparseMoE))
    assert (layer.native_layer() is not None) == native
    alone = backend.generate(PROMPT, max_tokens=4, temperature=0, ignore_eos=True)
    batched = backend.generate([PROMPT, "x = 1"], max_tokens=4, temperature=0, ignore_eos=True)
    assert batched[0].token_ids == alone.token_ids
    assert len(alone.token_ids) == 4


_PEAK_CHILD = """
import json, sys, torch
from spnl_backend import BackendSettings, load_backend

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key)) * 1024

settings = BackendSettings(device="cpu", isq="Q4_K", paged_attn_context_len=256)
load_backend(sys.argv[2], settings=settings).close()  # kernels built, modules imported
torch.set_num_threads(1)
before = status("VmRSS:")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the high-water mark restarts from the current RSS
backend = load_backend(sys.argv[1], settings=settings)
print(json.dumps({"before": before, "peak": status("VmHWM:")}))
"""


@pytest.mark.slow
def test_isq_quantizes_the_experts_as_they_load(tmp_path, moe):
    """ISQ of a model whose float experts are 12 times one layer's: the load's peak stays
    near one layer's float experts plus the quantized model, far below the float model."""
    import json
    import subprocess
    import sys

    from tiny_models import _common, build_tokenizer
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("no resettable /proc high-water mark here")
    tokenizer = build_tokenizer()
    config = Qwen3MoeConfig(
        **{**_common(len(tokenizer)), "hidden_size": 256, "num_hidden_layers": 12},
        head_dim=64,
        num_experts=32,
        num_experts_per_tok=2,
        moe_intermediate_size=512,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    experts = 12 * 32 * 3 * 256 * 512 * 4  # float32 bytes of every expert: 604 MB
    warm_up = str(moe["qwen3_moe"][0].path)
    child = subprocess.run(
        [sys.executable, "-c", _PEAK_CHILD, str(tmp_path), warm_up],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    sizes = json.loads(child.stdout.strip().splitlines()[-1])
    grew = sizes["peak"] - sizes["before"]
    # a layer's float experts (50 MB) with its quantization buffers, and the quantized
    # model (85 MB): 117-204 MB measured with ten other processes on 2 cores. Before ISQ
    # handed each layer's freed buffers back, the allocator's leftovers made it 205-442 MB.
    # Every float expert held at once would be 604 MB; the bound sits between the two.
    assert grew < experts * 0.7, f"the load's peak grew {grew / 1e6:.0f} MB"


def test_malformed_moe_metadata_is_a_clear_error(tiny, tmp_path):
    """A renormalisation flag that is not a boolean, and a block with experts but no
    router, are ModelFileErrors naming what is wrong, never a silent guess."""
    from model_file_mutations import with_tensor_field

    from spnl_backend import ModelFileError

    source = parse_gguf(tiny.gguf("qwen3_moe", GGMLQuantizationType.F32).read_bytes())
    flag = with_value(source, "qwen3moe.expert_weights_norm", GGUFValueType.STRING, "false")
    path = tmp_path / "flag.gguf"
    path.write_bytes(write_gguf_bytes(flag))
    with pytest.raises(ModelFileError, match=r"expert_weights_norm.*a boolean"):
        load_backend(str(path), settings=CPU)
    router = next(i for i, t in enumerate(source.tensors) if t.name == "blk.0.ffn_gate_inp.weight")
    renamed = with_tensor_field(source, router, name="blk.0.ffn_gate_inq.weight")
    path = tmp_path / "router.gguf"
    path.write_bytes(write_gguf_bytes(renamed))
    with pytest.raises(ModelFileError, match=r"block 0 has experts .* no router"):
        load_backend(str(path), settings=CPU)


def test_gguf_experts_run_on_the_native_layer(tiny):
    """A GGUF keeps its router in float (as llama.cpp's quantizer does): its quantized
    experts run as one native call, in the layer blocks too."""
    backend = load_backend(str(tiny.gguf("olmoe", GGMLQuantizationType.Q8_0)), settings=CPU)
    layer = next(m for m in backend.model.modules() if isinstance(m, SparseMoE))
    assert layer.native_layer() is not None
    backend.generate(PROMPT, max_tokens=2, temperature=0)
    assert backend.model.model._blocks is not None


def test_the_clamped_swiglu_is_transformers_gate():
    """gpt-oss's gating on values past its limit on both sides: the same as transformers'
    experts apply to their interleaved gate/up columns."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from spnl_backend.models.mlp import ClampedSwiGLU

    config = hf_config("gpt_oss", 320)
    theirs = GptOssExperts(config)
    gate_up = torch.randn(50, 2 * config.intermediate_size) * 12
    assert (gate_up.abs() > config.swiglu_limit).float().mean() > 0.3  # the clamps bind
    ours = ClampedSwiGLU(config.swiglu_alpha, config.swiglu_limit)
    torch.testing.assert_close(ours(gate_up[:, ::2], gate_up[:, 1::2]), theirs._apply_gate(gate_up))


def test_a_gpt_oss_moe_layer_is_transformers_past_its_clamps(moe):
    """A whole layer of experts (biased router, biased projections, clamped SwiGLU) on
    inputs large enough that the clamps bind, against transformers' layer."""
    reference, backend = moe["gpt_oss"]
    ours = backend.model.model.layers[1].mlp
    theirs = reference.hf.model.layers[1].mlp
    x = torch.randn(40, reference.hf.config.hidden_size, generator=torch.Generator().manual_seed(2))
    x = x * 10
    with torch.no_grad():
        expected = theirs(x[None])[0][0]
        gate = theirs.experts.gate_up_proj[0, :, ::2]
        assert ((x @ gate).abs() > reference.hf.config.swiglu_limit).any()
        torch.testing.assert_close(ours(x), expected, rtol=1e-4, atol=1e-4)


def test_a_gpt_oss_gguf_with_mxfp4_experts_runs_them_as_stored(moe, tiny):
    """llama.cpp's gpt-oss files keep the experts in MXFP4: they load as their blocks, run
    on the native MoE layer, and (float activations in the products) the model computes
    what those blocks dequantized compute."""
    reference, _ = moe["gpt_oss"]
    path = tiny.gguf("gpt_oss", GGMLQuantizationType.MXFP4)
    settings = BackendSettings(device="cpu", cpu_matmul="float32")
    quantized = load_backend(str(path), settings=settings)
    layer = quantized.model.model.layers[0].mlp
    assert layer.experts[0].gate_proj.weight_q.qtype == GGMLQuantizationType.MXFP4
    assert layer.native_layer() is not None
    ids = reference.tokenizer(PROMPT).input_ids
    expected = model_logits(quantized, ids)
    dequantized = load_backend(str(path), settings=settings)
    dequantize_in_place(dequantized)
    torch.testing.assert_close(model_logits(dequantized, ids), expected, rtol=1e-4, atol=1e-4)


def test_mxfp4_experts_on_int8_products_are_their_twin_row_by_row(moe, tiny):
    """As shipped (int8 activations in the products), gpt-oss's MXFP4 experts run on the
    native layer: each row as it would be alone, close to the torch twin on the same
    products, and a sequence's tokens the same alone and in a batch."""
    reference, _ = moe["gpt_oss"]
    backend = load_backend(str(tiny.gguf("gpt_oss", GGMLQuantizationType.MXFP4)), settings=CPU)
    layer = backend.model.model.layers[0].mlp
    assert layer.native_layer() is not None
    x = torch.randn(40, reference.hf.config.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        together = layer(x)
        alone = torch.cat([layer(row[None]) for row in x[:5]])
        twin = layer.grouped(x, *layer.route(x))
    assert torch.equal(alone, together[:5])
    torch.testing.assert_close(together, twin, rtol=1e-4, atol=1e-5)
    prompts = [PROMPT, "x = 1"]
    singly = [backend.generate(p, max_tokens=6, temperature=0).token_ids for p in prompts]
    assert [r.token_ids for r in backend.generate(prompts, max_tokens=6, temperature=0)] == singly
