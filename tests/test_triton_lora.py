"""Triton's segmented LoRA product (compiled on a GPU, interpreted on the CPU) against its
torch twin, and a row's bits the same alone as among other adapters' and base rows."""

import pytest
import torch
from triton_support import DEVICE

pytest.importorskip("triton")

from spnl_backend.kernels.lora_ref import LoraPair, LoraSegment, lora_add_ref
from spnl_backend.kernels.triton_lora import lora_add_triton

pytestmark = [pytest.mark.cuda] if DEVICE == "cuda" else []


def _case(rows: int, k_in: int, n_out: int, ranks, dtype=torch.float32, seed: int = 0):
    """``x`` and a base output (``dtype``), one float32 adapter per rank over every third
    row each (the rest are base rows)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k_in, generator=gen).to(dtype)
    out = torch.randn(rows, n_out, generator=gen).to(dtype)
    segments = []
    for i, rank in enumerate(ranks):
        a = torch.randn(rank, k_in, generator=gen) / k_in**0.5
        pair = LoraPair(a, torch.randn(n_out, rank, generator=gen), 0.5)
        segments.append(LoraSegment(torch.arange(rows)[i :: len(ranks) + 1], pair, 0.5 + i))
    return x, out, segments


def _on(segments, device):
    return [
        LoraSegment(
            s.rows.to(device), LoraPair(s.pair.a.to(device), s.pair.b.to(device), 1), s.scale
        )
        for s in segments
    ]


@pytest.mark.parametrize(
    ("rows", "k_in", "n_out", "ranks"),
    [(1, 16, 16, (4,)), (7, 70, 37, (3, 16)), (9, 130, 80, (8, 20))],  # partial tiles
)
def test_triton_equals_the_torch_twin(rows, k_in, n_out, ranks):
    x, out, segments = _case(rows, k_in, n_out, ranks)
    got = lora_add_triton(x.to(DEVICE), out.to(DEVICE), _on(segments, DEVICE)).cpu()
    torch.testing.assert_close(got, lora_add_ref(x, out, segments), rtol=1e-5, atol=1e-5)
    base = torch.ones(rows, dtype=torch.bool)
    for seg in segments:
        base[seg.rows] = False
    assert torch.equal(got[base], out[base])


def test_bfloat16_rows_round_once():
    x, out, segments = _case(6, 32, 24, (4,), torch.bfloat16)
    got = lora_add_triton(x.to(DEVICE), out.to(DEVICE), _on(segments, DEVICE)).cpu()
    assert got.dtype is torch.bfloat16
    torch.testing.assert_close(got, lora_add_ref(x, out, segments), rtol=1e-2, atol=1e-2)


def test_a_row_is_the_same_alone_and_in_a_mix():
    x, out, segments = _case(8, 48, 40, (4, 8, 16), seed=1)
    on = _on(segments, DEVICE)
    mixed = lora_add_triton(x.to(DEVICE), out.to(DEVICE), on).cpu()
    for seg, there in zip(segments, on, strict=True):
        for row in seg.rows.tolist():
            one = [LoraSegment(torch.tensor([0], device=DEVICE), there.pair, seg.scale)]
            alone = lora_add_triton(x[row : row + 1].to(DEVICE), out[row : row + 1].to(DEVICE), one)
            assert torch.equal(alone.cpu()[0], mixed[row])
