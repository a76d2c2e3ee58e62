"""The version: `--version`, and the package version with the git revision in `info`,
`/health` and `/v1/models`; the revision read from a clone's files, None elsewhere."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from live_server import LiveServer

from spnl_backend.cli import main
from spnl_backend.version import git_revision, package_version, version_info

ROOT = Path(__file__).resolve().parents[1]
A, B = "a" * 40, "b" * 40


def _clone(tmp_path: Path, head: str) -> Path:
    (tmp_path / ".git" / "refs" / "heads").mkdir(parents=True)
    (tmp_path / ".git" / "HEAD").write_text(head + "\n")
    return tmp_path


def test_a_branch_is_read_from_its_loose_ref(tmp_path):
    root = _clone(tmp_path, "ref: refs/heads/main")
    (root / ".git" / "refs" / "heads" / "main").write_text(A + "\n")
    assert git_revision(root) == A


def test_a_branch_is_read_from_packed_refs(tmp_path):
    root = _clone(tmp_path, "ref: refs/heads/main")
    (root / ".git" / "packed-refs").write_text(
        f"# pack-refs\n{B} refs/heads/other\n{A} refs/heads/main\n"
    )
    assert git_revision(root) == A


def test_a_detached_head_is_its_hash(tmp_path):
    assert git_revision(_clone(tmp_path, A)) == A


def test_a_worktree_reads_the_main_clones_refs(tmp_path):
    main_git = _clone(tmp_path / "main", "ref: refs/heads/main") / ".git"
    (main_git / "refs" / "heads" / "feature").write_text(B + "\n")
    worktree_git = main_git / "worktrees" / "feature"
    worktree_git.mkdir(parents=True)
    (worktree_git / "HEAD").write_text("ref: refs/heads/feature\n")
    (worktree_git / "commondir").write_text("../..\n")
    (tmp_path / "wt").mkdir()
    (tmp_path / "wt" / ".git").write_text(f"gitdir: {worktree_git}\n")
    assert git_revision(tmp_path / "wt") == B


@pytest.mark.parametrize("head", [None, "ref: refs/heads/unborn", "not a hash"])
def test_no_revision_outside_a_clone_or_without_a_commit(tmp_path, head):
    root = tmp_path if head is None else _clone(tmp_path, head)
    assert git_revision(root) is None


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_this_checkouts_revision_is_gits():
    if not (ROOT / ".git").exists():
        pytest.skip("not run from a git clone")
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert git_revision() == head.stdout.strip()


def test_version_prints_the_version_and_revision_and_exits_0():
    done = subprocess.run(
        [sys.executable, "-m", "spnl_backend.cli", "--version"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    revision = git_revision()
    expected = f"spnl-backend {package_version()}" + (f" (git {revision})" if revision else "")
    assert done.stdout.strip() == expected


def test_info_names_the_version(capsys):
    assert main(["info"]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith(f"spnl-backend {package_version()}")
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert {k: info[k] for k in ("version", "git_revision")} == version_info()


def test_health_and_models_name_the_version():
    server = LiveServer(None)  # no model: /health says it is loading, with the version
    try:
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503
        assert health.json() == {"status": "loading", **version_info()}
        (model,) = httpx.get(server.url + "/v1/models").json()["data"]
        assert model["meta"] == version_info()
    finally:
        server.stop()
