"""Model resolution and the loader's errors on bad model files."""

import json
import shutil
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from helpers import CPU

from spnl_backend import (
    BackendSettings,
    ModelFileError,
    ModelNotFoundError,
    UnsupportedArchitectureError,
    load_backend,
)
from spnl_backend.loader.gguf_file import GGUFFile
from spnl_backend.loader.resolve import resolve_model


def _touch(path: Path, data: bytes = b"") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


# ---- resolution order -----------------------------------------------------------------------


def test_gguf_file_path(tmp_path):
    file = _touch(tmp_path / "m.gguf")
    assert resolve_model(str(file)).kind == "gguf"


def test_text_model_directory(tmp_path):
    _touch(tmp_path / "config.json", b"{}")
    _touch(tmp_path / "model.safetensors")
    source = resolve_model(str(tmp_path))
    assert (source.kind, source.path) == ("text", tmp_path)


@pytest.mark.parametrize(
    ("files", "chosen"),
    [
        (["m.Q8_0.gguf", "m.Q4_K_M.gguf", "m.Q5_K_M.gguf"], "m.Q4_K_M.gguf"),
        (["m.Q8_0.gguf", "m.Q5_K_M.gguf"], "m.Q5_K_M.gguf"),
        (["m.Q4_K_S.gguf", "m.Q8_0.gguf"], "m.Q8_0.gguf"),
        (["m.q4_k_s.gguf", "m.IQ2.gguf"], "m.q4_k_s.gguf"),
        (["only.gguf"], "only.gguf"),
    ],
)
def test_gguf_directory_prefers_spnls_quantizations(tmp_path, files, chosen):
    for name in files:
        _touch(tmp_path / name)
    assert resolve_model(str(tmp_path)).path.name == chosen


def test_gguf_directory_with_no_preferred_file_asks_for_a_name(tmp_path):
    _touch(tmp_path / "a.IQ2.gguf")
    _touch(tmp_path / "b.F16.gguf")
    with pytest.raises(ModelNotFoundError, match=r"a\.IQ2\.gguf, b\.F16\.gguf"):
        resolve_model(str(tmp_path))


def _hub_cache(home: Path, repo: str, files: dict[str, bytes]) -> Path:
    root = home / "hub" / ("models--" + repo.replace("/", "--"))
    snapshot = root / "snapshots" / "0123456789abcdef"
    for name, data in files.items():
        _touch(snapshot / name, data)
    _touch(root / "refs" / "main", b"0123456789abcdef")
    return snapshot


def test_hub_id_found_in_the_local_cache(tmp_path, monkeypatch):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    snapshot = _hub_cache(
        tmp_path, "org/Tiny-GGUF", {"tiny.Q8_0.gguf": b"x", "tiny.Q4_K_M.gguf": b"y"}
    )
    source = resolve_model("org/Tiny-GGUF", allow_download=False)
    assert (source.kind, source.path) == ("gguf", snapshot / "tiny.Q4_K_M.gguf")
    named = resolve_model("org/Tiny-GGUF/tiny.Q8_0.gguf", allow_download=False)
    assert named.path == snapshot / "tiny.Q8_0.gguf"


def test_text_hub_id_found_in_the_local_cache(tmp_path, monkeypatch):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    snapshot = _hub_cache(tmp_path, "org/tiny", {"config.json": b"{}", "model.safetensors": b""})
    assert resolve_model("org/tiny", allow_download=False).path == snapshot


def test_missing_model_lists_what_was_tried(tmp_path, monkeypatch):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelNotFoundError) as caught:
        resolve_model("nobody/nothing")
    message = str(caught.value)
    assert "no such file or directory" in message
    assert "not in the local Hugging Face cache" in message
    assert "download failed" in message  # HF_HUB_OFFLINE=1 in the tests


def test_missing_path_is_model_not_found(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no such file"):
        load_backend(str(tmp_path / "absent.gguf"), settings=CPU)


def test_directory_without_a_model(tmp_path):
    _touch(tmp_path / "README.md", b"hi")
    with pytest.raises(ModelNotFoundError, match=r"without config\.json"):
        resolve_model(str(tmp_path))


# ---- bad files ------------------------------------------------------------------------------


def test_truncated_gguf_names_the_file_and_the_tensor(tiny, tmp_path):
    original = tiny.gguf("llama", Q.F32)
    data = original.read_bytes()
    cut = _touch(tmp_path / "cut.gguf", data[: len(data) - 1000])
    with pytest.raises(ModelFileError) as caught:
        load_backend(str(cut), settings=CPU)
    assert str(cut) in str(caught.value)
    assert "truncated: tensor" in str(caught.value)


def test_gguf_cut_inside_the_header(tiny, tmp_path):
    data = tiny.gguf("llama", Q.F32).read_bytes()
    cut = _touch(tmp_path / "header.gguf", data[:200])
    with pytest.raises(ModelFileError, match="truncated or corrupt GGUF header"):
        GGUFFile(cut)


def test_not_a_gguf_file(tmp_path):
    bad = _touch(tmp_path / "bad.gguf", b"not a gguf file at all")
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        load_backend(str(bad), settings=CPU)


def test_unknown_gguf_architecture_lists_the_supported_ones(tmp_path):
    path = tmp_path / "mamba.gguf"
    writer = GGUFWriter(path, "mamba")
    writer.add_tensor("token_embd.weight", __import__("numpy").zeros((4, 8), "float32"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        UnsupportedArchitectureError, match=r"'mamba'.*llama, mistral3, qwen2, qwen3"
    ):
        load_backend(str(path), settings=CPU)


def test_unknown_text_architecture_lists_the_supported_ones(tiny, tmp_path):
    model_dir = tmp_path / "gpt2ish"
    shutil.copytree(tiny.hf("llama").path, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (model_dir / "config.json").write_text(json.dumps(config))
    native = BackendSettings(device="cpu", model_impl="native")
    with pytest.raises(UnsupportedArchitectureError, match=r"'gpt2'.*llama, mistral, qwen2"):
        load_backend(str(model_dir), settings=native)
    # by default it goes to transformers' modeling code, whose GPT-2 has no such tensors
    with pytest.raises(ModelFileError, match=r"unexpected tensor 'model\.embed_tokens"):
        load_backend(str(model_dir), settings=CPU)


def test_truncated_safetensors(tiny, tmp_path):
    model_dir = tmp_path / "cut"
    shutil.copytree(tiny.hf("qwen2").path, model_dir)
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-5000])
    with pytest.raises(ModelFileError, match="truncated or corrupt safetensors"):
        load_backend(str(model_dir), settings=CPU)


def test_missing_and_unexpected_weights_are_named(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir = tmp_path / "edited"
    shutil.copytree(tiny.hf("qwen3").path, model_dir)
    weights = load_file(model_dir / "model.safetensors")
    weights.pop("model.layers.1.mlp.down_proj.weight")
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelFileError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        load_backend(str(model_dir), settings=CPU)
    weights["model.layers.1.mlp.down_proj.weight"] = weights[
        "model.layers.0.mlp.down_proj.weight"
    ].clone()
    weights["model.layers.0.mlp.extra.weight"] = weights["model.norm.weight"].clone()
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelFileError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.extra"):
        load_backend(str(model_dir), settings=CPU)


def test_gguf_reader_agrees_with_gguf_py(tiny):
    from gguf import GGUFReader

    path = tiny.gguf("phi3", Q.Q8_0)
    ours, theirs = GGUFFile(path), GGUFReader(path)
    assert set(ours.tensors) == {t.name for t in theirs.tensors}
    for tensor in theirs.tensors:
        info = ours.tensors[tensor.name]
        assert info.qtype == tensor.tensor_type
        assert info.shape == tuple(reversed([int(d) for d in tensor.shape]))
        assert ours.raw(tensor.name).numpy().tobytes() == tensor.data.tobytes()
    for key, field in theirs.fields.items():
        if not key.startswith("GGUF."):
            assert _plain(ours.metadata[key]) == pytest.approx(field.contents()), key


def _plain(value):
    return value.tolist() if hasattr(value, "tolist") else value
