"""What a KV tier entry must have been computed with to be used: one digest of the model's
weights, architecture and tokenizer, of how the pool stores K and V (dtype, codec, FP8
scales, block size, byte layout), and of the settings that decide blocks' keys and
positions. Two processes with equal fingerprints compute equal blocks under equal keys."""

import contextlib
import dataclasses
import hashlib
import json
import os
import secrets
from pathlib import Path
from typing import Any

from ..settings import BackendSettings
from .cache import CacheInfo

FORMAT = 2  # of the entries' bytes (`kv_tier`)
_CHUNK = 1 << 20
_DIGESTS = ".weights-digests.json"  # in the tier's root: files already hashed


def tier_fingerprint(
    source: Path,
    config: object,
    tokenizer_definition: str,
    settings: BackendSettings,
    info: CacheInfo,
    storage: dict[str, Any],
    root: Path,
    dtype: object = None,
    device: str = "cpu",
) -> bytes:
    """``source``: the model's file or directory, whose bytes are hashed (once per file
    version: the digests are kept in ``root``); ``storage``: how the pool lays a block's
    bytes out (its tensors' shapes and dtypes, FP8 scales, codec)."""
    parts = {
        "format": FORMAT,
        "weights": weights_digest(source, root),
        "isq": str(settings.isq),
        # What decides a block's bits besides the weights: the compute's dtype and device
        # and the CPU's paths (int8 or float activations; batch invariance's fixed orders).
        "compute": {
            "dtype": str(dtype),
            "device": device,
            "cpu_kernels": settings.cpu_kernels,
            "cpu_matmul": settings.cpu_matmul,
            "cpu_gemm": settings.cpu_gemm,
            "batch_invariant": settings.batch_invariant,
        },
        "config": dataclasses.asdict(config),  # type: ignore[call-overload]
        "tokenizer": hashlib.sha256(tokenizer_definition.encode()).hexdigest(),
        "cache": {
            "dtype": str(info.dtype),
            "compression": info.compression,
            "block_size": info.block_size,
            "bytes_per_token": info.bytes_per_token,
            **storage,
        },
        "keys": {
            "pic_reuse": settings.pic_reuse,
            "span_query_reuse": settings.span_query_reuse,
            "pic_positions": settings.pic_positions,
        },
    }
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).digest()


def weights_digest(source: Path, root: Path) -> str:
    """SHA-256 over the model's files (a GGUF, or a directory's files in name order),
    each hashed once per size and modification time (the digests kept in ``root``)."""
    files = [source] if source.is_file() else sorted(p for p in source.iterdir() if p.is_file())
    known = _read_digests(root)
    total = hashlib.sha256()
    for path in files:
        if path.name.startswith("."):
            continue
        stat = path.stat()  # ctime and inode too: a copy that kept the mtime is new
        stamp = (
            f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ctime_ns}|{stat.st_ino}"
        )
        if stamp not in known:
            known[stamp] = _file_digest(path)
        total.update(f"{path.name}:{known[stamp]}\n".encode())
    _write_digests(root, known)
    return total.hexdigest()


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _read_digests(root: Path) -> dict[str, str]:
    with contextlib.suppress(OSError, ValueError):
        known = json.loads((root / _DIGESTS).read_text())
        if isinstance(known, dict):
            return {str(k): str(v) for k, v in known.items()}
    return {}


def _write_digests(root: Path, known: dict[str, str]) -> None:
    """Best effort (a read-only directory only costs the next start a rehash)."""
    temp = root / f"{_DIGESTS}.{secrets.token_hex(8)}.tmp"
    with contextlib.suppress(OSError):
        # Created here, never an existing file or a link someone placed under the name.
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, "w") as file:
            file.write(json.dumps(known))
        os.replace(temp, root / _DIGESTS)
