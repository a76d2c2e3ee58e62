"""ISQ: a text model's projections quantized as they load, and how close each type stays."""

import logging

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from helpers import CPU, model_logits

from spnl_backend import BackendSettings, load_backend
from spnl_backend.quant.isq import apply_isq
from spnl_backend.quant.linear import QuantEmbedding, QuantizedWeight, QuantLinear
from spnl_backend.settings.values import IsqType

PROMPTS = [
    "The capital of France is",
    "Once upon a time there was",
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):",
]
# Relative L2 distance of the logits from the unquantized model's, on the trained tiny
# model, about twice what was measured (in brackets) with the default int8 activations.
TOLERANCE = {
    IsqType.Q8_0: 0.02,  # (0.008)
    IsqType.Q8_1: 0.02,  # (0.008)
    IsqType.Q6K: 0.025,  # (0.010)
    IsqType.Q5K: 0.045,  # (0.019)
    IsqType.Q5_1: 0.045,  # (0.023)
    IsqType.Q5_0: 0.055,  # (0.027)
    IsqType.Q4K: 0.075,  # (0.033)
    IsqType.Q4_1: 0.10,  # (0.051)
    IsqType.Q4_0: 0.11,  # (0.054)
    IsqType.Q3K: 0.18,  # (0.090)
    IsqType.Q2K: 0.36,  # (0.177)
}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def trained(tiny):
    return tiny.trained()


@pytest.fixture(scope="module")
def unquantized(trained):
    return load_backend(str(trained.path), settings=CPU)


def _isq(trained, isq: str, **settings):
    return load_backend(
        str(trained.path), settings=BackendSettings(device="cpu", isq=isq, **settings)
    )


def _ids(backend) -> list[int]:
    return backend.tokenizer.encode(" ".join(PROMPTS))


@pytest.mark.parametrize("isq", list(TOLERANCE), ids=lambda t: t.value)
def test_logits_stay_within_the_documented_tolerance(trained, unquantized, isq):
    expected = model_logits(unquantized, _ids(unquantized))
    logits = model_logits(_isq(trained, isq.value), _ids(unquantized))
    distance = ((logits - expected).norm() / expected.norm()).item()
    assert distance <= TOLERANCE[isq], f"{isq.value}: {distance:.4f}"
    assert distance > 0, "quantization must change something"


def test_q8_0_greedy_tokens_equal_the_unquantized_model_over_16_steps(trained, unquantized):
    # Like with like: float32 activations, as the unquantized model computes, so that what
    # is measured is Q8_0's weights. The int8 activations round too and may flip near-ties
    # (tests/test_cpu_paths.py bounds their logits).
    backend = _isq(trained, "Q8_0", cpu_matmul="float32")
    for prompt in PROMPTS:
        expected = unquantized.generate(prompt, max_tokens=16, temperature=0).token_ids
        assert backend.generate(prompt, max_tokens=16, temperature=0).token_ids == expected


@pytest.mark.parametrize(
    ("isq", "projection", "promoted"),
    [
        ("Q2K", Q.Q2_K, Q.Q6_K),
        ("Q4K", Q.Q4_K, Q.Q6_K),
        ("Q4_1", Q.Q4_1, Q.Q6_K),
        ("Q5K", Q.Q5_K, Q.Q8_0),
        ("Q6K", Q.Q6_K, Q.Q8_0),
        ("Q8_1", Q.Q8_1, Q.Q8_0),
    ],
)
def test_projections_take_the_type_and_embeddings_are_promoted(trained, isq, projection, promoted):
    model = _isq(trained, isq).model
    layers = dict(model.named_modules())
    for name, module in layers.items():
        if name.rpartition(".")[2] in PROJECTIONS:
            assert isinstance(module, QuantLinear), name
            assert module.weight_q.qtype == projection, name
    assert isinstance(layers["model.embed_tokens"], QuantEmbedding)
    assert layers["model.embed_tokens"].weight_q.qtype == promoted
    assert layers["lm_head"].weight_q.qtype == promoted
    norms = [p for n, p in model.named_parameters() if "norm" in n]
    assert norms
    assert all(p.dtype == torch.float32 for p in norms)
    assert not any(isinstance(m, torch.nn.Linear) for m in layers.values())


def test_isq_from_the_environment(trained, monkeypatch):
    monkeypatch.setenv("MISTRALRS_ISQ", "q4_k_m")
    monkeypatch.setenv("MISTRALRS_DEVICE", "cpu")
    model = load_backend(str(trained.path)).model
    assert model.get_submodule("model.layers.0.mlp.down_proj").weight_q.qtype == Q.Q4_K
    result = load_backend(str(trained.path)).generate(PROMPTS[0], max_tokens=4)
    assert len(result.token_ids) == 4


def test_weights_are_quantized_one_at_a_time_as_they_stream():
    consumed = []

    def tensors():
        for i in range(3):
            consumed.append(i)
            yield f"model.layers.{i}.mlp.up_proj.weight", torch.randn(64, 256)

    stream = apply_isq(tensors(), IsqType.Q4K)
    for i, (_, weight) in enumerate(stream):
        assert consumed == list(range(i + 1))  # nothing read ahead
        assert isinstance(weight, QuantizedWeight)
        assert weight.nbytes == 64 * 144  # 144 bytes per 256 values


@pytest.mark.parametrize(
    ("isq", "fallback"),
    [("Q2K", Q.Q4_0), ("Q3K", Q.Q4_0), ("Q4K", Q.Q4_1), ("Q5K", Q.Q5_0), ("Q6K", Q.Q5_1)],
)
def test_k_quants_fall_back_where_rows_do_not_split_into_256(tiny, caplog, isq, fallback):
    # The tiny Llama's rows hold 64 or 128 values: no whole 256-value K-quant blocks.
    with caplog.at_level(logging.INFO, logger="spnl_backend"):
        backend = load_backend(
            str(tiny.hf("llama").path), settings=BackendSettings(device="cpu", isq=isq)
        )
    model = backend.model
    assert model.get_submodule("model.layers.0.mlp.down_proj").weight_q.qtype == fallback
    assert "isq.fallback" in caplog.text
    assert f"fallback='{fallback.name}'" in caplog.text
    assert len(backend.generate(PROMPTS[0], max_tokens=4, temperature=0).token_ids) == 4


def test_rows_that_fit_no_block_stay_float_and_say_so(caplog):
    stream = [("model.layers.0.mlp.up_proj.weight", torch.randn(8, 48))]
    with caplog.at_level(logging.WARNING, logger="spnl_backend"):
        ((_, weight),) = list(apply_isq(iter(stream), IsqType.Q4K))
    assert isinstance(weight, torch.Tensor)
    assert "isq.skipped" in caplog.text
    assert "do not split into blocks of 256 (nor of 32)" in caplog.text


def test_isq_on_a_gguf_model_is_ignored_with_the_reason(tiny, caplog):
    path = tiny.gguf("llama", Q.Q8_0)
    with caplog.at_level(logging.WARNING, logger="spnl_backend"):
        backend = load_backend(str(path), settings=BackendSettings(device="cpu", isq="Q4_0"))
    assert "isq.ignored" in caplog.text
    assert "runs on the quantized types its file stores" in caplog.text
    down = backend.model.get_submodule("model.layers.0.mlp.down_proj")
    assert down.weight_q.qtype == Q.Q8_0


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_K, Q.Q6_K, Q.Q8_0])
def test_requantizing_stored_blocks_equals_quantizing_their_values(monkeypatch, qtype):
    """How a draft is made from a GGUF: each slice dequantized, then quantized."""
    import spnl_backend.quant.isq as isq

    monkeypatch.setattr(isq, "REQUANTIZE_SLICE_ELEMENTS", 3 * 512)  # several slices
    stored = QuantizedWeight.from_float(torch.randn(20, 512), Q.Q8_0)
    again = isq.requantize(stored, qtype)
    assert again.qtype == qtype
    assert torch.equal(again.data, QuantizedWeight.from_float(stored.dequantize(), qtype).data)


def test_draft_isq_requantizes_a_gguf(tiny, caplog):
    from spnl_backend.loader.model import load_model
    from spnl_backend.loader.progress import LogProgress
    from spnl_backend.loader.resolve import resolve_model
    from spnl_backend.settings import detect_platform

    source = resolve_model(str(tiny.gguf("llama", Q.Q8_0)))
    with caplog.at_level(logging.INFO, logger="spnl_backend"):
        loaded = load_model(
            source, IsqType.Q4_0, detect_platform(CPU), LogProgress(), requantize_gguf=True
        )
    types = {
        m.weight_q.qtype
        for name, m in loaded.model.named_modules()
        if isinstance(m, QuantLinear) and name.endswith("proj")
    }
    assert types == {Q.Q4_0}
    assert "isq.requantize" in caplog.text
