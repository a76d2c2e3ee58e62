"""A model name → the file or directory to load, tried in a fixed order.

1. a path to a ``.gguf`` file;
2. a directory with ``config.json`` and safetensors (a text model);
3. a directory of ``.gguf`` files (the file chosen by quantization preference);
4. a hub id ``org/name`` (GGUF when the name contains "GGUF"; ``org/name/file.gguf``
   names the file) found in the local Hugging Face cache, or downloaded where the
   network allows it.
"""

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..errors import ModelFileError, ModelNotFoundError
from ..log import get_logger

log = get_logger()

# The order spnl prefers quantizations in when a repository or folder holds several.
GGUF_PREFERENCE = ("Q4_K_M", "Q5_K_M", "Q8_0", "Q4_K_S")
_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+(?:/[\w.-]+\.gguf)?")


@dataclass(frozen=True)
class ModelSource:
    kind: Literal["gguf", "text"]
    path: Path  # the .gguf file, or the text model's directory
    name: str  # as the caller wrote it


def resolve_model(name: str, *, allow_download: bool = True) -> ModelSource:
    tried: list[str] = []
    try:
        path = Path(name).expanduser()
    except RuntimeError as exc:  # "~user" of a user that does not exist
        raise ModelNotFoundError(f"model {name!r} not found: {exc}") from None
    try:
        source = _from_path(path, name, tried)
    except ModelNotFoundError:  # a FileNotFoundError too, but ours
        raise
    except OSError as exc:
        raise unreadable(path, exc) from None
    if source:
        return source
    if _HUB_ID.fullmatch(name) and not path.exists():
        source = _from_hub(name, allow_download, tried)
        if source:
            return source
    raise ModelNotFoundError(f"model {name!r} not found; tried: " + "; ".join(tried))


def unreadable(path: Path, exc: OSError) -> ModelFileError:
    """A path that exists but cannot be read: the OS's reason, not "not found"."""
    reason = exc.strerror or str(exc)
    return ModelFileError(f"{path}: cannot be read: {reason} (errno {exc.errno})")


def _from_path(path: Path, name: str, tried: list[str]) -> ModelSource | None:
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            _check_readable(path)
            return ModelSource("gguf", path, name)
        tried.append(f"{path}: a file, but not a .gguf file")
    elif path.is_dir():
        _check_readable(path)
        return _from_directory(path, name, tried)
    elif path.exists():
        tried.append(f"{path}: {_kind(path)}, not a regular file")
    else:
        tried.append(f"{path}: no such file or directory")
    return None


def _kind(path: Path) -> str:
    mode = path.stat().st_mode
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a file"


def _only_regular_files(directory: Path) -> None:
    """A model directory's entries are regular files or directories: reading a FIFO or a
    device in their place would block or never end."""
    for entry in directory.iterdir():
        try:
            if not (entry.is_file() or entry.is_dir()):
                raise ModelFileError(
                    f"{entry}: {_kind(entry)}, not a regular file; a model directory may hold "
                    "only files and directories"
                )
        except FileNotFoundError:  # a dangling link: nothing will read it
            continue


def _check_readable(path: Path) -> None:
    """Raises the OS's error where ``path`` cannot be read (a directory whose listing is
    denied would otherwise look empty)."""
    if path.is_dir():
        os.listdir(path)
    else:
        with path.open("rb"):
            pass


def _from_directory(path: Path, name: str, tried: list[str]) -> ModelSource | None:
    if (path / "config.json").exists() and any(path.glob("*.safetensors")):
        _only_regular_files(path)
        return ModelSource("text", path, name)
    ggufs = sorted(p for p in path.glob("*.gguf") if p.is_file())
    if ggufs:
        return ModelSource("gguf", choose_gguf(ggufs, path, tried), name)
    tried.append(f"{path}: a directory without config.json + *.safetensors or *.gguf files")
    return None


def choose_gguf(files: list[Path], where: Path | str, tried: list[str]) -> Path:
    for quant in GGUF_PREFERENCE:
        for file in files:
            if quant.lower() in file.name.lower():
                return file
    if len(files) == 1:
        return files[0]
    listing = ", ".join(f.name for f in files)
    tried.append(f"{where}: several .gguf files and none is {'/'.join(GGUF_PREFERENCE)}: {listing}")
    raise ModelNotFoundError(
        f"{where} holds several GGUF files ({listing}) and none matches the preference "
        f"{', '.join(GGUF_PREFERENCE)}; name the file"
    )


def _from_hub(name: str, allow_download: bool, tried: list[str]) -> ModelSource | None:
    parts = name.split("/")
    repo, filename = "/".join(parts[:2]), "/".join(parts[2:])
    is_gguf = bool(filename) or "gguf" in repo.lower()
    snapshot = _hub_snapshot(repo, filename, is_gguf, allow_download, tried)
    if snapshot is None:
        return None
    if not is_gguf:
        return _from_directory(snapshot, name, tried)
    if filename:
        return ModelSource("gguf", snapshot / filename, name)
    return ModelSource("gguf", choose_gguf(sorted(snapshot.glob("*.gguf")), repo, tried), name)


def _hub_snapshot(
    repo: str, filename: str, is_gguf: bool, allow_download: bool, tried: list[str]
) -> Path | None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    patterns = (
        [filename]
        if filename
        else ["*.gguf"]
        if is_gguf
        else ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
    )
    try:
        return Path(snapshot_download(repo, allow_patterns=patterns, local_files_only=True))
    except (LocalEntryNotFoundError, ValueError):
        tried.append(f"hub id {repo!r}: not in the local Hugging Face cache (HF_HOME)")
    if not allow_download:
        return None
    log.info("model.downloading", repo=repo, files=patterns)
    try:
        return Path(snapshot_download(repo, allow_patterns=patterns))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError) as exc:
        tried.append(f"hub id {repo!r}: download failed ({type(exc).__name__}: {exc})")
        return None
