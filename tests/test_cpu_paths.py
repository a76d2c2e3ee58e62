"""Every arithmetic path the CPU dispatch can pick, forced by its setting, against the torch
twin (dequantize, then a float32 product), each with a bound derived from its own rounding.

Which path runs by default depends on the machine (int8 products need AVX2; bfloat16
GEMMs are picked where they run in hardware), so every expectation here holds for each
path, and the paths a machine cannot run are skipped with the reason.
"""

import itertools

import pytest
import torch
from helpers import model_logits

from spnl_backend import BackendSettings, PlatformError, load_backend

PROMPTS = ["The capital of France is", "Once upon a time there was", "def add(a, b):"]
LONG = "The quick brown fox jumps over the lazy dog. " * 4  # more rows than the native path
FEW_ROWS = 12  # positions scored one prefix at a time: the native products of a few rows

# Relative L2 distance of the logits from the torch twin's. float32 differs only in the
# order of sums (u = 2^-24 per operation, allowed to grow to 2^-16 through the layers;
# measured 3e-7). int8 activations are rounded per block of 32 to 1/127 of its largest
# magnitude, at most 2^-8 of it; bfloat16 keeps 8 bits of mantissa, 2^-9 per operand and
# 2^-8 per product; both are allowed to grow to 2^-6 (measured 4.7e-3 and 3.4e-3).
BOUND = {"float32": 2**-16, "int8": 2**-6, "bfloat16": 2**-6}
# gemm None: batch invariance (the default), every row count through the native products
PATHS = list(itertools.product(["int8", "float32"], [None, "float32", "bfloat16"]))


@pytest.fixture(scope="module")
def trained(tiny):
    return tiny.trained().path


def _load(path, **settings):
    """The build as shipped, without the index checks the rest of the suite turns on."""
    settings = BackendSettings(device="cpu", isq="Q8_0", native_checks=False, **settings)
    return load_backend(str(path), settings=settings)


@pytest.fixture(scope="module")
def twin(trained):
    return _load(trained, cpu_kernels="torch")


def _path(trained, matmul, gemm):
    gemms = {"batch_invariant": False, "cpu_gemm": gemm} if gemm else {}
    try:
        backend = _load(trained, cpu_kernels="native", cpu_matmul=matmul, **gemms)
    except PlatformError as exc:
        pytest.skip(f"this machine cannot run it: {exc}")
    assert (backend.platform.cpu_matmul, backend.platform.cpu_gemm) == (matmul, gemm)
    return backend


def _distance(logits, expected):
    return ((logits - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize(("matmul", "gemm"), PATHS)
def test_each_path_stays_within_its_rounding(trained, twin, matmul, gemm):
    backend = _path(trained, matmul, gemm)
    ids = twin.tokenizer.encode(LONG)
    expected = model_logits(twin, ids)
    prefill = _distance(model_logits(backend, ids), expected)
    assert prefill <= BOUND[gemm or matmul]  # a GEMM of every row, or the native products
    if gemm == "bfloat16":
        assert prefill > BOUND["float32"], "bfloat16's rounding should show: did it run?"
    few = torch.cat([model_logits(backend, ids[: i + 1])[-1:] for i in range(FEW_ROWS)])
    assert _distance(few, expected[:FEW_ROWS]) <= BOUND[matmul]  # the native products


@pytest.mark.parametrize("gemm", [None, "float32"])
def test_the_float32_path_generates_the_twins_tokens(trained, twin, gemm):
    backend = _path(trained, "float32", gemm)
    for prompt in PROMPTS:
        expected = twin.generate(prompt, max_tokens=16, temperature=0).token_ids
        assert backend.generate(prompt, max_tokens=16, temperature=0).token_ids == expected


def test_the_torch_kernels_are_what_the_setting_says(twin):
    assert twin.platform.kernels == "torch"
    assert (twin.platform.cpu_matmul, twin.platform.cpu_gemm) == (None, None)
