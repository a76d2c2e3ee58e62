"""The Triton kernels against their torch twins: under Triton's interpreter on the CPU
(TRITON_INTERPRET=1, which tests/conftest.py sets before Triton is imported), compiled on
a GPU, where the tests carry the `cuda` marker. Skipped where Triton is not installed."""

import pytest
import torch

pytest.importorskip("triton")

from paged_cases import CASES
from triton_support import DEVICE, check_attention, check_store, fp8_case, load_kernels

pytestmark = [pytest.mark.cuda] if DEVICE == "cuda" else []
KERNELS = load_kernels()
GQA = {"ratio 1": (4, 4), "ratio 4": (2, 8), "ratio 8": (2, 16), "MQA": (1, 8)}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("heads", list(GQA))
def test_cases_and_gqa_ratios(case, heads):
    kv_heads, query_heads = GQA[heads]
    check_attention(KERNELS, DEVICE, case, kv_heads, query_heads, scale=0.17)


@pytest.mark.parametrize("case", ["prefill", "prefix hit", "decode", "mixed"])
@pytest.mark.parametrize(
    "options",
    [
        {"sliding_window": 6},
        {"softcap": 5.0},
        {"sliding_window": 20, "softcap": 3.0},
    ],
    ids=["window", "softcap", "window+softcap"],
)
def test_window_and_softcap(case, options):
    check_attention(KERNELS, DEVICE, case, scale=0.5, **options)


@pytest.mark.parametrize("case", ["prefill", "prefix hit", "chunked prefill", "mixed"])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize(
    "options", [{"chunk": 5}, {"chunk": 8, "sliding_window": 5}], ids=["chunk", "chunk+window"]
)
def test_chunked_attention(case, splits, options):
    """Llama 4's chunks: a query sees only the keys of its own chunk of positions, in one
    program and split (a tile's queries may start in different chunks)."""
    check_attention(KERNELS, DEVICE, case, scale=0.4, num_splits=splits, **options)


@pytest.mark.parametrize("case", ["prefix hit", "mixed"])
def test_alibi(case):
    slopes = torch.tensor([2.0 ** -(i + 1) for i in range(8)])
    check_attention(KERNELS, DEVICE, case, scale=0.3, alibi_slopes=slopes)


@pytest.mark.parametrize("case", ["prefill", "decode", "mixed"])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("window", [None, 6])
def test_sinks(case, splits, window):
    """gpt-oss's sinks, in one program's softmax and in the merge of split keys."""
    sinks = torch.tensor([2.0, -1.0, 0.5, 0.0, 6.0, -3.0, 1.0, 0.25])
    check_attention(
        KERNELS, DEVICE, case, scale=0.3, num_splits=splits, sliding_window=window, sinks=sinks
    )


@pytest.mark.parametrize("block_size", [8, 32, 256])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("case", ["decode", "mixed"])
def test_block_sizes_and_head_dims(block_size, head_dim, case):
    check_attention(KERNELS, DEVICE, case, 1, 4, block_size, head_dim, scale=head_dim**-0.5)


@pytest.mark.parametrize("case", ["decode", "mixed", "prefix hit"])
@pytest.mark.parametrize("splits", [2, 5])
def test_split_kv_reduction(case, splits):
    check_attention(KERNELS, DEVICE, case, scale=0.2, num_splits=splits, sliding_window=40)


@pytest.mark.parametrize("case", ["decode", "mixed", "chunked prefill"])
def test_fp8_cache(case):
    fp8_case(KERNELS, DEVICE, case)


@pytest.mark.skipif(
    DEVICE == "cpu",
    reason="Triton's interpreter gets bfloat16 dot products "
    "wrong (numpy has no bfloat16); compiled on a GPU they are exact",
)
def test_bfloat16():
    check_attention(KERNELS, DEVICE, "mixed", dtype=torch.bfloat16, scale=0.2, atol=2e-2)


@pytest.mark.parametrize(("kv_heads", "head_dim"), [(1, 64), (3, 40), (8, 128)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn])
def test_store_with_padding_slots(kv_heads, head_dim, cache_dtype):
    scales = (2.0, 0.01) if cache_dtype == torch.float8_e4m3fn else (1.0, 1.0)
    check_store(KERNELS, DEVICE, kv_heads, head_dim, cache_dtype, scales)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_end_to_end_greedy_equals_the_torch_path(tiny, arch):
    """A tiny model run through the Triton kernels (interpreted here, compiled on a GPU)
    gives the same greedy tokens as the CPU's torch kernels."""
    from helpers import PROMPT, engine_internals

    from spnl_backend import BackendSettings, load_backend
    from spnl_backend.kernels import select_attention_kernels

    # float32 pools: the Triton kernels store the model's dtype (float32 on the CPU)
    reference = load_backend(
        str(tiny.hf(arch).path),
        settings=BackendSettings(
            device="cpu", paged_attn=True, paged_attn_block_size=16, paged_cache_type="f32"
        ),
    )
    expected = reference.generate([PROMPT, "The capital"], max_tokens=12, temperature=0)
    # float32 throughout: on a GPU the model's dtype (float32, so its pools are too), so
    # that the kernels are all that differs from the reference
    pool = {"paged_cache_type": "f32"} if DEVICE == "cpu" else {"dtype": "float32"}
    triton_backend = load_backend(
        str(tiny.hf(arch).path),
        settings=BackendSettings(device=DEVICE, paged_attn=True, paged_attn_block_size=16, **pool),
    )
    if DEVICE == "cpu":  # the platform picks torch kernels on the CPU; use Triton's anyway
        engine_internals(triton_backend).cache.kernels = select_attention_kernels("triton")
    else:  # chosen at load, and reported so
        assert triton_backend.cache_info().kernels == "triton"
    assert engine_internals(triton_backend).cache.kernels.name == "triton"
    results = triton_backend.generate([PROMPT, "The capital"], max_tokens=12, temperature=0)
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
