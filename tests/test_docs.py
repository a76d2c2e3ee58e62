"""The documentation: the site builds with `mkdocs build --strict` (a broken link, a missing
anchor or a missing include fails it), the README stays a five-minute start with the whole
configuration table, and every code example runs, so that none can rot.

How examples are run: every fenced block of README.md, ARCHITECTURE.md and docs/*.md is
taken by the language its fence names (docs/testing.md says the same to writers):

- ``python``: run as written, in a fresh interpreter in an empty folder; it must exit 0.
  Most load the embedded default model, so these are ``slow``; keep each quick (a small
  ``max_tokens`` on every generation).
- ``bash`` (or ``sh``, ``console``): each command is checked by what it runs:
  ``spnl-backend ...`` is parsed by the command line's own parser; ``python bench/NAME.py
  ...`` and ``python -m bench.NAME ...`` by that script's own parser; ``curl ...`` runs
  against a live server and must get no HTTP error; ``python -c CODE`` runs like a python
  block; ``export NAME=VALUE`` sets NAME for the commands after it; ``MISTRALRS_*=VALUE``
  before a command must be a setting and a value it accepts; the set-up commands (a venv,
  ``pip install``, ``python -m pytest``) must be commands that ``.ci/run`` runs. Any
  other command fails: make it one of these, or put it in prose.
- ``toml`` and ``json``: parsed.
- ``text``, or no language: not run (output, a command's synopsis, a diagram).
- Any other language fails.

Examples that start a server (`spnl-backend serve ... &`) or reach one at 127.0.0.1:8000
or localhost:8000 (`serve`'s defaults) run as a user runs them: a page's such blocks in
order, shell blocks by bash itself (``set -e``), in one folder whose ``.venv`` is this
venv, with no help from the tests: a server must be started, and waited for, by the
blocks. The tests only set the environment (a free port in place of 8000, an HTTP error
failing curl) and stop the servers the blocks left running, by their process groups.
A python example that imports a package that is not installed (spnl, which the dev extra
installs only on Linux x86-64) is skipped, saying which.
"""

import html
import json
import os
import re
import socket
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest
from doc_blocks import (
    PAGES,
    ROOT,
    Block,
    LiveUser,
    blocks,
    check_shell,
    example_env,
    group_alive,
    inline_bench_commands,
    is_live,
    run_python,
    run_python_example,
)

from spnl_backend.errors import SpnlError

README = ROOT / "README.md"
README_MAX_LINES = 400
BLOCKS = [block for page in PAGES for block in blocks(page)]


def _not_run(text: str, env: dict[str, str], cwd: Path) -> None:
    pass


def _parsed(parse: Callable[[str], object]) -> Callable[[str, dict[str, str], Path], None]:
    """A check that only parses the block."""

    def check(text: str, env: dict[str, str], cwd: Path) -> None:
        parse(text)

    return check


CHECKS = {
    "python": run_python_example,
    "bash": check_shell,
    "sh": check_shell,
    "console": check_shell,
    "toml": _parsed(tomllib.loads),
    "json": _parsed(json.loads),
    "text": _not_run,
    "": _not_run,
}


def _param(block: Block):
    slow = block.lang == "python" or "python -c" in block.text
    return pytest.param(block, id=block.name, marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("block", [_param(block) for block in BLOCKS if not is_live(block)])
def test_code_example_runs(block: Block, tmp_path: Path):
    check_block(block.lang, block.text, tmp_path)


def check_block(lang: str, text: str, cwd: Path) -> None:
    assert lang in CHECKS, f"no check for ```{lang} blocks"
    CHECKS[lang](text, example_env(), cwd)


# ---- the examples that serve, run in order as a user runs them ------------------------------

LIVE_PAGES = [page for page in PAGES if any(is_live(block) for block in blocks(page))]


@pytest.mark.slow
@pytest.mark.parametrize(
    "page", [pytest.param(page, id=str(page.relative_to(ROOT))) for page in LIVE_PAGES]
)
def test_serving_examples_run_in_order_as_written(page: Path, tmp_path: Path):
    user = LiveUser(tmp_path, _free_port())
    try:
        for block in filter(is_live, blocks(page)):
            user.run(block)
    finally:
        user.stop_servers()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_server_example_that_does_not_wait_for_it_fails(tmp_path: Path):
    """What the README's serving example did: curl at once, while the server starts."""
    user = LiveUser(tmp_path, _free_port())
    script = "sleep 30 &\ncurl -s http://127.0.0.1:8000/v1/models\n"
    try:
        with pytest.raises(AssertionError, match="exit 7"):
            user.run(Block(ROOT / "README.md", 1, "bash", script))
        assert len(user.groups) == 1
    finally:
        user.stop_servers()
    assert not group_alive(user.groups[0])


def test_an_http_error_fails_a_curl_example(tmp_path: Path):
    user = LiveUser(tmp_path, _free_port())
    server = f"python3 -m http.server {user.port} --bind 127.0.0.1 &\n"
    wait = "until curl -s 127.0.0.1:8000/ >/dev/null; do sleep 0.2; done\n"
    script = server + wait + "curl -s 127.0.0.1:8000/no-such-page\n"
    try:
        with pytest.raises(AssertionError, match="exit 22"):
            user.run(Block(ROOT / "README.md", 1, "bash", script))
    finally:
        user.stop_servers()


# ---- the site -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # Material's notice on stderr
        capture_output=True,
        text=True,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "WARNING" not in output, output
    return out


def test_the_site_builds_strict_with_no_warning(site: Path):
    assert (site / "index.html").is_file()
    for page in (ROOT / "docs").glob("*.md"):
        built = site / "index.html" if page.stem == "index" else site / page.stem / "index.html"
        assert built.is_file(), page


def test_the_architecture_page_is_architecture_md_itself(site: Path):
    built = html.unescape((site / "architecture" / "index.html").read_text())
    headings = re.findall(r"^## (.+)$", (ROOT / "ARCHITECTURE.md").read_text(), re.MULTILINE)
    assert headings
    for heading in headings:
        assert heading.replace("`", "") in re.sub(r"<[^>]+>", "", built), heading


# ---- the README ----------------------------------------------------------------------------


def test_the_readme_is_a_five_minute_start():
    assert len(README.read_text().splitlines()) <= README_MAX_LINES


def test_the_readme_configuration_table_names_every_setting():
    from spnl_backend import BackendSettings
    from spnl_backend.settings.backend_settings import ENV_PREFIX

    section = README.read_text().split("## Configuration", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    named = {name for row in rows for name in re.findall(r"`(MISTRALRS_\w+)`", row.split("|")[1])}
    assert named == {ENV_PREFIX + field.upper() for field in BackendSettings.model_fields}


def test_the_readme_links_lead_somewhere(site: Path):
    text = README.read_text()
    own = {_github_slug(h) for h in re.findall(r"^#+ (.+)$", text, re.MULTILINE)}
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if "://" in target:
            continue
        path, _, anchor = target.partition("#")
        if not path:
            assert anchor in own, target
            continue
        assert (ROOT / path).exists(), target
        if anchor:
            page = Path(path).relative_to("docs").with_suffix("")
            built = site / ("" if page.name == "index" else page) / "index.html"
            assert f'id="{anchor}"' in built.read_text(), target


def _github_slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower()).replace(" ", "-")


# ---- the checks themselves fail where they should -------------------------------------------


@pytest.mark.parametrize(
    "script",
    [
        "python bench/decode.py --no-such-option\n",
        "spnl-backend serve --port eighty\n",
        "MISTRALRS_ISQ=Q9 spnl-backend info\n",
        "MISTRALRS_NO_SUCH_SETTING=1 spnl-backend info\n",
        ".venv/bin/pip install spnl-backend\n",
        "make docs\n",
    ],
)
def test_a_shell_example_that_cannot_run_fails(script: str, tmp_path: Path):
    with pytest.raises((AssertionError, SpnlError)):
        check_shell(script, example_env(), tmp_path)


def test_a_python_example_that_fails_fails(tmp_path: Path):
    with pytest.raises(AssertionError, match="exit 3"):
        run_python("raise SystemExit(3)", example_env(), tmp_path)


def test_a_block_in_an_unknown_language_fails(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text("Text.\n\n```rust\nfn main() {}\n```\n")
    (block,) = blocks(page)
    with pytest.raises(AssertionError, match="no check for ```rust"):
        check_block(block.lang, block.text, tmp_path)


def test_a_toml_example_that_does_not_parse_fails(tmp_path: Path):
    with pytest.raises(tomllib.TOMLDecodeError):
        check_block("toml", "[table\n", tmp_path)


INLINE = [(page, line, command) for page in PAGES for line, command in inline_bench_commands(page)]


@pytest.mark.parametrize(
    ("page", "line", "command"),
    [pytest.param(*case, id=f"{case[0].relative_to(ROOT)}:{case[1]}") for case in INLINE],
)
def test_bench_command_in_prose_parses(page: Path, line: int, command: str, tmp_path: Path):
    check_shell(command + "\n", example_env(), tmp_path)
