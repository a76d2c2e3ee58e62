"""Every bad model file is a clear error.

Explicit regressions for the cases that used to crash natively, raise raw exceptions or
load silently; then property-based mutations of a tiny GGUF and a tiny safetensors
directory, each loaded in a worker process (a native crash is a failed test, not a dead
run): a file either loads and generates, or raises an SpnlError, never anything else.
"""

import math
import random
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from helpers import CPU
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from model_file_mutations import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    BAD_CONFIG_VALUES,
    BAD_JSON_TEXTS,
    CONFIG_KEYS,
    EXTREME_INTEGERS,
    F16_NAN,
    INDEX,
    INTEGER_RANGES,
    INTEGER_TYPES,
    RETYPED_VALUES,
    ROPE_KEYS,
    SAFETENSORS,
    SAFETENSORS_DTYPES,
    GGUFParts,
    LoadWorker,
    flipped,
    header_size,
    integer_keys,
    join_safetensors,
    parse_gguf,
    poisoned,
    poisoned_tensor,
    random_adapter_case,
    random_gguf_case,
    read_dir,
    retyped,
    same_value_other_width,
    section_boundaries,
    sharded,
    shifted_offset,
    split_safetensors,
    tensor_names,
    with_config,
    with_file,
    with_header_field,
    with_rope_parameter,
    with_tensor_field,
    with_value,
    without_key,
    write_dir,
    write_gguf_bytes,
)
from tiny_models import write_adapter, write_gguf_adapter

from spnl_backend import ModelFileError, ModelNotFoundError, load_backend
from spnl_backend.loader.gguf_file import GGUFFile
from spnl_backend.quant.ggml import SCALE_OFFSETS, dequantize, ggml_format, nonfinite_scales

F32_NAN = struct.pack("<f", math.nan)


@pytest.fixture(scope="module")
def llama_gguf(tiny) -> GGUFParts:
    """Llama in Q8_0: quantized matrices, float norms, a rope_freqs tensor."""
    return parse_gguf(tiny.gguf("llama", Q.Q8_0).read_bytes())


@pytest.fixture(scope="module")
def gemma_gguf(tiny) -> GGUFParts:
    """Gemma 3 in F32: a sliding-window pattern array, softcaps, tied embeddings."""
    return parse_gguf(tiny.gguf("gemma3", Q.F32).read_bytes())


@pytest.fixture(scope="module")
def text_models(tiny) -> dict[str, dict[str, bytes]]:
    return {arch: read_dir(tiny.hf(arch).path) for arch in ("llama", "qwen2", "phi3", "gemma3")}


class _Cases:
    """Numbered places to write mutated files to: each case a new path, so no cached
    tokenizer conversion (keyed by path, size and time) is ever reused."""

    def __init__(self, root: Path) -> None:
        self.root, self.count = root, 0

    def gguf(self, parts: GGUFParts | bytes) -> Path:
        self.count += 1
        path = self.root / f"case-{self.count}.gguf"
        path.write_bytes(parts if isinstance(parts, bytes) else write_gguf_bytes(parts))
        return path

    def text(self, files: dict[str, bytes]) -> Path:
        self.count += 1
        return write_dir(files, self.root / f"case-{self.count}")


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> _Cases:
    return _Cases(tmp_path_factory.mktemp("model-files"))


def _refused(path: Path, *fragments: str) -> str:
    """Loading ``path`` raises a ModelFileError naming the file and each fragment."""
    with pytest.raises(ModelFileError) as caught:
        load_backend(str(path), settings=CPU)
    message = str(caught.value)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message, message
    return message


def _loads(path: Path) -> None:
    with load_backend(str(path), settings=CPU) as backend:
        assert len(backend.generate("The quick", max_tokens=3, temperature=0).token_ids) == 3


# ---- GGUF metadata --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["string", "float32", "bool", "int_array", "empty_array"])
def test_wrong_typed_integer_key(llama_gguf, cases, kind):
    path = cases.gguf(retyped(llama_gguf, "llama.attention.head_count", kind))
    _refused(path, "'llama.attention.head_count'", "expected a positive integer")


@pytest.mark.parametrize("kind", ["string", "bool", "int_array"])
def test_wrong_typed_float_key(llama_gguf, cases, kind):
    path = cases.gguf(retyped(llama_gguf, "llama.attention.layer_norm_rms_epsilon", kind))
    _refused(path, "layer_norm_rms_epsilon", "expected a finite number > 0")


def test_any_integer_width_and_any_number_type_is_accepted(llama_gguf, cases):
    parts = llama_gguf
    for key, vtype in zip(integer_keys(parts), INTEGER_TYPES * 3, strict=False):
        low, high = INTEGER_RANGES[vtype]
        fits = low <= parts.entry(key).value <= high
        parts = same_value_other_width(parts, key, vtype if fits else V.INT64)
    parts = with_value(parts, "llama.rope.freq_base", V.UINT32, 10000)
    parts = with_value(parts, "llama.attention.layer_norm_rms_epsilon", V.FLOAT64, 1e-6)
    _loads(cases.gguf(parts))


@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [
        ("llama.attention.head_count", 0, "expected a positive integer"),
        ("llama.attention.head_count_kv", -1, "expected a positive integer"),
        ("llama.attention.head_count_kv", 3, "a divisor of the number of attention heads (4)"),
        ("llama.embedding_length", 0, "expected a positive integer"),
        ("llama.block_count", 2**31 - 1, "tensors for 3 blocks"),
        ("llama.feed_forward_length", 0, "expected a positive integer"),
        ("llama.context_length", 0, "expected a positive integer"),
        ("llama.attention.key_length", 0, "expected a positive integer"),
        ("llama.attention.value_length", 8, "the key length (16)"),
        ("tokenizer.ggml.bos_token_id", 320, "within the vocabulary (0 to 319)"),
        ("tokenizer.ggml.eos_token_id", 2**32 - 1, "within the vocabulary (0 to 319)"),
        ("tokenizer.ggml.padding_token_id", 1000, "within the vocabulary (0 to 319)"),
        ("llama.rope.dimension_count", 32, "from 2 to the head's 16"),
        ("llama.rope.dimension_count", 7, "an even number"),
    ],
)
def test_integer_out_of_range(llama_gguf, cases, key, value, fragment):
    vtype = V.INT64 if value < 0 or value >= 2**32 else V.UINT32
    _refused(cases.gguf(with_value(llama_gguf, key, vtype, value)), repr(key), fragment)


@pytest.mark.parametrize("value", [0.0, -1e-6, math.nan, math.inf])
def test_epsilon_and_rope_base_out_of_range(llama_gguf, cases, value):
    for key in ("llama.attention.layer_norm_rms_epsilon", "llama.rope.freq_base"):
        path = cases.gguf(with_value(llama_gguf, key, V.FLOAT32, value))
        _refused(path, repr(key), "expected a finite number > 0")


@pytest.mark.parametrize("alignment", [0, 3, 48])
def test_alignment_must_be_a_power_of_two(llama_gguf, cases, alignment):
    parts = with_value(llama_gguf, "general.alignment", V.UINT32, alignment)
    _refused(cases.gguf(parts), "'general.alignment'", "expected a power of two")


def test_tokenizer_arrays_of_inconsistent_lengths(llama_gguf, cases):
    types = llama_gguf.entry("tokenizer.ggml.token_type")
    short = with_value(llama_gguf, types.key, V.ARRAY, types.value[:-1], types.item_type)
    _refused(cases.gguf(short), "'tokenizer.ggml.token_type'", "320 values, one per token")
    tokens = llama_gguf.entry("tokenizer.ggml.tokens")
    fewer = with_value(llama_gguf, tokens.key, V.ARRAY, tokens.value[:-1], V.STRING)
    _refused(cases.gguf(fewer), "lists 319 tokens", "one per row of tensor 'token_embd.weight'")


@pytest.mark.parametrize("index", [0, 5, -1])
def test_vocabulary_string_that_is_not_utf8(llama_gguf, cases, index):
    tokens = llama_gguf.entry("tokenizer.ggml.tokens")
    value = list(tokens.value)
    value[index] = b"ab\xff"
    parts = with_value(llama_gguf, tokens.key, V.ARRAY, value, V.STRING)
    raw = write_gguf_bytes(parts)
    at = raw.index(struct.pack("<Q", 3) + b"ab\xff") + 8  # where the bad string starts
    _refused(cases.gguf(raw), f"the metadata string at byte {at:,} is not UTF-8", "corrupt")


@pytest.mark.parametrize("depth", [17, 400])
def test_arrays_nested_too_deep(cases, depth):
    """Arrays of arrays, one inside the next, past what any writer makes: refused by name,
    not by the interpreter's recursion limit (400 deep raised a RecursionError)."""

    def string(text: str) -> bytes:
        return struct.pack("<Q", len(text)) + text.encode()

    array, string_type = 9, 8
    nested = struct.pack("<IQ", array, 1) * depth + struct.pack("<IQ", string_type, 0)
    entry = string("general.nested") + struct.pack("<I", array) + nested
    raw = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + entry
    _refused(cases.gguf(raw), "truncated or corrupt GGUF header", "arrays nested more than 16")


def test_vocabulary_string_longer_than_the_file(llama_gguf, cases):
    """A string length in the vocabulary that runs past the end of the file."""
    raw = write_gguf_bytes(llama_gguf)
    token = llama_gguf.entry("tokenizer.ggml.tokens").value[7].encode()
    at = raw.index(struct.pack("<Q", len(token)) + token)
    lying = raw[:at] + struct.pack("<Q", len(raw)) + raw[at + 8 :]
    _refused(cases.gguf(lying), "truncated or corrupt GGUF header")


def test_sliding_window_and_its_pattern(gemma_gguf, cases):
    window = with_value(gemma_gguf, "gemma3.attention.sliding_window", V.INT32, 0)
    _refused(cases.gguf(window), "'gemma3.attention.sliding_window'", "positive integer")
    key = "gemma3.attention.sliding_window_pattern"
    short = with_value(gemma_gguf, key, V.ARRAY, [True, False], V.BOOL)
    _refused(cases.gguf(short), repr(key), "3 bools")
    _refused(cases.gguf(with_value(gemma_gguf, key, V.UINT32, 0)), repr(key), "positive integer")


def test_missing_required_key(llama_gguf, cases):
    parts = without_key(llama_gguf, "llama.embedding_length")
    _refused(cases.gguf(parts), "'llama.embedding_length' is missing")
    # (only a model with experts in every block may leave out the dense MLP's size)
    parts = without_key(llama_gguf, "llama.feed_forward_length")
    _refused(cases.gguf(parts), "'llama.feed_forward_length' is missing")


# ---- GGUF tensor table ----------------------------------------------------------------------


def _index(parts: GGUFParts, name: str) -> int:
    return next(i for i, t in enumerate(parts.tensors) if t.name == name)


def test_misaligned_offset(llama_gguf, cases):
    parts = shifted_offset(llama_gguf, _index(llama_gguf, "blk.1.attn_q.weight"), 4)
    _refused(cases.gguf(parts), "'blk.1.attn_q.weight'", "not a multiple of the file's alignment")


def test_overlapping_tensors(llama_gguf, cases):
    i = _index(llama_gguf, "blk.1.attn_k.weight")
    parts = with_tensor_field(llama_gguf, i, offset=llama_gguf.tensors[i - 1].offset)
    _refused(cases.gguf(parts), "'blk.1.attn_k.weight'", "the tensors overlap")


def test_gap_between_tensors(llama_gguf, cases):
    parts = shifted_offset(llama_gguf, _index(llama_gguf, "blk.1.attn_k.weight"), 32)
    _refused(cases.gguf(parts), "'blk.1.attn_q.weight'", "does not describe the data")


def test_a_tensors_type_changed(llama_gguf, gemma_gguf, cases):
    parts = with_tensor_field(llama_gguf, _index(llama_gguf, "output.weight"), type_id=Q.Q4_0)
    _refused(cases.gguf(parts), "'output.weight' (Q4_0", "does not describe the data")
    last = len(gemma_gguf.tensors) - 1  # no tensor after it: the bytes left over tell
    parts = with_tensor_field(gemma_gguf, last, type_id=Q.F16)
    _refused(cases.gguf(parts), "follow the last tensor", "'output_norm.weight' (F16")


@pytest.mark.parametrize(
    ("dims", "fragment"),
    [
        ([2**32, 2**32], "more than ggml can count"),  # np.prod wraps this to 0
        ([2**40, 2**40], "more than ggml can count"),
        ([64, 0], "every dimension must be >= 1"),
        ([2**64 - 1], "more than ggml can count"),
    ],
)
def test_overflowing_or_empty_shape(llama_gguf, cases, dims, fragment):
    parts = with_tensor_field(llama_gguf, _index(llama_gguf, "blk.0.attn_q.weight"), dims=dims)
    _refused(cases.gguf(parts), "'blk.0.attn_q.weight'", fragment)


def test_duplicate_and_unknown_tensor_names(llama_gguf, cases):
    parts = with_tensor_field(llama_gguf, 2, name=llama_gguf.tensors[1].name)
    _refused(cases.gguf(parts), "appears twice")
    parts = with_tensor_field(llama_gguf, 2, name="blk.0.attn_zz.weight")
    _refused(cases.gguf(parts), "'blk.0.attn_zz.weight' is not a tensor of a GGUF llama model")


def test_matrix_stored_with_three_dimensions(llama_gguf, cases):
    i = _index(llama_gguf, "blk.1.ffn_up.weight")
    parts = with_tensor_field(llama_gguf, i, dims=[*llama_gguf.tensors[i].dims, 1])
    _refused(cases.gguf(parts), "'model.layers.1.mlp.up_proj.weight' has shape (1, 128, 64)")


def test_shape_disagrees_with_the_config(llama_gguf, cases):
    parts = with_value(llama_gguf, "llama.feed_forward_length", V.UINT32, 2**31 - 1)
    _refused(cases.gguf(parts), "'model.layers.0.mlp.down_proj.weight' has shape (64, 128)")


def test_unsupported_tensor_type(llama_gguf, cases):
    parts = with_tensor_field(llama_gguf, 1, type_id=99)
    _refused(cases.gguf(parts), "unknown type id 99", "not supported")


# ---- non-finite weights ---------------------------------------------------------------------


def test_nan_in_gguf_float_tensor(llama_gguf, cases):
    parts = poisoned(llama_gguf, "blk.1.attn_norm.weight", F32_NAN, count=3)
    _refused(cases.gguf(parts), "'blk.1.attn_norm.weight'", "3 non-finite values")


@pytest.mark.parametrize("scale", [F16_NAN, b"\x00\x7c", b"\x00\xfc"], ids=["nan", "inf", "-inf"])
def test_nonfinite_scale_in_gguf_blocks(llama_gguf, cases, scale):
    parts = poisoned(llama_gguf, "blk.2.ffn_down.weight", scale, count=2)
    _refused(cases.gguf(parts), "'blk.2.ffn_down.weight'", "2 non-finite Q8_0 block scales")


def test_nan_in_safetensors(text_models, cases):
    files = poisoned_tensor(text_models["llama"], "model.layers.1.mlp.up_proj.weight", math.nan, 3)
    message = _refused(cases.text(files), "'model.layers.1.mlp.up_proj.weight'")
    assert "3 non-finite values" in message
    assert SAFETENSORS in message  # the file, not only the directory


def test_inf_in_safetensors_norm(text_models, cases):
    files = poisoned_tensor(text_models["qwen2"], "model.norm.weight", -math.inf)
    _refused(cases.text(files), "'model.norm.weight'", "1 non-finite values")


# ---- safetensors directories ----------------------------------------------------------------


@pytest.mark.parametrize("text", BAD_JSON_TEXTS)
def test_config_json_not_an_object(text_models, cases, text):
    path = cases.text({**text_models["llama"], "config.json": text})
    _refused(path, "config.json")


@pytest.mark.parametrize(
    ("arch", "key", "value", "fragment"),
    [
        ("llama", "hidden_size", None, "'hidden_size' is missing"),
        ("llama", "num_attention_heads", "4", "expected a positive integer"),
        ("llama", "num_attention_heads", 0, "expected a positive integer"),
        ("llama", "num_key_value_heads", 3, "a divisor of the number of attention heads (4)"),
        ("llama", "intermediate_size", -1, "expected a positive integer"),
        ("llama", "vocab_size", 1.5, "expected a positive integer"),
        ("llama", "num_hidden_layers", 10**9, "tensors for 3 layers"),
        ("llama", "rms_norm_eps", 0, "expected a finite number > 0"),
        ("llama", "bos_token_id", 320, "within the vocabulary (0 to 319)"),
        ("llama", "eos_token_id", [1, -1], "within the vocabulary (0 to 319)"),
        ("llama", "sliding_window", 0, "positive integer"),
        ("llama", "dtype", "int8", "floating-point dtype"),
        ("qwen2", "num_attention_heads", 6, "head size is unknown"),
        ("gemma3", "layer_types", ["full_attention"], "3 of 'full_attention'"),
        ("gemma3", "layer_types", ["x", "y", "z"], "3 of 'full_attention'"),
        ("gemma3", "query_pre_attn_scalar", 0, "expected a finite number > 0"),
        ("llama", "model_type", ["llama"], "a string naming the architecture"),
    ],
)
def test_config_json_values(text_models, cases, arch, key, value, fragment):
    _refused(cases.text(with_config(text_models[arch], key, value)), repr(key), fragment)


@pytest.mark.parametrize(
    ("arch", "key", "value", "fragment"),
    [
        ("llama", "partial_rotary_factor", 3, "from 2 to the head's 16"),
        ("llama", "rope_theta", -1, "expected a finite number > 0"),
        ("llama", "factor", 0, "expected a finite number > 0"),
        ("llama", "high_freq_factor", 0.5, "at least the low frequency factor"),
        ("phi3", "long_factor", [1.0], "long_factor field must have length 4"),
        ("phi3", "short_factor", "x", "must be a list of numbers"),
        ("qwen2", "original_max_position_embeddings", 0, "positive integer"),
    ],
)
def test_rope_parameters(text_models, cases, arch, key, value, fragment):
    path = cases.text(with_rope_parameter(text_models[arch], key, value))
    _refused(path, "config.json", fragment)


def test_broken_shard_index(text_models, cases):
    split = sharded(text_models["llama"])
    _refused(cases.text({**split, INDEX: b"{"}), INDEX, "not valid JSON")
    _refused(cases.text({**split, INDEX: b'{"weight_map": [1]}'}), INDEX, "'weight_map'")
    missing = with_file(split, "model-00002-of-00002.safetensors", None)
    _refused(cases.text(missing), "model-00002-of-00002.safetensors", "not in the directory")


def test_sharded_model_loads(text_models, cases):
    _loads(cases.text(sharded(text_models["llama"])))


def test_safetensors_header_lies(text_models, cases):
    files = text_models["llama"]
    name = "model.layers.0.mlp.up_proj.weight"
    as_int = with_header_field(files, name, "dtype", "I32")  # same size: only the type lies
    _refused(cases.text(as_int), repr(name), "stored as int32; expected a floating-point type")
    header, _ = split_safetensors(files[SAFETENSORS])
    start, end = header[name]["data_offsets"]
    moved = with_header_field(files, name, "data_offsets", [start + 4, end + 4])
    _refused(cases.text(moved), SAFETENSORS, "corrupt safetensors")
    corrupt = {**files, SAFETENSORS: flipped(files[SAFETENSORS], [(8, ord("x"))])}
    _refused(cases.text(corrupt), SAFETENSORS, "corrupt safetensors")


def test_unreadable_safetensors_file_is_not_reported_missing(text_models, cases, monkeypatch):
    """Permission denied, as root sees it too: the OS's reason, never "not found"."""
    path = cases.text(text_models["llama"])
    weights = path / SAFETENSORS
    real_open = Path.open

    def denied(self, *args, **kwargs):
        if self == weights:
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", denied)
    message = _refused(path, str(weights), "cannot be read: Permission denied")
    assert "No such file" not in message


@pytest.mark.skipif(not hasattr(__import__("os"), "geteuid"), reason="POSIX permissions")
def test_unreadable_files_by_permission(text_models, cases, tiny, tmp_path):
    import os

    if os.geteuid() == 0:
        pytest.skip("root reads every file")
    path = cases.text(text_models["llama"])
    (path / SAFETENSORS).chmod(0)
    _refused(path, "cannot be read: Permission denied")
    gguf = shutil.copy(tiny.gguf("llama", Q.Q8_0), tmp_path / "denied.gguf")
    Path(gguf).chmod(0)
    with pytest.raises(ModelFileError, match="Permission denied"):
        load_backend(str(gguf), settings=CPU)


def test_safetensors_path_that_is_a_directory(text_models, cases):
    path = cases.text(with_file(text_models["llama"], SAFETENSORS, None))
    (path / SAFETENSORS).mkdir()
    with pytest.raises(ModelFileError, match="cannot be read: Is a directory") as caught:
        load_backend(str(path), settings=CPU)
    assert not isinstance(caught.value, ModelNotFoundError)


def test_broken_tokenizer_and_generation_config(text_models, cases):
    files = text_models["llama"]
    _refused(cases.text({**files, "tokenizer.json": b"{"}), "cannot load the tokenizer")
    bad = {**files, "generation_config.json": b'{"eos_token_id": [1, 999]}'}
    _refused(cases.text(bad), "generation_config.json", "'eos_token_id'")


# ---- files that used to crash natively, in a worker -----------------------------------------


@pytest.fixture(scope="module")
def worker():
    with LoadWorker(timeout_s=120) as running:
        yield running


def test_formerly_crashing_files_are_refused_in_a_worker(llama_gguf, text_models, cases, worker):
    """A rotary width past the head size made the native rope kernel read out of bounds
    (a segfault at the first token; an abort for the text model)."""
    gguf = cases.gguf(with_value(llama_gguf, "llama.rope.dimension_count", V.UINT32, 32))
    text = cases.text(with_rope_parameter(text_models["llama"], "partial_rotary_factor", 3))
    for path in (gguf, text):
        outcome = worker.run(path)
        assert outcome.kind == "refused", outcome.describe()
        assert outcome.error_type == "ModelFileError"


def test_worker_reports_a_crash_and_recovers(tiny, tmp_path):
    """The fuzzing's safety net: a segfault is an outcome, and the next case runs."""
    with LoadWorker(timeout_s=120) as running:
        crashed = running.run(tmp_path / "crash.segfault")
        assert crashed.kind == "crash"
        assert "-11" in crashed.error_type  # SIGSEGV
        assert running.run(tiny.gguf("llama", Q.Q8_0)).kind == "loaded"


# ---- property-based mutations ---------------------------------------------------------------

FUZZ = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def _check(worker: LoadWorker, path: Path, label: str) -> str:
    outcome = worker.run(path)
    assert outcome.ok, f"{label}: {outcome.describe()}"
    return outcome.kind


@FUZZ
@given(data=st.data())
def test_truncated_gguf(llama_gguf, cases, worker, data):
    raw = write_gguf_bytes(llama_gguf)
    at = data.draw(st.sampled_from(section_boundaries(llama_gguf)) | st.integers(0, len(raw) - 1))
    assert _check(worker, cases.gguf(raw[:at]), f"cut at {at}") == "refused"


@FUZZ
@given(data=st.data())
def test_retyped_gguf_metadata(llama_gguf, gemma_gguf, cases, worker, data):
    parts = data.draw(st.sampled_from([llama_gguf, gemma_gguf]))
    key = data.draw(st.sampled_from([e.key for e in parts.entries]))
    kind = data.draw(st.sampled_from(sorted(RETYPED_VALUES)))
    _check(worker, cases.gguf(retyped(parts, key, kind)), f"{key} as {kind}")


@FUZZ
@given(data=st.data())
def test_extreme_gguf_integers(llama_gguf, gemma_gguf, cases, worker, data):
    parts = data.draw(st.sampled_from([llama_gguf, gemma_gguf]))
    key = data.draw(st.sampled_from(integer_keys(parts)))
    vtype, value = data.draw(st.sampled_from(EXTREME_INTEGERS))
    _check(worker, cases.gguf(with_value(parts, key, vtype, value)), f"{key} = {value}")


@FUZZ
@given(data=st.data())
def test_gguf_tensor_table(llama_gguf, cases, worker, data):
    """A moved tensor is always refused; a retyped or reshaped one loads only where the
    bytes still fit (and then generates)."""
    index = data.draw(st.integers(0, len(llama_gguf.tensors) - 1))
    change = data.draw(st.sampled_from(["offset", "type", "dims"]))
    if change == "offset":
        delta = data.draw(st.sampled_from([-32, -1, 1, 2, 16, 32, 64, 2**40]))
        parts = shifted_offset(llama_gguf, index, delta)
        moved = parts.tensors[index].offset != llama_gguf.tensors[index].offset
        kind = _check(worker, cases.gguf(parts), f"tensor {index} offset {delta:+}")
        assert kind == "refused" or not moved
        return
    if change == "type":
        type_id = data.draw(st.sampled_from([t.value for t in Q] + [4, 99, 2**31]))
        parts = with_tensor_field(llama_gguf, index, type_id=type_id)
    else:
        dims = data.draw(st.lists(st.sampled_from([0, 1, 8, 64, 2**32, 2**63]), max_size=4))
        parts = with_tensor_field(llama_gguf, index, dims=dims or [1])
    _check(worker, cases.gguf(parts), f"tensor {index} {change}")


@FUZZ
@given(flips=st.lists(st.tuples(st.integers(0, 2**20), st.integers(0, 255)), max_size=8))
def test_gguf_header_byte_flips(llama_gguf, cases, worker, flips):
    end = header_size(llama_gguf)
    flips = [(pos % end, byte) for pos, byte in flips]
    _check(worker, cases.gguf(flipped(write_gguf_bytes(llama_gguf), flips)), f"{flips}")


@FUZZ
@given(data=st.data())
def test_config_json_mutations(text_models, cases, worker, data):
    arch = data.draw(st.sampled_from(sorted(text_models)))
    value = data.draw(st.sampled_from(BAD_CONFIG_VALUES))
    if data.draw(st.booleans()):
        key = data.draw(st.sampled_from(CONFIG_KEYS))
        files = with_config(text_models[arch], key, value)
    else:
        key = data.draw(st.sampled_from(ROPE_KEYS))
        files = with_rope_parameter(text_models[arch], key, value)
    _check(worker, cases.text(files), f"{arch} {key} = {value!r}")


@FUZZ
@given(data=st.data())
def test_safetensors_mutations(text_models, cases, worker, data):
    files = text_models[data.draw(st.sampled_from(sorted(text_models)))]
    raw = files[SAFETENSORS]
    change = data.draw(st.sampled_from(["cut", "flip", "dtype", "shape", "offsets"]))
    name = data.draw(st.sampled_from(tensor_names(files)))
    unchanged = False
    if change == "cut":
        files = {**files, SAFETENSORS: raw[: data.draw(st.integers(0, len(raw) - 1))]}
    elif change == "flip":
        (size,) = struct.unpack_from("<Q", raw)
        pos = data.draw(st.integers(0, 8 + size - 1))
        files = {**files, SAFETENSORS: flipped(raw, [(pos, data.draw(st.integers(0, 255)))])}
    elif change == "dtype":
        files = with_header_field(
            files, name, "dtype", data.draw(st.sampled_from(SAFETENSORS_DTYPES))
        )
    elif change == "shape":
        shape = data.draw(st.lists(st.sampled_from([0, 1, 3, 64, 2**40]), max_size=3))
        unchanged = shape == split_safetensors(raw)[0][name]["shape"]
        files = with_header_field(files, name, "shape", shape)
    else:
        start, end = split_safetensors(raw)[0][name]["data_offsets"]
        delta = data.draw(st.sampled_from([-8, -4, 4, 8, 2**40]))
        files = with_header_field(files, name, "data_offsets", [start, end + delta])
    kind = _check(worker, cases.text(files), f"{name} {change}")
    assert kind == "refused" or change in ("flip", "dtype") or unchanged


@pytest.mark.parametrize("qtype", list(SCALE_OFFSETS), ids=lambda t: t.name)
def test_nonfinite_scales_per_format(qtype):
    """The scale check against dequantization itself, for every GGML block format."""
    fmt = ggml_format(qtype)
    blocks = torch.randint(0, 256, (6, fmt.type_size), dtype=torch.uint8)
    for offset in SCALE_OFFSETS[qtype]:  # small finite scales (0x3000: 0.125)
        blocks[:, offset : offset + 2] = torch.tensor([0x00, 0x30], dtype=torch.uint8)
    assert nonfinite_scales(blocks, qtype) == 0
    assert torch.isfinite(dequantize(blocks.flatten(), qtype, (6, fmt.block_size))).all()
    d = SCALE_OFFSETS[qtype][0]
    blocks[2, d + 1] = 0x7E  # NaN
    blocks[4, SCALE_OFFSETS[qtype][-1] + 1] = 0xFC  # -inf
    assert nonfinite_scales(blocks, qtype) == 2
    assert not torch.isfinite(dequantize(blocks.flatten(), qtype, (6, fmt.block_size))[2]).all()


def test_default_model_is_packed_as_the_checks_expect():
    """The packing rule holds for the real model (GGUFFile refuses anything else)."""
    from spnl_backend.loader.default_model import default_model_path

    try:
        path = default_model_path()
    except Exception as exc:  # the default-model extra is optional
        pytest.skip(f"no default model: {exc}")
    gguf = GGUFFile(path)
    assert gguf.file_size - max(t.offset + t.nbytes for t in gguf.tensors.values()) < 32


# ---- LoRA adapter files --------------------------------------------------------------------


@pytest.fixture(scope="module")
def lora_base(tiny):
    """The tiny Llama (safetensors), one backend over it, and its adapter "one"'s files
    as PEFT writes them and as a GGUF adapter in llama.cpp's layout."""
    model = tiny.hf("llama")
    root = model.path.parent / "adapter-files"
    pairs = write_adapter(root / "peft", model.hf, seed=1)
    gguf = write_gguf_adapter(root / "one.gguf", "llama", pairs, alpha=8.0)
    backend = load_backend(str(model.path), settings=CPU)
    yield model, backend, read_dir(root / "peft"), parse_gguf(gguf.read_bytes()), pairs
    backend.close()


def _adapter_refused(backend, path: Path, *fragments: str, file: str = "") -> str:
    """Loading the adapter at ``path`` raises a ModelFileError naming the file (``file``
    in a PEFT directory) and each fragment; the backend goes on without it."""
    with pytest.raises(ModelFileError) as caught:
        backend.load_adapter("bad", str(path))
    message = str(caught.value)
    assert str(path / file if file else path) in message, message
    for fragment in fragments:
        assert fragment in message, message
    assert [a.name for a in backend.adapters()] == []
    return message


def _gguf_adapter(cases: _Cases, pairs: dict, change: Callable[[dict], dict], **meta) -> Path:
    """A GGUF adapter of ``change(pairs)`` (``meta``: its alpha, or another architecture)."""
    cases.count += 1
    path = cases.root / f"case-{cases.count}.gguf"
    return write_gguf_adapter(
        path, meta.get("arch", "llama"), change(dict(pairs)), **{"alpha": meta.get("alpha", 8.0)}
    )


V_PROJ = "model.layers.1.self_attn.v_proj"


def test_truncated_adapter_files(lora_base, cases):
    _, backend, peft, gguf, _ = lora_base
    raw = peft[ADAPTER_WEIGHTS]
    for cut in (0, 12, len(raw) // 2, len(raw) - 1):
        path = cases.text({**peft, ADAPTER_WEIGHTS: raw[:cut]})
        _adapter_refused(backend, path, "safetensors", file=ADAPTER_WEIGHTS)
    whole = write_gguf_bytes(gguf)
    for cut in (4, header_size(gguf) // 2, len(whole) - 1):
        _adapter_refused(backend, cases.gguf(whole[:cut]))


def test_adapter_tensor_of_the_wrong_shape(lora_base, cases):
    _, backend, peft, _, pairs = lora_base
    name = f"base_model.model.{V_PROJ}.lora_B.weight"
    header, _ = split_safetensors(peft[ADAPTER_WEIGHTS])
    rows, rank = header[name]["shape"]
    files = with_header_field(peft, name, "shape", [rank, rows], ADAPTER_WEIGHTS)
    _adapter_refused(backend, cases.text(files), name, "has shape", file=ADAPTER_WEIGHTS)
    wide = _gguf_adapter(cases, pairs, lambda p: {**p, V_PROJ: (p[V_PROJ][0], torch.ones(40, 4))})
    _adapter_refused(backend, wide, "blk.1.attn_v.weight.lora_b", "has shape (40, 4)")
    q_proj = "model.layers.0.self_attn.q_proj"
    odd = _gguf_adapter(cases, pairs, lambda p: {**p, q_proj: (p[q_proj][0], torch.ones(8, 4))})
    _adapter_refused(backend, odd, "blk.0.attn_q.weight.lora_b", "64 rows")


def test_adapter_rank_zero(lora_base, cases):
    _, backend, peft, _, pairs = lora_base
    files = with_config(peft, "r", 0, ADAPTER_CONFIG)
    _adapter_refused(backend, cases.text(files), "r = 0", ">= 1", file=ADAPTER_CONFIG)
    empty = (torch.ones(0, 64), torch.ones(32, 0))
    zero = _gguf_adapter(cases, pairs, lambda p: {**p, V_PROJ: empty})
    _adapter_refused(backend, zero, "blk.1.attn_v.weight")


def test_adapter_nan_alpha(lora_base, cases):
    _, backend, peft, _, pairs = lora_base
    files = with_config(peft, "lora_alpha", math.nan, ADAPTER_CONFIG)
    _adapter_refused(backend, cases.text(files), "lora_alpha = nan", file=ADAPTER_CONFIG)
    for alpha in (math.nan, math.inf):
        path = _gguf_adapter(cases, pairs, lambda p: p, alpha=alpha)
        _adapter_refused(backend, path, f"adapter.lora.alpha = {alpha}", "finite")


def test_adapter_of_unknown_modules_or_another_base(lora_base, cases):
    _, backend, peft, gguf, pairs = lora_base
    embed = _gguf_adapter(
        cases, pairs, lambda p: {"model.embed_tokens": (torch.ones(4, 64), torch.ones(96, 4))}
    )
    _adapter_refused(backend, embed, "token_embd.weight.lora_a", "not adapted here")
    norm = with_value(gguf, "general.type", V.STRING, "model")
    _adapter_refused(backend, cases.gguf(norm), "general.type is the string 'model'")
    other = with_value(gguf, "general.architecture", V.STRING, "gemma3")
    _adapter_refused(backend, cases.gguf(other), "'gemma3'", "another base model")
    header, data = split_safetensors(peft[ADAPTER_WEIGHTS])
    for side in "AB":  # layer 1's v_proj as a layer 7 the base model does not have
        name = f"base_model.model.{V_PROJ}.lora_{side}.weight"
        header[name.replace(".layers.1.", ".layers.7.")] = header.pop(name)
    files = {**peft, ADAPTER_WEIGHTS: join_safetensors(header, data)}
    _adapter_refused(backend, cases.text(files), "layers.7", "another base", file=ADAPTER_WEIGHTS)


def test_dora_is_refused(lora_base, cases):
    _, backend, peft, _, _ = lora_base
    files = with_config(peft, "use_dora", True, ADAPTER_CONFIG)
    _adapter_refused(backend, cases.text(files), "use_dora = True", file=ADAPTER_CONFIG)
    header, data = split_safetensors(peft[ADAPTER_WEIGHTS])
    name = f"base_model.model.{V_PROJ}.lora_A.weight"
    magnitude = f"base_model.model.{V_PROJ}.lora_magnitude_vector"
    header[magnitude] = header.pop(name)
    files = {**peft, ADAPTER_WEIGHTS: join_safetensors(header, data)}
    _adapter_refused(backend, cases.text(files), magnitude, "DoRA", file=ADAPTER_WEIGHTS)


@FUZZ
@given(data=st.data())
def test_peft_adapter_mutations(lora_base, cases, worker, data):
    model, _, peft, _, _ = lora_base
    label, files = random_adapter_case(peft, random.Random(data.draw(st.integers(0, 2**32))))
    outcome = worker.run(cases.text(files), base=model.path)
    assert outcome.ok, f"{label}: {outcome.describe()}"


@FUZZ
@given(data=st.data())
def test_gguf_adapter_mutations(lora_base, cases, worker, data):
    model, _, _, gguf, _ = lora_base
    label, raw = random_gguf_case(gguf, random.Random(data.draw(st.integers(0, 2**32))))
    outcome = worker.run(cases.gguf(raw), base=model.path)
    assert outcome.ok, f"{label}: {outcome.describe()}"
