"""A fast GGUF reader: header, metadata and tensor table parsed once, tensor data read into
memory the process owns.

gguf-py's `GGUFReader` takes over ten seconds on a 262k-token vocabulary because
it builds a numpy view per array element; this reader decodes the same format
(with gguf-py's constants) in a fraction of a second. It checks the tensor table the
way llama.cpp does: every size computed with Python integers, every tensor inside the
file, aligned, and packed as GGUF writers pack them (each tensor starts where the one
before it ends, rounded up to the alignment). A truncated file, an overlapping or
misplaced tensor, or a type or shape that does not match the data fails at open,
naming the tensor.

Tensor data is read, not memory-mapped: a mapped file that is truncated or replaced
under the process (a download tool re-fetching it in place) would kill it with SIGBUS at
the next read of a weight; a read that comes up short is a `ModelFileError` instead.
"""

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType
from gguf import GGUFValueType as V

from ..errors import ModelFileError
from ..memory import host_tensor
from ..quant.ggml import SUPPORTED_TYPES, dequantize, ggml_format

_SCALARS = {
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
_NUMPY = {
    V.UINT8: "<u1",
    V.INT8: "<i1",
    V.UINT16: "<u2",
    V.INT16: "<i2",
    V.UINT32: "<u4",
    V.INT32: "<i4",
    V.FLOAT32: "<f4",
    V.BOOL: "?",
    V.UINT64: "<u8",
    V.INT64: "<i8",
    V.FLOAT64: "<f8",
}
# The fewest bytes one array item takes, so a corrupt count fails before it is read.
_MIN_ITEM_SIZE = {**{t: struct.calcsize(f) for t, f in _SCALARS.items()}, V.STRING: 8, V.ARRAY: 12}
_MAX_DIMS = 4
# Arrays of arrays: no writer nests them deeper than 2; reading is recursive, so bound it.
MAX_ARRAY_DEPTH = 16
_MAX_ELEMENTS = 2**63 - 1  # ggml counts elements in int64
_U64 = struct.Struct("<Q")
_HEADER_READ = 16 << 20  # bytes read for the header at first; doubled while it is longer


class _ShortReadError(Exception):
    """The header continues past the bytes read so far."""


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order: the contiguous (GGUF ne[0]) dimension last
    qtype: GGMLQuantizationType
    offset: int  # absolute, in the file
    nbytes: int


class _Cursor:
    """Reads little-endian GGUF values from a buffer, reporting where the buffer ends."""

    def __init__(self, buffer: memoryview, path: Path, file_size: int) -> None:
        self.buffer, self.pos, self.path, self.file_size = buffer, 0, path, file_size

    def take(self, size: int) -> memoryview:
        if self.pos + size > self.file_size:
            raise ModelFileError(
                f"{self.path}: truncated or corrupt GGUF header (needs byte "
                f"{self.pos + size:,}, the file has {self.file_size:,})"
            )
        if self.pos + size > len(self.buffer):
            raise _ShortReadError
        view = self.buffer[self.pos : self.pos + size]
        self.pos += size
        return view

    def scalar(self, vtype: V) -> Any:
        fmt = _SCALARS[vtype]
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return self._utf8(self.take(self.scalar(V.UINT64)))

    def value(self, vtype: V) -> Any:
        if vtype == V.STRING:
            return self.string()
        if vtype == V.ARRAY:
            return self.array()
        if vtype in _SCALARS:
            return self.scalar(vtype)
        raise ModelFileError(
            f"{self.path}: unknown metadata value type {vtype} at byte "
            f"{self.pos:,}; the file is corrupt"
        )

    def array(self, depth: int = 1) -> Any:
        if depth > MAX_ARRAY_DEPTH:
            raise ModelFileError(
                f"{self.path}: truncated or corrupt GGUF header (arrays nested more than "
                f"{MAX_ARRAY_DEPTH} deep at byte {self.pos:,})"
            )
        item_type, count = self.value_type(), self.scalar(V.UINT64)
        left = self.file_size - self.pos
        if count * _MIN_ITEM_SIZE[item_type] > left:
            raise ModelFileError(
                f"{self.path}: truncated or corrupt GGUF header (an array of {count:,} "
                f"{item_type.name} values at byte {self.pos:,}, with {left:,} bytes left)"
            )
        if item_type in _NUMPY:
            dtype = np.dtype(_NUMPY[item_type])
            return np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype).copy()
        if item_type == V.STRING:
            return self.strings(count)
        if item_type == V.ARRAY:
            return [self.array(depth + 1) for _ in range(count)]
        return [self.value(item_type) for _ in range(count)]

    def strings(self, count: int) -> list[str]:
        """``count`` strings in one tight loop: a vocabulary has 262k of them, and a call
        per string through `string` costs a second. Each is decoded as it is met: a list
        of 262k memoryview slices first costs a second more in the garbage collector's
        passes over them, and 50 MB."""
        buffer, pos, end = self.buffer, self.pos, min(len(self.buffer), self.file_size)
        length_at = _U64.unpack_from
        out: list[str] = []
        append = out.append
        for _ in range(count):
            if pos + 8 > end:
                break
            (size,) = length_at(buffer, pos)
            if pos + 8 + size > end:
                break
            try:
                append(str(buffer[pos + 8 : pos + 8 + size], "utf-8"))
            except UnicodeDecodeError:
                self._utf8(buffer[pos + 8 : pos + 8 + size], pos + 8)  # names the string
            pos += 8 + size
        self.pos = pos
        for _ in range(count - len(out)):  # past the bytes read: the checked path says why
            append(self.string())
        return out

    def _utf8(self, raw: memoryview, at: int | None = None) -> str:
        """``raw`` as text; ``at``: where it starts in the file (default: it ends here)."""
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as exc:
            where = at if at is not None else self.pos - len(raw)
            raise ModelFileError(
                f"{self.path}: the metadata string at byte {where:,} is not "
                f"UTF-8 ({exc.reason}); the file is corrupt"
            ) from None

    def value_type(self) -> V:
        raw = self.scalar(V.UINT32)
        try:
            return V(raw)
        except ValueError:
            raise ModelFileError(
                f"{self.path}: unknown metadata value type {raw} at byte "
                f"{self.pos:,}; the file is corrupt"
            ) from None


class GGUFFile:
    """An opened GGUF file: ``metadata``, ``tensors`` (by name), and tensor loading."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self.file_size = os.path.getsize(self.path)
        except OSError as exc:
            raise ModelFileError(f"{self.path}: cannot be read: {exc}") from None
        length = min(self.file_size, _HEADER_READ)
        while True:
            try:
                header = bytearray(length)
                self._read(0, header)
                self._parse(header)
                return
            except _ShortReadError:
                length = min(self.file_size, 2 * length)

    def _parse(self, header: bytearray) -> None:
        cursor = _Cursor(memoryview(header), self.path, self.file_size)
        self.version = self._read_preamble(cursor)
        tensor_count, kv_count = cursor.scalar(V.UINT64), cursor.scalar(V.UINT64)
        self.metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = cursor.string()
            if key in self.metadata:
                raise ModelFileError(f"{self.path}: metadata key {key!r} appears twice")
            self.metadata[key] = cursor.value(cursor.value_type())
        infos = [self._read_tensor_info(cursor) for _ in range(tensor_count)]
        self.alignment = self._alignment()
        self.tensors = self._place_all(infos, _round_up(cursor.pos, self.alignment))

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def raw(self, name: str) -> torch.Tensor:
        """The tensor's bytes as a uint8 tensor of its own (read, not mapped)."""
        info = self.tensors[name]
        data = host_tensor((info.nbytes,), torch.uint8, zeroed=False)  # read fills it or raises
        self._read(info.offset, data.numpy())
        return data

    def _read(self, offset: int, buffer: bytearray | np.ndarray) -> None:
        """Fill ``buffer`` with the bytes at ``offset``: a file that has shrunk or changed
        size since it was opened is an error, not a short read."""
        length = len(memoryview(buffer).cast("B"))
        try:
            with open(self.path, "rb") as file:
                if os.fstat(file.fileno()).st_size != self.file_size:
                    raise ModelFileError(
                        f"{self.path}: the file changed size while it was being loaded "
                        f"({self.file_size:,} bytes when opened); load it again"
                    )
                file.seek(offset)
                got = file.readinto(memoryview(buffer).cast("B"))
        except OSError as exc:
            raise ModelFileError(f"{self.path}: cannot be read: {exc}") from None
        if got != length:
            raise ModelFileError(
                f"{self.path}: truncated while loading: {got:,} of {length:,} bytes at "
                f"byte {offset:,}"
            )

    def load(self, name: str) -> torch.Tensor:
        """The tensor dequantized to float32, in torch dimension order."""
        info = self.tensors[name]
        return dequantize(self.raw(name), info.qtype, info.shape)

    def _read_preamble(self, cursor: _Cursor) -> int:
        if self.file_size < 8 or cursor.scalar(V.UINT32) != GGUF_MAGIC:
            raise ModelFileError(f"{self.path}: not a GGUF file (bad magic number)")
        version = cursor.scalar(V.UINT32)
        if version not in (2, 3):
            raise ModelFileError(
                f"{self.path}: GGUF version {version} is not supported (supported: 2, 3)"
            )
        return version

    def _read_tensor_info(self, cursor: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
        name = cursor.string()
        n_dims = cursor.scalar(V.UINT32)
        if not 1 <= n_dims <= _MAX_DIMS:
            raise ModelFileError(
                f"{self.path}: tensor {name!r} has {n_dims} dimensions; the file is corrupt"
            )
        dims = [cursor.scalar(V.UINT64) for _ in range(n_dims)]
        return name, tuple(reversed(dims)), cursor.scalar(V.UINT32), cursor.scalar(V.UINT64)

    def _alignment(self) -> int:
        value = self.metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            found = describe_value(value)
        elif value & (value - 1):
            found = str(value)
        else:
            return value
        raise ModelFileError(
            f"{self.path}: metadata key 'general.alignment' is {found}; expected a power "
            f"of two (GGUF writers use {GGUF_DEFAULT_ALIGNMENT})"
        )

    def _place_all(
        self, infos: list[tuple[str, tuple[int, ...], int, int]], data_start: int
    ) -> dict[str, GGUFTensorInfo]:
        tensors: dict[str, GGUFTensorInfo] = {}
        previous, next_start = None, data_start
        for info in infos:
            tensor = self._place(info, data_start)
            if tensor.name in tensors:
                raise ModelFileError(f"{self.path}: tensor {tensor.name!r} appears twice")
            self._check_packed(tensor, previous, next_start, data_start)
            tensors[tensor.name] = tensor
            previous, next_start = tensor, _round_up(tensor.offset + tensor.nbytes, self.alignment)
        if previous is not None and self.file_size > next_start:
            raise ModelFileError(
                f"{self.path}: {self.file_size - previous.offset - previous.nbytes:,} bytes "
                f"follow the last tensor, {_described(previous)}; the tensor table does not "
                "describe the data (a tensor's type or shape was changed)"
            )
        return tensors

    def _check_packed(
        self,
        tensor: GGUFTensorInfo,
        previous: GGUFTensorInfo | None,
        next_start: int,
        data_start: int,
    ) -> None:
        """Each tensor starts at the previous one's end rounded up to the alignment, the
        first at the start of the data section: anything else is an overlap, a gap left by
        a tensor whose type or shape was changed, or a corrupt offset."""
        relative = tensor.offset - data_start
        where = f"{self.path}: tensor {tensor.name!r} starts at data offset {relative:,}"
        if relative % self.alignment:
            raise ModelFileError(
                f"{where}, which is not a multiple of the file's alignment ({self.alignment})"
            )
        if tensor.offset == next_start:
            return
        if previous is None:
            raise ModelFileError(f"{where}; the first tensor must start the data section at 0")
        previous_end = previous.offset + previous.nbytes - data_start
        if tensor.offset < next_start:
            raise ModelFileError(
                f"{where}, inside {_described(previous)}, which ends at data offset "
                f"{previous_end:,}: the tensors overlap"
            )
        raise ModelFileError(
            f"{where}, {tensor.offset - next_start:,} bytes after the end of "
            f"{_described(previous)} (data offset {previous_end:,}, padded to "
            f"{next_start - data_start:,}); the tensor table does not describe the data "
            "(a tensor's type or shape was changed)"
        )

    def _place(
        self, info: tuple[str, tuple[int, ...], int, int], data_start: int
    ) -> GGUFTensorInfo:
        name, shape, type_id, relative = info
        qtype = self._qtype(name, type_id)
        fmt = ggml_format(qtype)
        if min(shape) < 1:
            raise ModelFileError(
                f"{self.path}: tensor {name!r} has shape {shape}; every dimension must be >= 1"
            )
        elements = math.prod(shape)  # Python integers: no wrap-around
        if elements > _MAX_ELEMENTS:
            raise ModelFileError(
                f"{self.path}: tensor {name!r} has shape {shape}, {elements:,} elements, "
                f"more than ggml can count ({_MAX_ELEMENTS:,}); the file is corrupt"
            )
        if shape[-1] % fmt.block_size:
            raise ModelFileError(
                f"{self.path}: tensor {name!r} rows of {shape[-1]} elements "
                f"do not split into {qtype.name} blocks of {fmt.block_size}"
            )
        nbytes = fmt.nbytes(elements)
        offset = data_start + relative
        if offset > self.file_size:
            raise ModelFileError(
                f"{self.path}: tensor {name!r} starts at byte {offset:,}, past the end of the "
                f"file ({self.file_size:,} bytes); the tensor table is corrupt"
            )
        if offset + nbytes > self.file_size:
            raise ModelFileError(
                f"{self.path}: truncated: tensor {name!r} needs bytes {offset:,}..."
                f"{offset + nbytes:,} but the file has {self.file_size:,} bytes"
            )
        return GGUFTensorInfo(name, shape, qtype, offset, nbytes)

    def _qtype(self, name: str, type_id: int) -> GGMLQuantizationType:
        try:
            qtype = GGMLQuantizationType(type_id)
        except ValueError:
            qtype = None
        if qtype not in SUPPORTED_TYPES:
            kind = qtype.name if qtype else f"unknown type id {type_id}"
            raise ModelFileError(
                f"{self.path}: tensor {name!r} is stored as {kind}, which is not supported; "
                "supported: " + ", ".join(t.name for t in SUPPORTED_TYPES)
            )
        return qtype


def _round_up(position: int, alignment: int) -> int:
    return -(-position // alignment) * alignment


def _described(tensor: GGUFTensorInfo) -> str:
    return f"tensor {tensor.name!r} ({tensor.qtype.name}, shape {tensor.shape})"


def describe_value(value: Any) -> str:
    """A metadata value as an error message shows it: its kind, and the value if short."""
    if isinstance(value, np.ndarray):
        return f"an array of {len(value):,} {value.dtype.name} values"
    if isinstance(value, list):
        kinds = sorted({type(v).__name__ for v in value}) or ["no"]
        return f"an array of {len(value):,} {'/'.join(kinds)} values"
    if isinstance(value, str):
        return f"the string {value[:40]!r}"
    return f"{value!r} ({type(value).__name__})"
