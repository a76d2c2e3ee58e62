"""Model files that change after loading, or that are not files at all: the weights are the
process's own memory (a truncated file cannot kill it), and nothing that would block a
read (a FIFO, a device) is opened."""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
from gguf import GGMLQuantizationType
from helpers import CPU

from spnl_backend import ModelFileError, ModelNotFoundError, load_backend

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="FIFOs and truncation: POSIX")


@pytest.mark.parametrize("kind", ["gguf", "safetensors"])
def test_a_file_truncated_after_loading_does_not_touch_the_loaded_model(tiny, tmp_path, kind):
    """In a child process, so that the SIGBUS a mapped file would raise fails the test."""
    if kind == "gguf":
        source = tmp_path / "m.gguf"
        shutil.copy(tiny.gguf("llama", GGMLQuantizationType.Q8_0), source)
        victims = [source]
    else:
        source = tmp_path / "m"
        shutil.copytree(tiny.hf("llama").path, source)
        victims = list(source.glob("*.safetensors"))
    script = textwrap.dedent(
        f"""
        import os
        from spnl_backend import BackendSettings, load_backend
        backend = load_backend({str(source)!r}, settings=BackendSettings(device="cpu"))
        before = backend.generate("The quick brown fox", max_tokens=8, temperature=0).token_ids
        for victim in {[str(v) for v in victims]!r}:
            os.truncate(victim, 16)
        after = backend.generate("The quick brown fox", max_tokens=8, temperature=0).token_ids
        assert before == after, (before, after)
        print("unharmed")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert "unharmed" in done.stdout


def test_a_file_that_shrinks_while_loading_is_an_error(tiny, tmp_path, monkeypatch):
    from spnl_backend.loader import gguf_file

    path = tmp_path / "m.gguf"
    shutil.copy(tiny.gguf("llama", GGMLQuantizationType.Q8_0), path)
    real = gguf_file.GGUFFile.raw

    def shrinks_first(self, name):
        os.truncate(path, self.file_size // 2)
        return real(self, name)

    monkeypatch.setattr(gguf_file.GGUFFile, "raw", shrinks_first)
    with pytest.raises(ModelFileError, match="changed size while it was being loaded"):
        load_backend(str(path), settings=CPU)


def test_a_fifo_named_like_a_model_is_not_opened(tmp_path):
    fifo = tmp_path / "model-Q4_K_M.gguf"
    os.mkfifo(fifo)
    with pytest.raises(ModelNotFoundError, match="a FIFO, not a regular file"):
        load_backend(str(fifo), settings=CPU)
    with pytest.raises(ModelNotFoundError, match=r"without config\.json"):
        load_backend(str(tmp_path), settings=CPU)  # the directory's only .gguf is skipped


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "model.safetensors"])
def test_a_fifo_in_a_text_model_directory_is_refused(tiny, tmp_path, name):
    directory = tmp_path / "m"
    shutil.copytree(tiny.hf("llama").path, directory)
    (directory / name).unlink()
    os.mkfifo(directory / name)
    if name == "model.safetensors":  # another shard keeps it a text model directory
        shutil.copy(next(tiny.hf("llama").path.glob("*.safetensors")), directory / "a.safetensors")
    with pytest.raises(ModelFileError, match=f"{name}: a FIFO, not a regular file"):
        load_backend(str(directory), settings=CPU)


def test_a_home_directory_that_does_not_exist_is_not_found():
    with pytest.raises(ModelNotFoundError, match="nosuchuser"):
        load_backend("~nosuchuser-spnl/model.gguf", settings=CPU)


def test_a_config_nested_beyond_reason_is_a_file_error(tiny, tmp_path):
    directory = tmp_path / "m"
    shutil.copytree(tiny.hf("llama").path, directory)
    (directory / "config.json").write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(ModelFileError, match=r"config\.json: not valid JSON"):
        load_backend(str(directory), settings=CPU)
