"""The segmented LoRA product: the C kernel (``kernels/cpu/lora.c``) against its torch twin
(`lora_ref.lora_add_ref`), a row's bits the same alone as in any mix of adapters and base
rows, its arguments checked, and the dispatch that picks a twin per call."""

import ctypes
import platform
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import spnl_backend.kernels.cpu as cpu
from spnl_backend.kernels.cpu import KernelArgumentError
from spnl_backend.kernels.cpu.abi import SIGNATURES
from spnl_backend.kernels.cpu.lora import lora_add_native
from spnl_backend.kernels.dispatch import TORCH_CHOICE, KernelChoice
from spnl_backend.kernels.lora_ref import (
    LoraPair,
    LoraSegment,
    LoraSite,
    LoraStep,
    lora_add_ref,
    lora_delta_ref,
)
from spnl_backend.settings.platform import find_c_compiler


def _pair(gen, rank: int, k_in: int, n_out: int, scale: float = 0.5) -> LoraPair:
    a = torch.randn(rank, k_in, generator=gen) / k_in**0.5
    return LoraPair(a, torch.randn(n_out, rank, generator=gen), scale)


def _case(rows: int, k_in: int, n_out: int, ranks=(4, 16), seed: int = 0):
    """``x``, a base output and one segment per rank, over every third row each (the rest
    are base rows)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k_in, generator=gen)
    out = torch.randn(rows, n_out, generator=gen)
    segments = [
        LoraSegment(torch.arange(rows)[i :: len(ranks) + 1], _pair(gen, r, k_in, n_out), 0.3 + i)
        for i, r in enumerate(ranks)
    ]
    return x, out, segments


@pytest.mark.parametrize(
    ("rows", "k_in", "n_out", "ranks"),
    [
        (1, 16, 16, (8,)),
        (7, 70, 37, (1, 5)),  # widths that are no whole number of vectors
        (12, 96, 80, (16, 33, 2)),
        (40, 256, 130, (64, 16)),  # enough work for the threads
    ],
)
def test_native_equals_the_torch_twin(native_kernels, rows, k_in, n_out, ranks):
    x, out, segments = _case(rows, k_in, n_out, ranks)
    want = lora_add_ref(x, out, segments)
    got = lora_add_native(native_kernels, x, out, segments)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    untouched = torch.ones(rows, dtype=torch.bool)
    for seg in segments:
        untouched[seg.rows] = False
    assert torch.equal(got[untouched], out[untouched])  # base rows keep their bits
    assert not torch.equal(got, out)


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_a_row_is_the_same_alone_and_in_any_mix(native_kernels, rows):
    """Batch invariance, bit for bit: a row of one adapter alone, then among rows of
    other adapters and base rows, at several step sizes (the largest runs on the threads)."""
    x, out, segments = _case(rows, 200, 72, (8, 16, 24), seed=rows)
    mixed = lora_add_native(native_kernels, x, out, segments)
    for seg in segments:
        for row in seg.rows.tolist():
            alone = lora_add_native(
                native_kernels,
                x[row : row + 1],
                out[row : row + 1],
                [LoraSegment(torch.tensor([0]), seg.pair, seg.scale)],
            )
            assert torch.equal(alone[0], mixed[row])


def test_a_row_keeps_its_bits_wherever_it_sits(native_kernels):
    """The same row at another index, its segment listed first or last: the same bits."""
    x, out, segments = _case(9, 48, 40, (8, 8))
    mixed = lora_add_native(native_kernels, x, out, segments)
    flipped = lora_add_native(
        native_kernels,
        x.flip(0),
        out.flip(0),
        [LoraSegment(8 - s.rows, s.pair, s.scale) for s in segments[::-1]],
    )
    assert torch.equal(flipped.flip(0), mixed)


def test_a_row_of_several_adapters_takes_each_in_segment_order(native_kernels):
    x, out, segments = _case(9, 48, 40, (4, 8))
    both = [segments[0], LoraSegment(segments[0].rows, segments[1].pair, 0.5)]
    got = lora_add_native(native_kernels, x, out, both)
    torch.testing.assert_close(got, lora_add_ref(x, out, both), rtol=1e-5, atol=1e-5)
    # each row as it is alone, with the same adapters in the same order
    for row in segments[0].rows.tolist():
        alone = [LoraSegment(torch.tensor([0]), s.pair, s.scale) for s in both]
        single = lora_add_native(native_kernels, x[row : row + 1], out[row : row + 1], alone)
        assert torch.equal(single[0], got[row])


def test_no_segment_rows_change_nothing(native_kernels):
    x, out, segments = _case(5, 32, 16, (4,))
    empty = [LoraSegment(torch.zeros(0, dtype=torch.int64), segments[0].pair, 1.0)]
    got = lora_add_native(native_kernels, x, out, empty)
    assert torch.equal(got, out)
    assert got.data_ptr() != out.data_ptr()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s: [LoraSegment(torch.tensor([0, 5]), s[0].pair, 1.0)], "out of bounds"),
        (lambda s: [LoraSegment(torch.tensor([-1]), s[0].pair, 1.0)], "out of bounds"),
        (  # a row twice in one segment
            lambda s: [LoraSegment(torch.cat([s[0].rows, s[0].rows[:1]]), s[0].pair, 1.0)],
            "rejected",
        ),
        (
            lambda s: [
                LoraSegment(s[0].rows, LoraPair(torch.ones(4, 31), torch.ones(16, 4), 1.0), 1.0)
            ],
            r"A \(4, 31\) and B \(16, 4\) for a projection 32 → 16",
        ),
        (
            lambda s: [
                LoraSegment(
                    s[0].rows, LoraPair(torch.ones(4, 32).double(), torch.ones(16, 4), 1.0), 1.0
                )
            ],
            "lora: A is of torch.float64",
        ),
    ],
)
def test_bad_arguments_are_refused(native_kernels, change, message):
    x, out, segments = _case(5, 32, 16, (4, 4))
    with pytest.raises(KernelArgumentError, match=message):
        lora_add_native(native_kernels, x, out, change(segments))


def test_the_transposed_copy_is_counted():
    pair = _pair(torch.Generator().manual_seed(0), 4, 32, 16)
    assert torch.equal(pair.bt, pair.b.T)
    assert pair.bt.is_contiguous()
    assert pair.nbytes == pair.a.nbytes + 2 * pair.b.nbytes
    half = LoraPair(pair.a.bfloat16(), pair.b.bfloat16(), 1.0)  # no C kernel for it
    assert half.bt is None
    assert half.nbytes == half.a.nbytes + half.b.nbytes


def test_dispatch_picks_the_twin_per_call(native_kernels):
    from spnl_backend.kernels.lora_ref import lora_add_ref as ref

    x, out = torch.zeros(2, 8), torch.zeros(2, 8)
    native = KernelChoice(native_kernels).lora_add(x, out)
    assert native.func is lora_add_native
    assert native.args == (native_kernels,)
    assert KernelChoice(native_kernels).lora_add(x.bfloat16(), out.bfloat16()) is ref
    assert TORCH_CHOICE.lora_add(x, out) is ref
    assert KernelChoice(triton=True).lora_add(x, out) is ref  # CPU tensors: not Triton's


def test_site_adds_each_rows_adapter_through_its_kernels(native_kernels):
    """`LoraSite.add` over the native kernels: each row its own slot's product, base rows
    untouched, equal to the torch twin's site to rounding; nothing added without rows."""
    gen = torch.Generator().manual_seed(3)
    x, out = torch.randn(6, 40, generator=gen), torch.randn(6, 24, generator=gen)
    step = LoraStep()
    sites = [LoraSite(step, KernelChoice(native_kernels)), LoraSite(step)]
    pairs = {0: _pair(gen, 4, 40, 24, 2.0), 2: _pair(gen, 8, 40, 24, 0.25)}
    for site in sites:
        site.pairs.update(pairs)
    assert sites[0].add(x, out) is out
    step.groups = [
        (0, 1.0, torch.tensor([1, 4])),
        (2, 0.5, torch.tensor([0])),
        (7, 1.0, torch.tensor([5])),
    ]
    native, twin = (site.add(x, out) for site in sites)
    torch.testing.assert_close(native, twin, rtol=1e-5, atol=1e-5)
    want = out[1] + lora_delta_ref(x[1:2], pairs[0].a, pairs[0].b, 2.0)[0]
    torch.testing.assert_close(native[1], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(native[[2, 3, 5]], out[[2, 3, 5]])  # slot 7 is not at this site


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith("flags")), "")
    except OSError:
        return ""


# Each vector path of lora.c (through common.h's helpers): the generic vectors without FMA,
# AVX2 with FMA, AVX-512; each built where this CPU runs it.
VECTOR_PATHS = {
    "generic": ("x86-64", "sse2"),
    "avx2": ("haswell", "avx2"),
    "avx512": ("skylake-avx512", "avx512f"),
}


@pytest.mark.parametrize("path", list(VECTOR_PATHS))
def test_every_vector_path_equals_the_twin(path, tmp_path):
    """lora.c built for each instruction set this CPU has (not -march=native alone): the
    torch twin's results to rounding, and a row's bits the same alone as in a mix."""
    march, flag = VECTOR_PATHS[path]
    compiler = find_c_compiler()
    if platform.machine() != "x86_64" or compiler is None or flag not in _cpu_flags().split():
        pytest.skip(f"needs an x86-64 CPU with {flag} and a C compiler")
    here = Path(cpu.__file__).parent
    library = tmp_path / f"lora_{path}.so"
    flags = ["-O3", f"-march={march}", "-fPIC", "-shared", "-std=gnu11", "-ffp-contract=off"]
    sources = [str(here / "lora.c"), str(here / "pool.c")]
    subprocess.run([compiler, *flags, *sources, "-o", str(library), "-pthread"], check=True)
    lib = ctypes.CDLL(str(library))
    lib.spnl_lora_add.argtypes, lib.spnl_lora_add.restype = SIGNATURES["spnl_lora_add"]
    kernels = SimpleNamespace(library=lib, threads=2)
    x, out, segments = _case(40, 200, 75, (8, 16, 3), seed=7)
    mixed = lora_add_native(kernels, x, out, segments)
    torch.testing.assert_close(mixed, lora_add_ref(x, out, segments), rtol=1e-5, atol=1e-5)
    for seg in segments:
        row = int(seg.rows[-1])
        one = [LoraSegment(torch.tensor([0]), seg.pair, seg.scale)]
        alone = lora_add_native(kernels, x[row : row + 1], out[row : row + 1], one)
        assert torch.equal(alone[0], mixed[row])
