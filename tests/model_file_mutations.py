"""Mutated model files, and a worker process that loads them so a crash cannot take the
caller down: shared by tests/test_model_files.py and bench/fuzz_model_files.py.

A GGUF is parsed into its parts (metadata entries with their value types, tensor infos,
the data section) and written back after a mutation, so a mutation can retype a value or
move a tensor without redoing the rest by hand. A text model is a dict of file name →
bytes; its safetensors header is edited the same way.
"""

import copy
import ctypes
import json
import math
import os
import random
import selectors
import struct
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf import GGUF_MAGIC, GGMLQuantizationType, GGUFValueType

V = GGUFValueType
_FORMATS = {
    V.UINT8: "<B",
    V.INT8: "<b",
    V.UINT16: "<H",
    V.INT16: "<h",
    V.UINT32: "<I",
    V.INT32: "<i",
    V.FLOAT32: "<f",
    V.BOOL: "<?",
    V.UINT64: "<Q",
    V.INT64: "<q",
    V.FLOAT64: "<d",
}
INTEGER_TYPES = (V.UINT8, V.INT8, V.UINT16, V.INT16, V.UINT32, V.INT32, V.UINT64, V.INT64)
INTEGER_RANGES = {
    V.UINT8: (0, 2**8 - 1),
    V.INT8: (-(2**7), 2**7 - 1),
    V.UINT16: (0, 2**16 - 1),
    V.INT16: (-(2**15), 2**15 - 1),
    V.UINT32: (0, 2**32 - 1),
    V.INT32: (-(2**31), 2**31 - 1),
    V.UINT64: (0, 2**64 - 1),
    V.INT64: (-(2**63), 2**63 - 1),
}
F16_NAN, F16_INF = b"\x00\x7e", b"\x00\x7c"

# ---- GGUF: parts, parsed and written back ---------------------------------------------------


@dataclass
class Entry:
    key: str
    vtype: V
    value: Any
    item_type: V | None = None  # arrays only


@dataclass
class TensorEntry:
    name: str
    dims: list[int]  # GGUF order: the contiguous dimension first
    type_id: int
    offset: int  # relative to the data section


@dataclass
class GGUFParts:
    version: int
    entries: list[Entry]
    tensors: list[TensorEntry]
    data: bytes
    padding: int = 32  # where the writer starts the data section, whatever the metadata says
    tensor_count: int | None = None  # written instead of len(tensors) when set
    kv_count: int | None = None

    def entry(self, key: str) -> Entry:
        return next(e for e in self.entries if e.key == key)

    def set(self, key: str, vtype: V, value: Any, item_type: V | None = None) -> None:
        """Replace (or add) one metadata entry."""
        new = Entry(key, vtype, value, item_type)
        for i, e in enumerate(self.entries):
            if e.key == key:
                self.entries[i] = new
                return
        self.entries.append(new)

    def tensor(self, name: str) -> TensorEntry:
        return next(t for t in self.tensors if t.name == name)

    def tensor_bytes(self, name: str) -> tuple[int, int]:
        """The tensor's span in ``data`` (start, end), by its type and shape."""
        info = self.tensor(name)
        block, size = _block_and_type_size(info.type_id)
        return info.offset, info.offset + math.prod(info.dims) // block * size


def _block_and_type_size(type_id: int) -> tuple[int, int]:
    # Imported here: the worker must set TRITON_INTERPRET before the library loads.
    from spnl_backend.quant.ggml import ggml_format

    fmt = ggml_format(GGMLQuantizationType(type_id))
    return fmt.block_size, fmt.type_size


class _Reader:
    def __init__(self, raw: bytes) -> None:
        self.raw, self.pos = raw, 0

    def scalar(self, vtype: V) -> Any:
        fmt = _FORMATS[vtype]
        (value,) = struct.unpack_from(fmt, self.raw, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        size = self.scalar(V.UINT64)
        self.pos += size
        return self.raw[self.pos - size : self.pos].decode()

    def value(self, vtype: V, item_type: V | None = None) -> Any:
        if vtype == V.STRING:
            return self.string()
        if vtype == V.ARRAY:
            return [self.value(item_type) for _ in range(self.scalar(V.UINT64))]
        return self.scalar(vtype)

    def entry(self) -> Entry:
        key, vtype = self.string(), V(self.scalar(V.UINT32))
        if vtype != V.ARRAY:
            return Entry(key, vtype, self.value(vtype))
        item_type = V(self.scalar(V.UINT32))
        return Entry(key, vtype, self.value(vtype, item_type), item_type)

    def tensor(self) -> TensorEntry:
        name = self.string()
        dims = [self.scalar(V.UINT64) for _ in range(self.scalar(V.UINT32))]
        return TensorEntry(name, dims, self.scalar(V.UINT32), self.scalar(V.UINT64))


def parse_gguf(raw: bytes) -> GGUFParts:
    reader = _Reader(raw)
    assert reader.scalar(V.UINT32) == GGUF_MAGIC
    version = reader.scalar(V.UINT32)
    tensor_count, kv_count = reader.scalar(V.UINT64), reader.scalar(V.UINT64)
    entries = [reader.entry() for _ in range(kv_count)]
    tensors = [reader.tensor() for _ in range(tensor_count)]
    alignment = next((e.value for e in entries if e.key == "general.alignment"), 32)
    start = _aligned(reader.pos, alignment)
    return GGUFParts(version, entries, tensors, raw[start:], alignment)


def _aligned(pos: int, alignment: int) -> int:
    return -(-pos // alignment) * alignment


def _pack(vtype: V, value: Any, item_type: V | None = None) -> bytes:
    if vtype == V.STRING:
        raw = value if isinstance(value, bytes) else value.encode()  # bytes: written as they are
        return struct.pack("<Q", len(raw)) + raw
    if vtype == V.ARRAY:
        items = b"".join(_pack(item_type, v) for v in value)
        return struct.pack("<IQ", item_type, len(value)) + items
    return struct.pack(_FORMATS[vtype], value)


def gguf_sections(parts: GGUFParts) -> list[bytes]:
    """The file as consecutive sections: preamble, each entry, each tensor info, padding,
    each tensor's data (with its padding); their joined bytes are the file."""
    tensor_count = len(parts.tensors) if parts.tensor_count is None else parts.tensor_count
    kv_count = len(parts.entries) if parts.kv_count is None else parts.kv_count
    sections = [struct.pack("<IIQQ", GGUF_MAGIC, parts.version, tensor_count, kv_count)]
    for e in parts.entries:
        sections.append(_pack(V.STRING, e.key) + struct.pack("<I", e.vtype))
        sections[-1] += _pack(e.vtype, e.value, e.item_type)
    for t in parts.tensors:
        info = _pack(V.STRING, t.name) + struct.pack("<I", len(t.dims))
        sections.append(info + struct.pack(f"<{len(t.dims)}QIQ", *t.dims, t.type_id, t.offset))
    header = sum(map(len, sections))
    sections.append(bytes(_aligned(header, parts.padding) - header))
    starts = sorted({t.offset for t in parts.tensors if t.offset < len(parts.data)} | {0})
    ends = [*starts[1:], len(parts.data)]
    sections += [parts.data[a:b] for a, b in zip(starts, ends, strict=True)]
    return sections


def write_gguf_bytes(parts: GGUFParts) -> bytes:
    return b"".join(gguf_sections(parts))


def section_boundaries(parts: GGUFParts) -> list[int]:
    """Every byte position where one section of the file ends and the next begins."""
    sizes = [len(s) for s in gguf_sections(parts)]
    return sorted({sum(sizes[:i]) for i in range(1, len(sizes))} | {4, 8, 16})


# ---- GGUF mutations ------------------------------------------------------------------------

# A value of every kind, for retyping a metadata key.
RETYPED_VALUES: dict[str, tuple[V, Any, V | None]] = {
    "string": (V.STRING, "7", None),
    "float32": (V.FLOAT32, 1.5, None),
    "float64": (V.FLOAT64, -2.0, None),
    "bool": (V.BOOL, True, None),
    "int_array": (V.ARRAY, [1, 2, 3], V.INT32),
    "string_array": (V.ARRAY, ["a"], V.STRING),
    "empty_array": (V.ARRAY, [], V.UINT8),
    "uint8": (V.UINT8, 1, None),
    "int64": (V.INT64, 3, None),
}
# Integers at the edges of every width GGUF has.
EXTREME_INTEGERS: tuple[tuple[V, int], ...] = (
    (V.INT32, 0),
    (V.INT32, -1),
    (V.INT8, -128),
    (V.UINT32, 2**32 - 1),
    (V.INT32, 2**31 - 1),
    (V.UINT64, 2**64 - 1),
    (V.INT64, 2**63 - 1),
    (V.INT64, -(2**63)),
    (V.UINT32, 3),
)
EXTREME_FLOATS: tuple[float, ...] = (0.0, -1.0, math.nan, math.inf, -math.inf, 1e38)


def retyped(parts: GGUFParts, key: str, kind: str) -> GGUFParts:
    mutated = copy.deepcopy(parts)
    mutated.set(key, *RETYPED_VALUES[kind])
    return mutated


def same_value_other_width(parts: GGUFParts, key: str, vtype: V) -> GGUFParts:
    """An integer key written with another integer type, its value unchanged."""
    mutated = copy.deepcopy(parts)
    mutated.set(key, vtype, mutated.entry(key).value)
    return mutated


def with_value(
    parts: GGUFParts, key: str, vtype: V, value: Any, item_type: V | None = None
) -> GGUFParts:
    mutated = copy.deepcopy(parts)
    mutated.set(key, vtype, value, item_type)
    return mutated


def without_key(parts: GGUFParts, key: str) -> GGUFParts:
    mutated = copy.deepcopy(parts)
    mutated.entries = [e for e in mutated.entries if e.key != key]
    return mutated


def shifted_offset(parts: GGUFParts, index: int, delta: int) -> GGUFParts:
    mutated = copy.deepcopy(parts)
    tensor = mutated.tensors[index]
    tensor.offset = max(0, tensor.offset + delta)
    return mutated


def with_tensor_field(parts: GGUFParts, index: int, **fields: Any) -> GGUFParts:
    """Tensor ``index`` with ``name``, ``dims``, ``type_id`` or ``offset`` replaced."""
    mutated = copy.deepcopy(parts)
    for name, value in fields.items():
        setattr(mutated.tensors[index], name, value)
    return mutated


def poisoned(parts: GGUFParts, name: str, value: bytes, count: int = 1) -> GGUFParts:
    """The first ``count`` elements (float tensors) or block scales d (quantized ones) of
    tensor ``name`` overwritten with ``value``."""
    from spnl_backend.quant.ggml import SCALE_OFFSETS  # see _block_and_type_size

    mutated = copy.deepcopy(parts)
    info = mutated.tensor(name)
    start, _ = mutated.tensor_bytes(name)
    block, size = _block_and_type_size(info.type_id)
    if block > 1:
        at, stride = SCALE_OFFSETS[GGMLQuantizationType(info.type_id)][0], size
    else:
        at, stride = 0, len(value)
    data = bytearray(mutated.data)
    for i in range(count):
        pos = start + i * stride + at
        data[pos : pos + len(value)] = value
    mutated.data = bytes(data)
    return mutated


def flipped(raw: bytes, flips: list[tuple[int, int]]) -> bytes:
    data = bytearray(raw)
    for pos, byte in flips:
        data[pos % len(data)] = byte
    return bytes(data)


def header_size(parts: GGUFParts) -> int:
    return sum(len(s) for s in gguf_sections(parts)[: 1 + len(parts.entries) + len(parts.tensors)])


def integer_keys(parts: GGUFParts) -> list[str]:
    return [e.key for e in parts.entries if e.vtype in INTEGER_TYPES]


def float_keys(parts: GGUFParts) -> list[str]:
    return [e.key for e in parts.entries if e.vtype in (V.FLOAT32, V.FLOAT64)]


# ---- text models: a directory as a dict of files -------------------------------------------

SAFETENSORS = "model.safetensors"
INDEX = "model.safetensors.index.json"
DELETE = object()  # a config value that removes the key


def read_dir(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


def write_dir(files: dict[str, bytes], path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (path / name).write_bytes(data)
    return path


def split_safetensors(raw: bytes) -> tuple[dict[str, Any], bytes]:
    (size,) = struct.unpack_from("<Q", raw)
    return json.loads(raw[8 : 8 + size]), raw[8 + size :]


def join_safetensors(header: dict[str, Any], data: bytes) -> bytes:
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def with_config(
    files: dict[str, bytes], key: str, value: Any, name: str = "config.json"
) -> dict[str, bytes]:
    config = json.loads(files[name])
    if value is DELETE:
        config.pop(key, None)
    else:
        config[key] = value
    return {**files, name: json.dumps(config).encode()}


def with_rope_parameter(files: dict[str, bytes], key: str, value: Any) -> dict[str, bytes]:
    """One rope parameter (of the full-attention layers, where they are given per layer
    type) set, or removed with `DELETE`."""
    config = json.loads(files["config.json"])
    params = config.get("rope_parameters") or {}
    target = params.get("full_attention", params)
    if value is DELETE:
        target.pop(key, None)
    else:
        target[key] = value
    return with_config(files, "rope_parameters", params)


def with_file(files: dict[str, bytes], name: str, data: bytes | None) -> dict[str, bytes]:
    """``name`` replaced by ``data`` (None: removed)."""
    changed = {k: v for k, v in files.items() if k != name}
    if data is not None:
        changed[name] = data
    return changed


def with_header_field(
    files: dict[str, bytes], tensor: str, name: str, value: Any, shard: str = SAFETENSORS
) -> dict[str, bytes]:
    """One tensor's ``dtype``, ``shape`` or ``data_offsets`` in a safetensors header."""
    header, data = split_safetensors(files[shard])
    header[tensor][name] = value
    return {**files, shard: join_safetensors(header, data)}


def tensor_names(files: dict[str, bytes], shard: str = SAFETENSORS) -> list[str]:
    header, _ = split_safetensors(files[shard])
    return sorted(name for name in header if name != "__metadata__")


def poisoned_tensor(
    files: dict[str, bytes], tensor: str, value: float, count: int = 1, shard: str = SAFETENSORS
) -> dict[str, bytes]:
    """The first ``count`` float32 values of ``tensor`` set to ``value``."""
    header, data = split_safetensors(files[shard])
    assert header[tensor]["dtype"] == "F32"
    start = header[tensor]["data_offsets"][0]
    patched = bytearray(data)
    patched[start : start + 4 * count] = struct.pack(f"<{count}f", *[value] * count)
    return {**files, shard: join_safetensors(header, bytes(patched))}


def sharded(files: dict[str, bytes]) -> dict[str, bytes]:
    """The weights split into two shards with an index, as large checkpoints are saved."""
    header, data = split_safetensors(files[SAFETENSORS])
    header.pop("__metadata__", None)
    names = sorted(header)
    halves = {"model-00001-of-00002.safetensors": names[::2]}
    halves["model-00002-of-00002.safetensors"] = names[1::2]
    out = {k: v for k, v in files.items() if k != SAFETENSORS}
    weight_map = {}
    for shard, shard_names in halves.items():
        shard_header, chunks, offset = {}, [], 0
        for name in shard_names:
            start, end = header[name]["data_offsets"]
            chunks.append(data[start:end])
            shard_header[name] = {**header[name], "data_offsets": [offset, offset + end - start]}
            offset += end - start
            weight_map[name] = shard
        out[shard] = join_safetensors(shard_header, b"".join(chunks))
    out[INDEX] = json.dumps({"metadata": {}, "weight_map": weight_map}).encode()
    return out


# ---- random cases, for the fuzz script --------------------------------------------------------

Case = tuple[str, bytes]  # a label and the GGUF file's bytes
TextCase = tuple[str, dict[str, bytes]]


def random_gguf_case(parts: GGUFParts, rng: random.Random) -> Case:
    kind = rng.choice(list(_GGUF_MUTATORS))
    label, mutated = _GGUF_MUTATORS[kind](parts, rng)
    return f"{kind}: {label}", mutated if isinstance(mutated, bytes) else write_gguf_bytes(mutated)


def _truncate_at_boundary(parts: GGUFParts, rng: random.Random) -> tuple[str, bytes]:
    at = rng.choice(section_boundaries(parts))
    return f"at byte {at}", write_gguf_bytes(parts)[:at]


def _truncate_anywhere(parts: GGUFParts, rng: random.Random) -> tuple[str, bytes]:
    raw = write_gguf_bytes(parts)
    at = rng.randrange(len(raw))
    return f"at byte {at}", raw[:at]


def _retype(parts: GGUFParts, rng: random.Random) -> tuple[str, GGUFParts]:
    key, kind = rng.choice([e.key for e in parts.entries]), rng.choice(list(RETYPED_VALUES))
    return f"{key} as {kind}", retyped(parts, key, kind)


def _rewiden(parts: GGUFParts, rng: random.Random) -> tuple[str, GGUFParts]:
    """An integer key in another width, its value kept: a file that must still load (when
    the value fits the width)."""
    key, vtype = rng.choice(integer_keys(parts)), rng.choice(INTEGER_TYPES)
    value = parts.entry(key).value
    lo, hi = INTEGER_RANGES[vtype]
    if not lo <= value <= hi:
        vtype = V.UINT64
    return f"{key} as {vtype.name}", same_value_other_width(parts, key, vtype)


def _extreme_integer(parts: GGUFParts, rng: random.Random) -> tuple[str, GGUFParts]:
    key, (vtype, value) = rng.choice(integer_keys(parts)), rng.choice(EXTREME_INTEGERS)
    return f"{key} = {value} ({vtype.name})", with_value(parts, key, vtype, value)


def _extreme_float(parts: GGUFParts, rng: random.Random) -> tuple[str, GGUFParts]:
    key, value = rng.choice(float_keys(parts)), rng.choice(EXTREME_FLOATS)
    return f"{key} = {value}", with_value(parts, key, V.FLOAT32, value)


def _drop_key(parts: GGUFParts, rng: random.Random) -> tuple[str, GGUFParts]:
    key = rng.choice([e.key for e in parts.entries])
    return f"without {key}", without_key(parts, key)


def _shift_offset(parts: GGUFParts, rng: random.Random) -> tuple[str, GGUFParts]:
    index = rng.randrange(len(parts.tensors))
    delta = rng.choice([-64, -32, -1, 1, 4, 16, 32, 1 << 20, 1 << 62])
    return f"{parts.tensors[index].name} offset {delta:+}", shifted_offset(parts, index, delta)


def _overlap(parts: GGUFParts, rng: random.Random) -> tuple[str, GGUFParts]:
    i, j = rng.sample(range(len(parts.tensors)), 2)
    offset = parts.tensors[j].offset
    return f"{parts.tensors[i].name} at {parts.tensors[j].name}'s offset", with_tensor_field(
        parts, i, offset=offset
    )


def _swap_type(parts: GGUFParts, rng: random.Random) -> tuple[str, GGUFParts]:
    index = rng.randrange(len(parts.tensors))
    type_id = rng.choice([*(t.value for t in GGMLQuantizationType), 4, 5, 99, 2**31])
    return f"{parts.tensors[index].name} type {type_id}", with_tensor_field(
        parts, index, type_id=type_id
    )


def _bad_shape(parts: GGUFParts, rng: random.Random) -> tuple[str, GGUFParts]:
    index = rng.randrange(len(parts.tensors))
    dims = list(parts.tensors[index].dims)
    change = rng.choice(["zero", "overflow", "huge", "extra", "drop", "double"])
    if change == "zero":
        dims[rng.randrange(len(dims))] = 0
    elif change == "overflow":
        dims = [*dims[:1], 2**40, 2**40][: max(2, len(dims))]
    elif change == "huge":
        dims[-1] = 2**64 - 1
    elif change == "extra":
        dims.append(1)
    elif change == "drop" and len(dims) > 1:
        dims.pop()
    else:
        dims[-1] *= 2
    return f"{parts.tensors[index].name} dims {dims}", with_tensor_field(parts, index, dims=dims)


def _rename(parts: GGUFParts, rng: random.Random) -> tuple[str, GGUFParts]:
    i, j = rng.sample(range(len(parts.tensors)), 2)
    name = parts.tensors[j].name
    return f"{parts.tensors[i].name} renamed {name}", with_tensor_field(parts, i, name=name)


def _counts(parts: GGUFParts, rng: random.Random) -> tuple[str, GGUFParts]:
    mutated = copy.deepcopy(parts)
    which = rng.choice(["tensor_count", "kv_count"])
    value = rng.choice([0, 1, len(parts.tensors) - 1, len(parts.entries) + 1, 2**63])
    setattr(mutated, which, value)
    return f"{which} = {value}", mutated


def _flip_header(parts: GGUFParts, rng: random.Random) -> tuple[str, bytes]:
    end = header_size(parts)
    flips = [(rng.randrange(end), rng.randrange(256)) for _ in range(rng.randint(1, 8))]
    return f"bytes {flips}", flipped(write_gguf_bytes(parts), flips)


def _poison(parts: GGUFParts, rng: random.Random) -> tuple[str, GGUFParts]:
    tensor = rng.choice(parts.tensors)
    value = rng.choice([F16_NAN, F16_INF]) if tensor.type_id > 1 else b"\x00\x00\xc0\x7f"
    if tensor.type_id == 1:  # F16
        value = F16_NAN
    return f"{tensor.name} non-finite", poisoned(parts, tensor.name, value)


_GGUF_MUTATORS: dict[str, Callable[[GGUFParts, random.Random], tuple[str, Any]]] = {
    "truncate_boundary": _truncate_at_boundary,
    "truncate": _truncate_anywhere,
    "retype": _retype,
    "rewiden": _rewiden,
    "int_extreme": _extreme_integer,
    "float_extreme": _extreme_float,
    "drop_key": _drop_key,
    "offset": _shift_offset,
    "overlap": _overlap,
    "type": _swap_type,
    "shape": _bad_shape,
    "rename": _rename,
    "counts": _counts,
    "header_flip": _flip_header,
    "nonfinite": _poison,
}


# Bad values for config.json keys, of every JSON kind.
BAD_CONFIG_VALUES: tuple[Any, ...] = (
    DELETE,
    None,
    0,
    -1,
    3,
    1.5,
    10**30,
    "x",
    "64",
    [],
    [1, 2],
    {},
    True,
)
CONFIG_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_parameters",
    "rope_theta",
    "model_type",
    "bos_token_id",
    "eos_token_id",
    "tie_word_embeddings",
    "sliding_window",
    "layer_types",
    "hidden_act",
    "torch_dtype",
    "dtype",
    "partial_rotary_factor",
    "query_pre_attn_scalar",
    "final_logit_softcapping",
)
ROPE_KEYS = (
    "rope_type",
    "rope_theta",
    "factor",
    "partial_rotary_factor",
    "original_max_position_embeddings",
    "low_freq_factor",
    "high_freq_factor",
    "beta_fast",
    "attention_factor",
    "short_factor",
    "long_factor",
)
SAFETENSORS_DTYPES = ("F32", "F16", "BF16", "I32", "I64", "U8", "BOOL", "F64", "F8_E4M3", "X")


def random_text_case(files: dict[str, bytes], rng: random.Random) -> TextCase:
    kind = rng.choice(list(_TEXT_MUTATORS))
    label, mutated = _TEXT_MUTATORS[kind](files, rng)
    return f"{kind}: {label}", mutated


def _config_value(files: dict[str, bytes], rng: random.Random) -> tuple[str, dict[str, bytes]]:
    key, value = rng.choice(CONFIG_KEYS), rng.choice(BAD_CONFIG_VALUES)
    shown = "deleted" if value is DELETE else repr(value)
    return f"{key} {shown}", with_config(files, key, value)


def _rope_value(files: dict[str, bytes], rng: random.Random) -> tuple[str, dict[str, bytes]]:
    key, value = rng.choice(ROPE_KEYS), rng.choice(BAD_CONFIG_VALUES)
    return f"rope {key} {value!r}", with_rope_parameter(files, key, value)


BAD_JSON_TEXTS = (b"", b"{", b"[1, 2]", b'"config"', b"null", b"\xff\xfe", b"{'a': 1}", b"{}")


def _config_text(files: dict[str, bytes], rng: random.Random) -> tuple[str, dict[str, bytes]]:
    text = rng.choice(BAD_JSON_TEXTS)
    return f"config.json = {text!r}", {**files, "config.json": text}


def _other_file(files: dict[str, bytes], rng: random.Random) -> tuple[str, dict[str, bytes]]:
    """The tokenizer's files and generation_config.json, broken or missing."""
    name = rng.choice(["tokenizer.json", "tokenizer_config.json", "generation_config.json"])
    data = rng.choice([None, *BAD_JSON_TEXTS, files[name][: len(files[name]) // 2]])
    return f"{name} = {data!r:.40}", with_file(files, name, data)


def _header_field(files: dict[str, bytes], rng: random.Random) -> tuple[str, dict[str, bytes]]:
    name = rng.choice(tensor_names(files))
    header, _ = split_safetensors(files[SAFETENSORS])
    start, end = header[name]["data_offsets"]
    field_name, value = rng.choice(
        [
            ("dtype", rng.choice(SAFETENSORS_DTYPES)),
            ("shape", [rng.choice([0, 1, 3, 2**40, -1]), *header[name]["shape"][1:]]),
            ("shape", [*header[name]["shape"], 1]),
            ("data_offsets", [start + rng.choice([-8, -4, 4, 8]), end]),
            ("data_offsets", [start, end + rng.choice([-4, 4, 2**40])]),
            ("data_offsets", [0, end - start]),
        ]
    )
    return f"{name} {field_name} {value}", with_header_field(files, name, field_name, value)


def _truncate_weights(files: dict[str, bytes], rng: random.Random) -> tuple[str, dict[str, bytes]]:
    raw = files[SAFETENSORS]
    at = rng.choice([0, 4, 8, 9, rng.randrange(len(raw)), len(raw) - 1])
    return f"safetensors cut at {at}", {**files, SAFETENSORS: raw[:at]}


def _flip_weights_header(
    files: dict[str, bytes], rng: random.Random
) -> tuple[str, dict[str, bytes]]:
    raw = files[SAFETENSORS]
    (size,) = struct.unpack_from("<Q", raw)
    flips = [(rng.randrange(8 + size), rng.randrange(256)) for _ in range(rng.randint(1, 4))]
    return f"safetensors bytes {flips}", {**files, SAFETENSORS: flipped(raw, flips)}


def _nonfinite(files: dict[str, bytes], rng: random.Random) -> tuple[str, dict[str, bytes]]:
    name = rng.choice(tensor_names(files))
    value = rng.choice([math.nan, math.inf, -math.inf])
    return f"{name} = {value}", poisoned_tensor(files, name, value, rng.randint(1, 3))


def _index(files: dict[str, bytes], rng: random.Random) -> tuple[str, dict[str, bytes]]:
    split = sharded(files)
    index = json.loads(split[INDEX])
    change = rng.choice(["not_json", "no_map", "map_list", "missing_shard", "drop_shard"])
    if change == "not_json":
        split[INDEX] = b"{not json"
    elif change == "no_map":
        split[INDEX] = json.dumps({"metadata": {}}).encode()
    elif change == "map_list":
        split[INDEX] = json.dumps({"weight_map": [1, 2]}).encode()
    elif change == "missing_shard":
        first = next(iter(index["weight_map"]))
        index["weight_map"][first] = "model-00003-of-00002.safetensors"
        split[INDEX] = json.dumps(index).encode()
    else:
        del split["model-00002-of-00002.safetensors"]
    return f"sharded, {change}", split


_TEXT_MUTATORS: dict[str, Callable[[dict[str, bytes], random.Random], tuple[str, Any]]] = {
    "config_value": _config_value,
    "rope_value": _rope_value,
    "config_text": _config_text,
    "other_file": _other_file,
    "header_field": _header_field,
    "truncate": _truncate_weights,
    "header_flip": _flip_weights_header,
    "nonfinite": _nonfinite,
    "index": _index,
}


# ---- LoRA adapters: a PEFT directory's files, mutated -----------------------------------------

ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"
ADAPTER_KEYS = (
    "r",
    "lora_alpha",
    "target_modules",
    "use_rslora",
    "use_dora",
    "peft_type",
    "bias",
    "layers_to_transform",
    "fan_in_fan_out",
    "modules_to_save",
)
BAD_ADAPTER_VALUES = (
    DELETE,
    None,
    0,
    -1,
    3,
    2**40,
    math.nan,
    math.inf,
    "x",
    "all-linear",
    [],
    ["q_proj", "lm_head"],
    {},
    True,
    1.5,
)


def random_adapter_case(files: dict[str, bytes], rng: random.Random) -> TextCase:
    kind = rng.choice(list(_ADAPTER_MUTATORS))
    label, mutated = _ADAPTER_MUTATORS[kind](files, rng)
    return f"{kind}: {label}", mutated


def _adapter_value(files: dict[str, bytes], rng: random.Random) -> tuple[str, dict[str, bytes]]:
    key, value = rng.choice(ADAPTER_KEYS), rng.choice(BAD_ADAPTER_VALUES)
    shown = "deleted" if value is DELETE else repr(value)
    return f"{key} {shown}", with_config(files, key, value, ADAPTER_CONFIG)


def _adapter_text(files: dict[str, bytes], rng: random.Random) -> tuple[str, dict[str, bytes]]:
    text = rng.choice([*BAD_JSON_TEXTS, None])
    return f"{ADAPTER_CONFIG} = {text!r}", with_file(files, ADAPTER_CONFIG, text)


def _adapter_header(files: dict[str, bytes], rng: random.Random) -> tuple[str, dict[str, bytes]]:
    name = rng.choice(tensor_names(files, ADAPTER_WEIGHTS))
    header, _ = split_safetensors(files[ADAPTER_WEIGHTS])
    start, end = header[name]["data_offsets"]
    rows, cols = header[name]["shape"]
    field_name, value = rng.choice(
        [
            ("dtype", rng.choice(SAFETENSORS_DTYPES)),
            ("shape", [cols, rows]),  # A and B swapped, or transposed
            ("shape", [0, cols]),  # rank 0
            ("shape", [rows, cols, 1]),
            ("data_offsets", [start, end + rng.choice([-4, 4, 2**40])]),
        ]
    )
    changed = with_header_field(files, name, field_name, value, ADAPTER_WEIGHTS)
    return f"{name} {field_name} {value}", changed


def _adapter_cut(files: dict[str, bytes], rng: random.Random) -> tuple[str, dict[str, bytes]]:
    raw = files[ADAPTER_WEIGHTS]
    at = rng.choice([0, 4, 8, 9, rng.randrange(len(raw)), len(raw) - 1])
    return f"safetensors cut at {at}", {**files, ADAPTER_WEIGHTS: raw[:at]}


def _adapter_flip(files: dict[str, bytes], rng: random.Random) -> tuple[str, dict[str, bytes]]:
    raw = files[ADAPTER_WEIGHTS]
    (size,) = struct.unpack_from("<Q", raw)
    flips = [(rng.randrange(8 + size), rng.randrange(256)) for _ in range(rng.randint(1, 4))]
    return f"safetensors bytes {flips}", {**files, ADAPTER_WEIGHTS: flipped(raw, flips)}


def _adapter_nonfinite(files: dict[str, bytes], rng: random.Random) -> tuple[str, dict[str, bytes]]:
    name = rng.choice(tensor_names(files, ADAPTER_WEIGHTS))
    value = rng.choice([math.nan, math.inf, -math.inf])
    return f"{name} = {value}", poisoned_tensor(files, name, value, 1, ADAPTER_WEIGHTS)


def _adapter_rename(files: dict[str, bytes], rng: random.Random) -> tuple[str, dict[str, bytes]]:
    """A tensor under another module's, layer's or kind's name (DoRA's magnitudes among
    them), or dropped."""
    header, data = split_safetensors(files[ADAPTER_WEIGHTS])
    name = rng.choice(tensor_names(files, ADAPTER_WEIGHTS))
    new = rng.choice(
        [
            name.replace(".layers.0.", ".layers.99."),
            name.replace("q_proj", "k_proj").replace("up_proj", "down_proj"),
            name.replace("lora_A", "lora_magnitude_vector"),
            name.replace("self_attn.q_proj", "embed_tokens"),
            name.replace(".weight", ""),
            None,
        ]
    )
    entry = header.pop(name)
    if new is not None:
        header[new] = entry
    return f"{name} -> {new}", {**files, ADAPTER_WEIGHTS: join_safetensors(header, data)}


_ADAPTER_MUTATORS: dict[str, Callable[[dict[str, bytes], random.Random], tuple[str, Any]]] = {
    "config_value": _adapter_value,
    "config_text": _adapter_text,
    "header_field": _adapter_header,
    "truncate": _adapter_cut,
    "header_flip": _adapter_flip,
    "nonfinite": _adapter_nonfinite,
    "rename": _adapter_rename,
}


# ---- the load worker ----------------------------------------------------------------------

PROMPT = "The quick brown fox"
# A clean error from generate (an EngineError: the NaN logits of absurd but finite values,
# say) is no crash, so it passes; the fuzz table counts it apart.
OK_KINDS = ("loaded", "refused", "generate_error")


@dataclass
class Outcome:
    """What loading one file did: ``loaded`` (and generated), ``refused`` (an SpnlError
    at load), ``generate_error`` (loaded, then an SpnlError from generate), ``other`` (any
    other exception), ``crash`` (the worker died) or ``timeout``."""

    kind: str
    error_type: str = ""
    message: str = ""
    traceback: str = ""
    stage: str = ""  # load or generate

    @property
    def ok(self) -> bool:
        return self.kind in OK_KINDS

    def describe(self) -> str:
        return f"{self.kind} at {self.stage}: {self.error_type}: {self.message}\n{self.traceback}"


@dataclass
class LoadWorker:
    """A child process that loads the model paths sent to it and generates a few tokens;
    a case that kills it (a segfault) is a ``crash`` outcome, and a fresh child takes the
    next case."""

    timeout_s: float = 120.0
    env: dict[str, str] = field(default_factory=dict)
    _child: subprocess.Popen | None = field(default=None, init=False, repr=False)
    _log: Any = field(default=None, init=False, repr=False)

    def run(self, path: Path, base: Path | None = None) -> Outcome:
        """Load the model at ``path``; or, given ``base``, the LoRA adapter at ``path`` on
        that model (loaded once per worker)."""
        child = self._child
        if child is None or child.poll() is not None:
            child = self._start()
        child.stdin.write(f"{path}\n" if base is None else f"{path}\t{base}\n")
        child.stdin.flush()
        with selectors.DefaultSelector() as selector:
            selector.register(child.stdout, selectors.EVENT_READ)
            if not selector.select(self.timeout_s):
                self._stop(child)
                return Outcome("timeout", message=f"no answer in {self.timeout_s} s")
        line = child.stdout.readline()
        if not line:
            return self._died(child)
        return Outcome(**json.loads(line))

    def close(self) -> None:
        if self._child is not None:
            self._child.stdin.close()
            self._child.wait(timeout=30)
            self._child = None

    def __enter__(self) -> "LoadWorker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if not k.upper().startswith("MISTRALRS_")}
        env.update({"HF_HUB_OFFLINE": "1", "PYTHONFAULTHANDLER": "1", **self.env})
        # The package of this tree, not whichever one the environment installed.
        root = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        # The child's stderr, read back after a crash; closed with the worker.
        self._log = tempfile.TemporaryFile()  # noqa: SIM115
        self._child = subprocess.Popen(
            [sys.executable, __file__, "--worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
        )
        return self._child

    def _stop(self, child: subprocess.Popen) -> None:
        child.kill()
        child.wait()
        self._child = None

    def _died(self, child: subprocess.Popen) -> Outcome:
        code = child.wait()
        self._log.seek(0)
        stderr = self._log.read().decode(errors="replace")[-4000:]
        self._child = None
        return Outcome("crash", f"exit status {code}", "the worker died", stderr, "?")


def _serve() -> None:
    """The worker's loop: one path per input line, one JSON outcome per output line. The
    library's own prints go to stderr (drained only on a crash) so they cannot mix in."""
    results = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    os.environ.setdefault("XDG_CACHE_HOME", tempfile.mkdtemp(prefix="fuzz-cache-"))
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from spnl_backend import BackendSettings

    settings = BackendSettings(device="cpu")
    bases: dict[str, Any] = {}
    for line in sys.stdin:
        path, _, base = line.rstrip("\n").partition("\t")
        if path.endswith(".segfault"):  # how the tests check that a crash is reported
            ctypes.string_at(0)
        if base:
            if base not in bases:
                from spnl_backend import load_backend

                bases[base] = load_backend(base, settings=settings)
            outcome = load_adapter_and_generate(bases[base], Path(path))
        else:
            outcome = load_and_generate(Path(path), settings)
        results.write(json.dumps(outcome.__dict__) + "\n")


def load_and_generate(path: Path, settings: Any) -> Outcome:
    """Load ``path`` and generate three greedy tokens; what happened, as an `Outcome`."""
    from spnl_backend import SpnlError, load_backend

    stage = "load"
    try:
        with load_backend(str(path), settings=settings) as backend:
            stage = "generate"
            backend.generate(PROMPT, max_tokens=3, temperature=0.0)
    except SpnlError as exc:
        kind = "refused" if stage == "load" else "generate_error"
        return Outcome(kind, type(exc).__name__, str(exc), traceback.format_exc(), stage)
    except Exception as exc:
        return Outcome("other", type(exc).__name__, str(exc), traceback.format_exc(), stage)
    return Outcome("loaded", stage=stage)


def load_adapter_and_generate(backend: Any, path: Path) -> Outcome:
    """Load the LoRA adapter at ``path`` on ``backend`` while it runs, generate three greedy
    tokens with it, unload it; what happened, as an `Outcome`."""
    from spnl_backend import SpnlError

    stage = "load"
    try:
        backend.load_adapter("fuzzed", str(path))
        stage = "generate"
        try:
            backend.generate(PROMPT, max_tokens=3, temperature=0.0, adapter="fuzzed")
        finally:
            backend.unload_adapter("fuzzed")
    except SpnlError as exc:
        kind = "refused" if stage == "load" else "generate_error"
        return Outcome(kind, type(exc).__name__, str(exc), traceback.format_exc(), stage)
    except Exception as exc:
        return Outcome("other", type(exc).__name__, str(exc), traceback.format_exc(), stage)
    return Outcome("loaded", stage=stage)


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    _serve()
