"""Which spnl-backend this is: the package's version and, when it runs from a git
clone, the commit checked out (so that a bug report can name the code exactly).

The revision is read from the clone's files (``.git/HEAD``, then the loose ref or
``packed-refs``) rather than by running git, which may not be installed and would cost
a process at every start.
"""

import functools
import re
from importlib import metadata
from pathlib import Path

DISTRIBUTION = "spnl-backend"
_CLONE = Path(__file__).resolve().parents[1]  # the clone's root, for an editable install
_HASH = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")  # SHA-1 or SHA-256 repositories


def package_version() -> str:
    """The installed distribution's version ("unknown" when imported uninstalled)."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "unknown"


@functools.cache
def git_revision(root: Path = _CLONE) -> str | None:
    """The commit checked out where the package lives in a git clone; None otherwise
    (an installed wheel), or where the clone's files cannot be read."""
    try:
        git_dir = _git_dir(root)
        if git_dir is None:
            return None
        head = (git_dir / "HEAD").read_text().strip()
        if not head.startswith("ref:"):  # a detached HEAD holds the hash itself
            return head if _HASH.fullmatch(head) else None
        return _resolve_ref(_common_dir(git_dir), git_dir, head.removeprefix("ref:").strip())
    except (OSError, UnicodeDecodeError):
        return None


def version_info() -> dict[str, str | None]:
    """What `--version`, `info`, `/health` and `/v1/models` report."""
    return {"version": package_version(), "git_revision": git_revision()}


def version_line() -> str:
    revision = git_revision()
    return f"{DISTRIBUTION} {package_version()}" + (f" (git {revision})" if revision else "")


def _git_dir(root: Path) -> Path | None:
    """The clone's git directory: ``.git`` itself, or where a worktree's ``.git`` file
    points."""
    dot_git = root / ".git"
    if dot_git.is_dir():
        return dot_git
    if dot_git.is_file():
        text = dot_git.read_text().strip()
        if text.startswith("gitdir:"):
            return (root / text.removeprefix("gitdir:").strip()).resolve()
    return None


def _common_dir(git_dir: Path) -> Path:
    """Where the refs live: a worktree's git directory names the main one."""
    common = git_dir / "commondir"
    return (git_dir / common.read_text().strip()).resolve() if common.is_file() else git_dir


def _resolve_ref(common: Path, git_dir: Path, ref: str) -> str | None:
    for place in (git_dir, common):  # a worktree's own refs first (HEAD-like ones)
        loose = place / ref
        if loose.is_file():
            value = loose.read_text().strip()
            return value if _HASH.fullmatch(value) else None
    packed = common / "packed-refs"
    if packed.is_file():
        for line in packed.read_text().splitlines():
            value, _, name = line.partition(" ")
            if name == ref and _HASH.fullmatch(value):
                return value
    return None  # a branch with no commit yet
